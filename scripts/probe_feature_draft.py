"""Probe the next lever for α: drafts that read the target's hidden states, against a run's own draft.

    python scripts/probe_feature_draft.py --run runs/default [--kinds eagle,layers] [--checkpoint checkpoint-600] ...

A draft of a few target layers re-derives the target's state from the tokens. A feature draft reads it: the
target's last hidden state (before its final norm) at position t - 1 comes with token t, and the verify pass
computes it for free. Two kinds (`--kinds`):

- `eagle` (Li et al. 2024, EAGLE): fc([embed(token t); state t - 1]) -> one decoder layer (the target's last,
  copied) -> a predicted state t, which the target's own frozen final norm and head (restricted to the run's
  draft vocabulary, as the run's draft is) turn into the next token. Drafting further it reads its own
  predicted states; training unrolls that once (`--unroll 2`, EAGLE-3's "training-time test"). Loss: forward KL
  to the target's distribution plus a smooth-L1 regression on the state (scaled by the states' RMS).
- `layers`: the run's draft shape (its `draft.layers` of the target, its head) with the state added to the
  token's embedding through a linear layer that starts at zero, so training starts from the plain layer
  draft. A drafted token's state is unknown (the target has not seen it): it reads zero there, which training
  teaches by dropping 30% of the states (`--feature-dropout`). Loss: forward KL + cross-entropy on the target's
  token, as the default recipe's forward KL + sequence CE.

Each is trained on the run's generated data (`generate/`) in the run's step order (its recipe's seed, batch
size, steps, learning rate and warm-up unless overridden: equal data and steps; the target's states over the
data are computed once, in bf16 where the CPU has it, and read each epoch). Then the run's checkpoint and the
feature drafts decode the independent evaluation prompts with a fixed k at each temperature (`--temperatures
0,0.7`) through one speculative loop (the target keeps a KV cache, the drafts run over the whole sequence: it
measures acceptance, not speed; a sampled round keeps a token with probability min(1, p/q) and resamples a
rejection from the residual, with the same seed for every draft). For each: α (mean β = Σ min(p, q) over
verified draft positions, greedy: argmax matches, as `python -m eval` counts it), τ (tokens per target pass),
acceptance by draft slot and α by domain; greedy output is the target's greedy chain by construction, and the
share equal to vanilla greedy decoding (`generate`) is reported as a check. Beside it, each draft's
teacher-forced top-1 agreement with the target on training rows and on the independent prompts' greedy
answers: how much of what it learnt carries over to prompts it never saw (`--no-decode`: that alone).

Prints tables, writes JSON (default `<run>/probe_feature_draft.json`) and each trained draft
(`<run>/feature_draft_<kind>.pt`, reused by a rerun unless `--retrain`). A probe outside the pipeline:
nothing here is exported or served.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.draft_vocab import load_draft_vocab, restricted_head, subset_index  # noqa: E402
from eval.fsutil import atomic_write_json  # noqa: E402
from eval.models import describe_processor, load_model, load_tokenizer, log  # noqa: E402
from eval.prompts import builtin_prompts, encode_prompt, spread  # noqa: E402
from eval.report import eos_ids, format_table  # noqa: E402
from eval.speculative import CachedLM, residual_distribution  # noqa: E402
from train.batches import build_examples, collate, micro_batches  # noqa: E402
from train.distill import lr_lambda  # noqa: E402
from train.generate import load_generated  # noqa: E402
from train.models import cpu_has_native_bf16, draft_from_layers  # noqa: E402
from train.recipe import load_recipe  # noqa: E402


def _output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def capture_states(model, owner) -> None:
    """After each forward pass of `model`, `owner.captured` holds the output of its last decoder layer: the state
    before the final norm."""
    model.get_decoder().layers[-1].register_forward_hook(lambda module, args, out: setattr(owner, "captured", _output(out)))


class TargetFeatures:
    """The target's logits and last hidden states before the final norm (a hook on its last decoder layer), over
    whole sequences (no cache: training data)."""

    def __init__(self, target):
        self.target = target
        self.captured = None
        capture_states(target, self)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        logits = self.target(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return logits, self.captured


class CachedTargetFeatures(CachedLM):
    """The target with a KV cache (`eval.speculative.CachedLM`) that also returns its states for the new tokens."""

    def __init__(self, target, vocab_size: int):
        super().__init__(target, vocab_size)
        self.captured = None
        capture_states(target, self)

    @torch.no_grad()
    def extend(self, token_ids: list[int], keep: int):
        """Feed `token_ids`: the logits of the last `keep` positions (keep, V) and the states of all of them (1, n, d)."""
        logits = self.forward(token_ids, keep=keep)
        return logits.float(), self.captured.float()


class FeatureDraft(torch.nn.Module):
    """EAGLE: fc([embed(token t); state t-1]) -> one decoder layer (the target's last, copied) -> predicted state t;
    the target's norm and head (frozen) read it. Token embeddings are the target's (frozen). Drafting further, it
    reads its own predicted states."""

    surrogate = "predicted"

    def __init__(self, target, head_ids: list[int]):
        super().__init__()
        body = target.get_decoder()
        d = target.config.hidden_size
        self.embed = copy.deepcopy(body.embed_tokens).requires_grad_(False)
        self.norm = copy.deepcopy(body.norm).requires_grad_(False)
        self.rotary = copy.deepcopy(body.rotary_emb)
        self.layer = copy.deepcopy(body.layers[-1])
        self.fc = torch.nn.Linear(2 * d, d, bias=False)
        with torch.no_grad():  # start as "the state passes through", the token added small
            self.fc.weight.zero_()
            self.fc.weight[:, d:].copy_(torch.eye(d))
            self.fc.weight[:, :d].copy_(0.1 * torch.eye(d))
        head = target.get_output_embeddings().weight
        self.register_buffer("head", head[torch.as_tensor(head_ids)].detach().clone())
        self.float()

    def forward(self, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """ids (B, L): tokens 0..L-1; features (B, L-1, d): states at 0..L-2; returns predicted states at 1..L-1."""
        ids = ids[:, 1:]
        x = self.fc(torch.cat([self.embed(ids), features.to(self.fc.weight.dtype)], dim=-1))
        positions = torch.arange(1, ids.shape[1] + 1, device=ids.device).unsqueeze(0)  # token t sits at position t
        return _output(self.layer(x, attention_mask=None, position_ids=positions,
                                  position_embeddings=self.rotary(x, position_ids=positions)))

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return self.norm(states) @ self.head.T.to(states.dtype)


class FeatureLayers(torch.nn.Module):
    """The run's draft shape (`draft.layers` of the target, its final norm, the head over the draft vocabulary),
    reading the target's state at t - 1 too: added to token t's embedding through a linear layer that starts at
    zero, so training starts from the plain layer draft. A drafted position's state is unknown (the target has not
    seen it yet): it reads zero there, as training does where `--feature-dropout` drops a state."""

    surrogate = "zero"

    def __init__(self, target, layers: list[int], head_ids: list[int]):
        super().__init__()
        self.body = draft_from_layers(target, layers).get_decoder().float()
        self.body.embed_tokens.requires_grad_(False)
        d = target.config.hidden_size
        self.mix = torch.nn.Linear(d, d, bias=False)
        torch.nn.init.zeros_(self.mix.weight)
        head = target.get_output_embeddings().weight
        self.register_buffer("head", head[torch.as_tensor(head_ids)].detach().clone().float())
        self.captured = None
        capture_states(self.body, self)

    def forward(self, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """As `FeatureDraft.forward`; token 0 is read too (with no state), so the attention sees the whole sequence."""
        x = self.body.embed_tokens(ids)
        x = torch.cat([x[:, :1], x[:, 1:] + self.mix(features.to(x.dtype))], dim=1)
        self.body(inputs_embeds=x, use_cache=False)
        return self.captured[:, 1:]

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return self.body.norm(states) @ self.head.T.to(states.dtype)


def make_draft(kind: str, target, recipe, head_ids: list[int]):
    return FeatureDraft(target, head_ids) if kind == "eagle" else FeatureLayers(target, recipe.draft.layers, head_ids)


@torch.no_grad()
def target_states(features_of: TargetFeatures, examples, batch_size: int, pad_id: int, bf16: bool) -> dict[int, torch.Tensor]:
    """The target's states over every training example, once (bf16, by the example's row): training reads them
    each epoch instead of running the target again."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
    states, started = {}, time.perf_counter()
    for lo in range(0, len(order), batch_size):
        chunk = [examples[i] for i in order[lo:lo + batch_size]]
        batch = collate(chunk, pad_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, feats = features_of(batch.input_ids, batch.attention_mask)
        for j, e in enumerate(chunk):
            states[e.row] = feats[j, :len(e.ids)].to(torch.bfloat16).clone()
    log(f"probe: the target's states over {len(examples)} examples in {time.perf_counter() - started:.0f} s")
    return states


def padded_states(states: dict[int, torch.Tensor], batch) -> torch.Tensor:
    out = torch.zeros(*batch.input_ids.shape, next(iter(states.values())).shape[-1])
    for i, e in enumerate(batch.examples):
        out[i, :len(e.ids)] = states[e.row].float()
    return out


def train_feature_draft(args, recipe, draft, states, examples, head_ids, pad_id):
    """Train `draft` on the examples in the run's step order: forward KL to the target's distribution over the
    draft vocabulary + `reg_weight` smooth-L1 on the state + `ce_weight` cross-entropy on the target's token, over
    `unroll` passes (each reading the previous pass's predicted states)."""
    torch.manual_seed(args.seed)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(recipe.distill.warmup_steps, args.steps))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
    position = subset_index(head_ids, int(head_ids.max()) + 1)
    scale, tokens, started, history = None, 0, time.perf_counter(), []
    draft.train()
    for step in range(args.steps):
        batch = micro_batches(examples, step, batch_size=args.batch_size, grad_accum=1, world=1, rank=0,
                              seed=recipe.train_seed, pad_id=pad_id)[0]
        feats = padded_states(states, batch)
        if scale is None:
            scale = feats[batch.attention_mask.bool()].pow(2).mean().sqrt().item()
        # Predicted state j (token j + 1 read with state j) is the target's state j + 1, which predicts token j + 2.
        ids_in, want = batch.input_ids[:, :-1], feats[:, 1:-1]
        mask = batch.loss_mask[:, 1:].bool()
        labels = batch.input_ids[:, 2:][mask]
        labels = torch.where(labels < len(position), position[labels.clamp_max(len(position) - 1)], -1)
        with torch.no_grad():  # the target's distribution: its own norm and head on its state
            p_log = F.log_softmax(draft.logits(want[mask]), dim=-1)
        inputs = feats[:, :-2]
        if args.feature_dropout:
            inputs = inputs * (torch.rand(inputs.shape[:2] + (1,)) >= args.feature_dropout)
        losses = []
        with autocast:
            for _ in range(args.unroll):
                predicted = draft(ids_in, inputs)
                q_log = F.log_softmax(draft.logits(predicted[mask]).float(), dim=-1)
                loss = (p_log.exp() * (p_log - q_log)).sum(-1).mean()
                if args.reg_weight:
                    loss = loss + args.reg_weight * F.smooth_l1_loss(predicted[mask].float() / scale, want[mask] / scale)
                if args.ce_weight:
                    loss = loss + args.ce_weight * F.nll_loss(q_log, labels, ignore_index=-1)
                losses.append(loss)
                inputs = torch.cat([feats[:, :1], predicted[:, :-1].float()], dim=1)  # the next pass: predicted states
        loss = sum(losses) / len(losses)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        tokens += batch.tokens
        if step % 50 == 0 or step == args.steps - 1:
            history.append({"step": step + 1, "loss": loss.item(), "losses": [x.item() for x in losses]})
            log(f"probe: {args.kind} step {step + 1}/{args.steps} loss {loss.item():.3f} "
                f"({', '.join(f'{x.item():.3f}' for x in losses)}) {tokens / (time.perf_counter() - started):.0f} tokens/s")
    draft.eval()
    return {"seconds": time.perf_counter() - started, "tokens": tokens, "history": history, "feature_rms": scale}


def pick(logits: torch.Tensor, temperature: float, generator) -> tuple[int, torch.Tensor | None]:
    """The token (an index into `logits`) and, when sampling, the distribution it was drawn from."""
    if temperature == 0:
        return int(logits.argmax()), None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator)), probs


@torch.no_grad()
def speculative(target: CachedTargetFeatures, propose, prompt_ids, k, max_new, eos, temperature=0.0, generator=None):
    """Speculative decoding (greedy, or sampled at `temperature` with the min(1, p/q) test and the residual
    distribution); the target keeps a KV cache, the draft runs over the whole sequence each token.
    `propose(tokens (1, n + 1), states (1, n, d), k)` returns k draft token ids and, when sampling, their
    distributions over the full vocabulary (k, V). Returns the new tokens and one (drafted, accepted, beta) per
    round: beta sums Σ min(p, q) (greedy: argmax matches) over the round's verified draft positions."""
    target.reset()
    logits, feats = target.extend(list(prompt_ids), keep=1)
    tokens, new, rounds = list(prompt_ids), [], []
    bonus = pick(logits[-1], temperature, generator)[0]
    while True:
        new.append(bonus)
        if bonus in eos or len(new) >= max_new:
            return new, rounds
        drafted, q = propose(torch.tensor([tokens + [bonus]]), feats, min(k, max_new - len(new)))
        rows, fresh = target.extend([bonus] + drafted, keep=len(drafted) + 1)  # row i: the target after draft i
        accepted, beta, next_bonus = 0, 0.0, None
        for i, token in enumerate(drafted):
            if temperature == 0:
                ok = token == int(rows[i].argmax())
                beta += ok
            else:
                p = torch.softmax(rows[i] / temperature, dim=-1)
                beta += float(torch.minimum(p, q[i]).sum())
                ok = float(torch.rand((), generator=generator)) < min(1.0, float(p[token] / q[i][token]))
                if not ok:
                    next_bonus = int(torch.multinomial(residual_distribution(p, q[i]), 1, generator=generator))
            if not ok:
                break
            accepted += 1
        rounds.append((len(drafted), accepted, beta))
        target.crop(target.length - (len(drafted) - accepted))
        feats = torch.cat([feats, fresh[:, :1 + accepted]], dim=1)
        tokens += [bonus] + drafted[:accepted]
        for token in drafted[:accepted]:
            new.append(token)
            if token in eos or len(new) >= max_new:
                return new, rounds
        bonus = next_bonus if next_bonus is not None else pick(rows[accepted], temperature, generator)[0]


def _full(probs: torch.Tensor | None, head_ids: torch.Tensor, vocab: int) -> torch.Tensor | None:
    return None if probs is None else probs.new_zeros(vocab).index_copy_(0, head_ids, probs)


def _proposer(next_logits, head_ids: torch.Tensor, vocab: int, temperature: float, generator):
    """`propose(tokens, feats, k)` for the speculative loop: k tokens, each picked from `next_logits(ids, state)`
    (the next token's logits over the draft vocabulary, and the state the next call reads)."""
    def propose(tokens, feats, k):
        ids, state, out, qs = tokens, feats.float(), [], []
        for _ in range(k):
            logits, state = next_logits(ids, state)
            index, probs = pick(logits, temperature, generator)
            out.append(int(head_ids[index]))
            qs.append(_full(probs, head_ids, vocab))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
        return out, None if temperature == 0 else torch.stack(qs)
    return propose


def feature_proposer(draft, head_ids: torch.Tensor, vocab: int, temperature=0.0, generator=None):
    def next_logits(ids, inputs):
        last = draft(ids, inputs)[:, -1:]
        state = last if draft.surrogate == "predicted" else torch.zeros_like(last)
        return draft.logits(last[0, -1]), torch.cat([inputs, state], dim=1)
    return _proposer(next_logits, head_ids, vocab, temperature, generator)


def model_proposer(model, head_ids: torch.Tensor, vocab: int, temperature=0.0, generator=None):
    def next_logits(ids, state):
        return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1], state
    return _proposer(next_logits, head_ids, vocab, temperature, generator)


@torch.no_grad()
def agreement(target_features: TargetFeatures, draft, head_ids: torch.Tensor, sequences) -> float:
    """Teacher-forced top-1 agreement over `sequences` ((ids, start) pairs): the share of completion positions where
    the draft's first guess, from the true context (and, for a feature draft, the target's true states), is the
    target's own argmax. A draft token's first slot in greedy decoding is exactly this test."""
    agree = total = 0
    for ids, start in sequences:
        x = torch.tensor([ids])
        logits, feats = target_features(x)
        want = logits[0, :-1].argmax(-1)  # the target's token after positions 0..L-2
        if isinstance(draft, (FeatureDraft, FeatureLayers)):
            guess = draft.logits(draft(x[:, :-1], feats[:, :-2])[0])  # after positions 1..L-2
            guess = torch.cat([guess.new_zeros(1, guess.shape[-1]), guess])
        else:
            guess = draft(input_ids=x).logits[0, :-1]
        match = head_ids[guess.argmax(-1)] == want
        agree, total = agree + int(match[start - 1:].sum()), total + len(ids) - start
    return agree / max(1, total)


def summarise(records: list[dict], k: int) -> dict:
    """α (mean β over verified draft positions, as `python -m eval`) and its standard error over the requests (of
    each request's α), τ, acceptance by slot and α by domain."""
    drafted = accepted = verified = calls = generated = 0
    beta = 0.0
    by_slot_reached, by_slot_accepted, by_domain = [0] * k, [0] * k, {}
    for r in records:
        calls += len(r["rounds"]) + 1  # + the prefill pass
        generated += r["new_tokens"]
        dom = by_domain.setdefault(r["domain"], [0.0, 0])
        for n, a, b in r["rounds"]:
            reached = a + (1 if a < n else 0)
            drafted, accepted, verified, beta = drafted + n, accepted + a, verified + reached, beta + b
            dom[0], dom[1] = dom[0] + b, dom[1] + reached
            for slot in range(reached):
                by_slot_reached[slot] += 1
                by_slot_accepted[slot] += slot < a
    identical = [r["identical"] for r in records if r["identical"] is not None]
    per_request = [sum(b for *_, b in r["rounds"]) / v for r in records
                   if (v := sum(a + (a < n) for n, a, _ in r["rounds"]))]
    mean = sum(per_request) / max(1, len(per_request))
    spread = (sum((x - mean) ** 2 for x in per_request) / (len(per_request) - 1) / len(per_request)) ** 0.5 \
        if len(per_request) > 1 else None
    return {"alpha": beta / max(1, verified), "alpha_standard_error": spread,
            "alpha_empirical": accepted / max(1, verified),
            "tau": generated / max(1, calls),
            "accepted_per_round": accepted / max(1, sum(len(r["rounds"]) for r in records)),
            "acceptance_by_slot": [a / r if r else None for a, r in zip(by_slot_accepted, by_slot_reached)],
            "alpha_by_domain": {d: b / max(1, v) for d, (b, v) in sorted(by_domain.items())},
            "drafted": drafted, "accepted": accepted, "verified": verified, "target_passes": calls,
            "identical_to_vanilla": sum(identical) / len(identical) if identical else None}


KINDS = {
    "eagle": "EAGLE head: 1 layer reading the target's states",
    "layers": "the run's draft shape + the target's states",
}
DEFAULTS = {  # per kind: what its design needs (EAGLE's regression and unrolled passes; the layer draft's CE)
    "eagle": dict(unroll=2, reg_weight=1.0, ce_weight=0.0, feature_dropout=0.0),
    "layers": dict(unroll=1, reg_weight=0.0, ce_weight=1.0, feature_dropout=0.3),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a run directory with generate/, draft_vocab.json and a checkpoint")
    parser.add_argument("--checkpoint", default=None, help="the run's draft to compare with (default: its last checkpoint)")
    parser.add_argument("--kinds", default="eagle,layers", help=f"feature drafts to train and measure: {', '.join(KINDS)}")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's distill.max_steps)")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the recipe's distill.batch_size")
    parser.add_argument("--lr", type=float, default=None, help="default: the recipe's distill.lr")
    for name in ("unroll", "reg_weight", "ce_weight", "feature_dropout"):
        parser.add_argument("--" + name.replace("_", "-"), type=type(DEFAULTS["eagle"][name]), default=None,
                            help="default per kind: " + ", ".join(f"{k} {v[name]}" for k, v in DEFAULTS.items()))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--agreement-rows", type=int, default=40, help="training rows for the teacher-forced agreement")
    parser.add_argument("--no-decode", action="store_true", help="only the teacher-forced agreement, no decoding")
    parser.add_argument("--tag", default=None, help="save and label a single kind's draft under this name (default: the kind), "
                        "e.g. a control: --kinds layers --feature-dropout 1 --tag layers_without_states")
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if unknown := [k for k in kinds if k not in KINDS]:
        parser.error(f"--kinds: unknown kind {unknown[0]!r}; expected some of {', '.join(KINDS)}")
    if args.tag and len(kinds) != 1:
        parser.error("--tag names one kind's draft: give one kind in --kinds")

    run = Path(args.run)
    recipe = load_recipe(run / "recipe.yaml", [])
    args.steps = args.steps or recipe.distill.max_steps
    args.batch_size = args.batch_size or recipe.distill.batch_size
    args.lr = args.lr or recipe.distill.lr
    args.bf16 = cpu_has_native_bf16()
    torch.set_grad_enabled(False)
    tokenizer = load_tokenizer(recipe.target.model)
    target = load_model(recipe.target.model, dtype=recipe.target.dtype, device=torch.device("cpu")).eval()
    head_list = load_draft_vocab(run) or list(range(target.config.vocab_size))
    head_ids = torch.tensor(head_list)
    examples = build_examples(load_generated(run), recipe.distill.max_seq_len)
    target_features = TargetFeatures(target)
    drafts, training, states, labels = {}, {}, None, {}
    for kind in kinds:
        settings = {name: DEFAULTS[kind][name] if getattr(args, name) is None else getattr(args, name) for name in DEFAULTS[kind]}
        tag = args.tag or kind
        labels[kind] = KINDS[kind] if tag == kind else f"{tag} ({kind}, " + ", ".join(f"{n} {v}" for n, v in settings.items()) + ")"
        saved = run / f"feature_draft_{tag}.pt"
        draft = make_draft(kind, target, recipe, head_list)
        if saved.is_file() and not args.retrain:
            stored = torch.load(saved)
            draft.load_state_dict(stored["state"])
            training[kind] = stored["training"]
            log(f"probe: {kind} draft loaded from {saved}")
        else:
            if states is None:
                states = target_states(target_features, examples, args.batch_size, tokenizer.pad_token_id, args.bf16)
            with torch.enable_grad():
                training[kind] = train_feature_draft(argparse.Namespace(**{**vars(args), **settings, "kind": kind}), recipe,
                                                     draft, states, examples, head_ids, tokenizer.pad_token_id)
            training[kind]["settings"] = settings
            tmp = saved.with_suffix(".tmp")
            torch.save({"state": draft.state_dict(), "training": training[kind]}, tmp)
            tmp.replace(saved)
        drafts[kind] = draft.eval()
    checkpoints = sorted(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    checkpoint = run / args.checkpoint if args.checkpoint else checkpoints[-1]
    baseline = load_model(str(checkpoint), dtype="float32", device=torch.device("cpu")).eval()

    eos = set(eos_ids(tokenizer, target))
    vocab = target.config.vocab_size
    temperatures = [float(t) for t in args.temperatures.split(",")]
    cached_target = CachedTargetFeatures(target, vocab)
    prompts = spread(builtin_prompts("independent"), args.num_prompts)
    names = [f"{run.name} {checkpoint.name}: draft.layers {recipe.draft.layers}"] + [labels[k] for k in kinds]
    makers = {names[0]: lambda t, g: model_proposer(baseline, head_ids, vocab, t, g)}
    for kind in kinds:
        makers[labels[kind]] = lambda t, g, d=drafts[kind]: feature_proposer(d, head_ids, vocab, t, g)
    records = {(name, t): [] for name in names for t in temperatures if not args.no_decode}
    started, independent = time.perf_counter(), []
    with restricted_head(baseline, head_list):
        for i, prompt in enumerate(prompts):
            ids = encode_prompt(tokenizer, prompt)
            vanilla = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      do_sample=False, max_new_tokens=args.max_new_tokens,
                                      pad_token_id=tokenizer.pad_token_id, eos_token_id=list(eos))[0, len(ids):].tolist()
            independent.append((ids + vanilla, len(ids)))
            if args.no_decode:
                continue
            for t in temperatures:
                for name in names:
                    g = torch.Generator().manual_seed(args.seed * 1000 + i)  # the same seed for every draft
                    new, rounds = speculative(cached_target, makers[name](t, g), ids, args.k, args.max_new_tokens, eos, t, g)
                    records[name, t].append({"id": prompt.id, "domain": prompt.domain, "new_tokens": len(new),
                                             "rounds": rounds, "identical": new == vanilla if t == 0 else None})
            log(f"probe: prompt {i + 1}/{len(prompts)} ({prompt.domain}), accepted/drafted: " + "; ".join(
                f"{n} T={t:g} {sum(r[1] for r in recs[-1]['rounds'])}/{sum(r[0] for r in recs[-1]['rounds'])}"
                for (n, t), recs in records.items() for n in [n.split(':')[0]]))
        decode_seconds = time.perf_counter() - started
        rows_of = torch.randperm(len(examples), generator=torch.Generator().manual_seed(args.seed))[:args.agreement_rows]
        seen = [(examples[i].ids, examples[i].start) for i in rows_of.tolist()]
        models = {names[0]: baseline} | {labels[k]: drafts[k] for k in kinds}
        agreements = {name: {"training rows": agreement(target_features, m, head_ids, seen),
                             "independent prompts": agreement(target_features, m, head_ids, independent)}
                      for name, m in models.items()}
    print(f"teacher-forced top-1 agreement with the target ({len(seen)} training rows; the {len(independent)} independent "
          "prompts' greedy answers)")
    print(format_table(["draft", "training rows", "independent prompts"],
                       [[name, f"{a['training rows']:.3f}", f"{a['independent prompts']:.3f}"] for name, a in agreements.items()]))

    results = {key: summarise(recs, args.k) for key, recs in records.items()}
    body = lambda m: sum(p.numel() for n, p in m.named_parameters() if "embed" not in n)  # noqa: E731
    params = {names[0]: body(baseline.get_decoder()) + len(head_list) * target.config.hidden_size}
    params |= {labels[k]: body(drafts[k]) + drafts[k].head.numel() for k in kinds}
    if results:
        domains = sorted(next(iter(results.values()))["alpha_by_domain"])
        headers = (["draft", "T", "M params a token", "alpha", "± (prompts)", "tau", "accepted/round"]
                   + [f"slot {i + 1}" for i in range(args.k)] + domains + ["greedy == vanilla"])
        rows = [[name, t, f"{params[name] / 1e6:.1f}", f"{r['alpha']:.3f}", f"{r['alpha_standard_error'] or 0:.3f}",
                 f"{r['tau']:.2f}", f"{r['accepted_per_round']:.2f}"]
                + [f"{x:.2f}" if x is not None else "-" for x in r["acceptance_by_slot"]]
                + [f"{r['alpha_by_domain'][d]:.2f}" for d in domains]
                + ["-" if r["identical_to_vanilla"] is None else f"{r['identical_to_vanilla']:.2f}"]
                for (name, t), r in results.items()]
        print(f"{len(prompts)} independent evaluation prompts, {args.max_new_tokens} new tokens, k = {args.k}, "
              f"{describe_processor(torch.device('cpu'))}; decoding took {decode_seconds:.0f} s")
        print(format_table(headers, rows))
    out = Path(args.out) if args.out else run / "probe_feature_draft.json"
    atomic_write_json(out, {
        "command": " ".join(sys.argv), "processor": describe_processor(torch.device("cpu")), "run": str(run),
        "checkpoint": str(checkpoint), "settings": dict(vars(args)),
        "prompts": f"independent, {len(prompts)} (spread over domains)", "training": training,
        "agreement": agreements,
        "results": [{"draft": name, "temperature": t, "parameters_per_token": params[name], **results[name, t],
                     "requests": records[name, t]} for name, t in records]})
    log(f"probe: wrote {out}")


if __name__ == "__main__":
    main()
