"""The distill stage: the draft learns the target's distribution, on one process or many (accelerate launch).

One loop, written out in `run_distill_stage`: target forward under no_grad (or the cached top-k
log-probs from generate), draft forward, weighted sum of losses, `accelerator.backward`, clip, step,
log, checkpoint, measure. accelerate is the only wrapper: DDP, DeepSpeed ZeRO-2 and ZeRO-3 come from
the launch config.

Normalisation: every loss term is a sum over the completion tokens of the global batch (all
micro-batches of the optimizer step on all processes) divided by that global token count, so the
loss and the gradient do not depend on how the batch is split over accumulation and processes.
Data order is fixed by the seed: optimizer step s takes examples [s*G, (s+1)*G) of a per-epoch
permutation, G = batch_size * grad_accum * processes; process r, micro-batch a takes slice a*P + r.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eval.draft_vocab import FILENAME as DRAFT_VOCAB_FILE
from eval.draft_vocab import build_draft_vocab, load_draft_vocab, save_draft_vocab, subset_index
from train import losses as L
from train.errors import UserError
from train.fsutil import atomic_write_json, atomic_write_text
from train.models import cast_weights, cpu_has_native_bf16, log
from train.recipe import dump_recipe

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"


# ---------------------------------------------------------------------------- data


@dataclass
class Example:
    ids: list[int]
    """prompt + completion token ids, truncated to max_seq_len."""
    start: int
    """index of the first completion token in `ids`."""
    row: int
    """row of the generated dataset (for the cached top-k log-probs)."""


def build_examples(dataset, max_seq_len: int) -> list[Example]:
    """Generated rows as training examples; rows whose prompt leaves no room for a completion are dropped."""
    examples, dropped = [], 0
    for i, (prompt, completion) in enumerate(zip(dataset["prompt_ids"], dataset["completion_ids"])):
        if not completion or len(prompt) >= max_seq_len:
            dropped += 1
            continue
        examples.append(Example(ids=(list(prompt) + list(completion))[:max_seq_len], start=len(prompt), row=i))
    if dropped:
        log(f"distill: {dropped} of {len(dataset)} generated rows dropped (empty completion or prompt >= max_seq_len)")
    if not examples:
        raise UserError("distill: no usable training rows (every prompt is longer than distill.max_seq_len?)")
    return examples


def epoch_order(n: int, epoch: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def step_indices(n: int, step: int, global_batch: int, seed: int) -> list[int]:
    """The example indices of optimizer step `step` (0-based), continuing over epochs."""
    out, position = [], step * global_batch
    while len(out) < global_batch:
        epoch, offset = divmod(position, n)
        take = min(global_batch - len(out), n - offset)
        out.extend(epoch_order(n, epoch, seed)[offset:offset + take])
        position += take
    return out


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, L) right-padded
    attention_mask: torch.Tensor  # (B, L)
    loss_mask: torch.Tensor  # (B, L-1): position t predicts input_ids[:, t+1], a completion token
    examples: list[Example]

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def first(self) -> int:
        """The first position that predicts a completion token: logits before it are never computed."""
        return min(e.start for e in self.examples) - 1


def collate(examples: list[Example], pad_id: int) -> Batch:
    width = max(len(e.ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width - 1), dtype=torch.float32)
    for i, e in enumerate(examples):
        input_ids[i, :len(e.ids)] = torch.tensor(e.ids)
        attention[i, :len(e.ids)] = 1
        loss_mask[i, e.start - 1:len(e.ids) - 1] = 1
    return Batch(input_ids, attention, loss_mask, examples)


def topk_to_logprobs(ids: torch.Tensor, lp: torch.Tensor, vocab: int, restrict: "DraftVocab | None" = None) -> torch.Tensor:
    """Full log-prob rows (n, V) from top-k ids and log-probs (n, k): the top-k entries keep their
    log-probs and the tail mass 1 - sum(top-k) is spread uniformly over the other V - k tokens.

    With `restrict`, only its columns (n, S), in its order: the same values, not renormalised (the
    losses take a log-softmax, which renormalises over the draft vocabulary).
    """
    tail = (1 - lp.exp().sum(-1)).clamp_min(1e-8) / max(vocab - ids.shape[1], 1)  # (n,)
    if restrict is None:
        return tail.log()[:, None].expand(ids.shape[0], vocab).clone().scatter_(1, ids, lp)
    size = restrict.ids.shape[0]
    cols = restrict.index.to(ids.device)[ids]
    cols = torch.where(cols >= 0, cols, size)  # top-k tokens outside the draft vocabulary land in a column dropped below
    return tail.log()[:, None].expand(ids.shape[0], size + 1).clone().scatter_(1, cols, lp)[:, :size]


@dataclass(frozen=True)
class DraftVocab:
    """A reduced draft vocabulary in training (`draft.vocab_size`, `eval.draft_vocab`): the draft's head
    and the target's distribution are both taken over `ids` only."""

    ids: torch.Tensor
    """(S,) the token ids, ascending."""
    index: torch.Tensor
    """(V,) the position of each token id in `ids`, -1 for the others."""

    @classmethod
    def of(cls, ids: list[int], vocab: int, device) -> "DraftVocab":
        return cls(torch.as_tensor(ids, dtype=torch.long, device=device), subset_index(ids, vocab, device))

    def labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Labels as positions in `ids` and a mask of those inside it (a label outside is no target)."""
        size = self.index.shape[0]  # a draft-sampled token may be a padding row past the tokenizer's ids
        mapped = torch.where(labels < size, self.index[labels.clamp_max(size - 1)], -1)
        return mapped.clamp_min(0), mapped >= 0


def _columns(x: torch.Tensor, vocab: int, restrict: DraftVocab | None) -> torch.Tensor:
    """The vocabulary columns the losses compare: the first `vocab` (padding rows dropped), or the draft vocabulary's."""
    return x[..., :vocab] if restrict is None else x.index_select(-1, restrict.ids)


def cached_target_logits(batch: Batch, topk_ids, topk_logprobs, vocab: int, dtype, restrict: DraftVocab | None = None) -> torch.Tensor:
    """Target log-probs (B, L-1-first, V) rebuilt from the generate stage's top-k (positions first..L-2).

    Each position is a proper distribution (`topk_to_logprobs`: the tail mass spread uniformly).
    Positions outside the loss mask are left at 0 (uniform) and never count. These are log-probs at
    temperature 1; the losses divide them by the training temperature, which gives p^(1/T)
    renormalised, the tempered distribution.
    """
    B, L = batch.loss_mask.shape
    first = batch.first
    out = torch.zeros((B, L - first, vocab if restrict is None else restrict.ids.shape[0]), dtype=torch.float32)
    for i, e in enumerate(batch.examples):
        ids = torch.tensor(topk_ids[e.row], dtype=torch.long)  # (n, k)
        lp = torch.tensor(topk_logprobs[e.row], dtype=torch.float32)  # (n, k)
        n = min(ids.shape[0], len(e.ids) - e.start)
        out[i, e.start - 1 - first:e.start - 1 - first + n] = topk_to_logprobs(ids[:n], lp[:n], vocab, restrict)
    return out.to(dtype)


def masked_topk(batch: Batch, topk_ids, topk_logprobs) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached top-k (N, k) ids and log-probs of the loss positions, in the order of
    `batch.loss_mask.nonzero()` (example by example, position by position)."""
    ids, lp = [], []
    for e in batch.examples:
        n = len(e.ids) - e.start  # completion tokens = loss positions of this example
        if len(topk_ids[e.row]) < n:
            raise ValueError(f"generated row {e.row}: {len(topk_ids[e.row])} top-k rows for {n} completion tokens")
        ids.append(torch.tensor(topk_ids[e.row][:n], dtype=torch.long))
        lp.append(torch.tensor(topk_logprobs[e.row][:n], dtype=torch.float32))
    return torch.cat(ids), torch.cat(lp)


def prepare_draft_vocab(recipe, run_dir: Path, tokenizer, dataset=None, accelerator=None) -> list[int] | None:
    """The reduced draft vocabulary of this run (`draft.vocab_size`), or None for the full one.

    Built once from the generated data (the tokens with the most target probability in its top-k, or the
    most frequent completion tokens when no top-k was kept) into RUN/draft_vocab.json, which later stages
    and a resumed run read back.
    """
    from train.generate import load_generated

    size = recipe.draft.vocab_size
    if size <= 0:
        return None
    run_dir = Path(run_dir)
    path = run_dir / DRAFT_VOCAB_FILE
    vocab = len(tokenizer)
    main = accelerator is None or accelerator.is_main_process
    if main and (not path.is_file() or json.loads(path.read_text()).get("requested") != size):
        if not (run_dir / "generate" / "manifest.json").is_file():
            raise UserError(f"recipe key 'draft.vocab_size': the draft vocabulary is chosen from generated data; "
                            f"{run_dir / 'generate'} has none yet (run the generate stage first)")
        dataset = dataset if dataset is not None else load_generated(run_dir)
        completions = dataset["completion_ids"]
        if "topk_ids" in dataset.column_names:
            rows, lps = dataset["topk_ids"], dataset["topk_logprobs"]
        else:
            rows, lps = [[[t] for t in c] for c in completions], [[[0.0]] * len(c) for c in completions]
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids = build_draft_vocab(rows, lps, size, vocab, always=eos)
        inside = set(ids)
        total = sum(len(c) for c in completions)
        coverage = sum(t in inside for c in completions for t in c) / max(total, 1)
        save_draft_vocab(run_dir, ids, requested=size, vocab=vocab, generated_tokens_covered=coverage)
        log(f"draft vocabulary: {len(ids)} of {vocab} tokens, covering {100 * coverage:.1f}% of the generated tokens ({path})")
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return load_draft_vocab(run_dir)


# ---------------------------------------------------------------------------- checkpoints


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (the directory name appears only after the rename), oldest first."""
    found = []
    for path in Path(run_dir).glob("checkpoint-*"):
        m = CHECKPOINT_RE.match(path.name)
        if m and path.is_dir():
            found.append((int(m.group(1)), path))
    return sorted(found)


def checkpoint_problem(path: Path) -> str | None:
    """Why a checkpoint cannot be resumed from, or None when it looks whole."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as err:
        return f"{STATE_FILE} unreadable ({err.__class__.__name__})"
    for name in state.get("files", {}):
        f = path / name
        if not f.exists():
            return f"{name} missing"
        if f.is_file() and f.stat().st_size != state["files"][name]:
            return f"{name} has {f.stat().st_size} bytes, expected {state['files'][name]}"
    if (path / "model.safetensors").is_file():
        try:
            from safetensors import safe_open

            with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
                fh.keys()
        except Exception as err:  # noqa: BLE001 - any parse failure means damaged
            return f"model.safetensors unreadable ({err.__class__.__name__})"
    return None


def latest_good_checkpoint(run_dir: Path):
    """(step, path) of the newest checkpoint that passes `checkpoint_problem`; damaged ones are named and skipped."""
    for step, path in reversed(list_checkpoints(run_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return step, path
        log(f"distill: checkpoint {path} is damaged ({problem}); not resuming from it, trying the previous one")
    return None


def _file_sizes(directory: Path) -> dict[str, int]:
    return {p.relative_to(directory).as_posix(): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------- schedule and accelerate setup


def lr_lambda(warmup: int, total: int, floor: float = 0.1):
    """Linear warm-up, then cosine decay to `floor` of the peak learning rate."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(total - warmup, 1)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return f


def mixed_precision(setting: str) -> str:
    """`auto`: bf16 autocast on a GPU that supports it and on a CPU that multiplies bf16 natively; else none."""
    if setting != "auto":
        return setting
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    return "bf16" if cpu_has_native_bf16() else "no"


def make_accelerator(recipe):
    """The run's Accelerator (DDP or DeepSpeed from the launch config), created before any model is loaded
    so that a ZeRO-3 config partitions the models as they load."""
    from accelerate import Accelerator

    from train.dist import distributed_state

    distributed_state()  # gloo + MULTI_CPU on a machine without CUDA
    section = recipe.distill
    log_with = "wandb" if recipe.tracking.report_to == "wandb" else None
    accelerator = Accelerator(mixed_precision=mixed_precision(section.mixed_precision),
                              gradient_accumulation_steps=section.grad_accum, log_with=log_with,
                              project_dir=str(recipe.run_dir))
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        # No dataloader is prepared, so the "auto" batch values are filled here from the recipe.
        config = plugin.deepspeed_config
        config["train_micro_batch_size_per_gpu"] = section.batch_size
        config["gradient_accumulation_steps"] = section.grad_accum
        config["train_batch_size"] = section.batch_size * section.grad_accum * accelerator.num_processes
        config["gradient_clipping"] = section.max_grad_norm
    return accelerator


def zero_stage(accelerator) -> int:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return int(plugin.zero_stage) if plugin is not None else -1


def prepare_target(accelerator, target):
    """The frozen target: under ZeRO-3 a second DeepSpeed engine (inference only) so its weights stay
    partitioned across processes; otherwise the model itself on this process's device."""
    target.eval()
    target.requires_grad_(False)
    if zero_stage(accelerator) != 3:
        return target.to(accelerator.device)
    import deepspeed

    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    config = {
        "train_micro_batch_size_per_gpu": ds["train_micro_batch_size_per_gpu"],
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e4},
        "bf16": {"enabled": accelerator.mixed_precision == "bf16"},
        "fp16": {"enabled": accelerator.mixed_precision == "fp16"},
    }
    engine, *_ = deepspeed.initialize(model=target, config=config)
    engine.eval()
    return engine


# ---------------------------------------------------------------------------- the loop


def _model_logits(model, batch: Batch, device) -> torch.Tensor:
    """Logits of positions first..L-2, (B, L-1-first, V): position t predicts token t+1.

    The prompt positions before the earliest completion never enter a loss, so the output head (the
    largest matrix of a small draft) is not run on them: `logits_to_keep` keeps the last positions.
    """
    length = batch.input_ids.shape[1]
    out = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                logits_to_keep=length - batch.first)
    return out.logits[:, :-1]


def batch_losses(recipe, draft, target, batch: Batch, device, on_policy: bool = False, cached=None,
                 restrict: DraftVocab | None = None) -> dict:
    """Forward both sides of one micro-batch and return the weighted loss sums (see `loss_terms`).

    The target's logits come from its forward pass under no_grad (online, and always for on-policy
    batches) or from the cached top-k log-probs `cached = (topk_ids, topk_logprobs)`. With
    `loss_chunk_size` > 0 the draft's head runs inside the loss, chunk by chunk (`fused_batch_losses`).
    `restrict`: a reduced draft vocabulary; both distributions are taken over its tokens.
    """
    head_weight = _fused_head_weight(recipe, draft)
    if head_weight is not None:
        return fused_batch_losses(recipe, draft, head_weight, target, batch, device, on_policy, cached, restrict)
    draft_logits = _model_logits(draft, batch, device)
    vocab = draft_logits.shape[-1]
    if not _reads_target(recipe):  # sequence_ce alone learns from the target's text, not its distribution
        target_logits = None
    elif on_policy or recipe.distill.target_signal == "online":
        with torch.no_grad():
            target_logits = _model_logits(target, batch, device)
        # Same tokenizer, but the embedding matrices may be padded to different sizes (Qwen2.5 0.5B has
        # 151936 rows, 7B 152064): compare the rows both have; the rest are padding no text uses.
        vocab = min(vocab, target_logits.shape[-1])
        target_logits = _columns(target_logits, vocab, restrict)
    else:
        target_logits = cached_target_logits(batch, *cached, vocab, draft_logits.dtype, restrict).to(device)
    return loss_terms(recipe, _columns(draft_logits, vocab, restrict), target_logits, batch, on_policy, restrict)


def _active_losses(section, on_policy: bool) -> list[tuple[str, float, dict]]:
    """(name, weight, keyword arguments) of each loss term this batch computes."""
    return [(name, weight, {"beta": section.jsd_beta} if name == "jsd" else {})
            for name, weight in section.losses.items()
            # draft-written tokens are not targets; on-policy batches learn from the divergences only
            if not (on_policy and name == "sequence_ce")]


def _rows(weight: torch.Tensor, vocab: int, restrict: DraftVocab | None) -> torch.Tensor:
    """The head rows the losses use: the first `vocab`, or the draft vocabulary's."""
    return weight[:vocab] if restrict is None else weight.index_select(0, restrict.ids)


def _reads_target(recipe) -> bool:
    return any(name != "sequence_ce" for name in recipe.distill.losses)


def _unwrapped(model):
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def _fused_head_weight(recipe, model):
    """The head weight to run inside the chunked loss, or None where the plain path is taken: no
    chunking, no gradient, or a ZeRO-3-partitioned head (only its engine's hooks can gather it)."""
    if recipe.distill.loss_chunk_size <= 0 or not torch.is_grad_enabled():
        return None
    inner = _unwrapped(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_decoder") else None
    if head is None or getattr(head, "bias", None) is not None or hasattr(head.weight, "ds_id"):
        return None
    return head.weight


def _last_hidden(model, batch: Batch, device) -> torch.Tensor:
    """The model's final hidden states (after its last norm) at positions first..L-2, (B, L-1-first, H).

    The call goes through the wrapper (DDP, DeepSpeed) as usual, with the head run on one position only;
    a hook on the decoder picks up its output, which the head would have read.
    """
    captured = []
    hook = _unwrapped(model).get_decoder().register_forward_hook(lambda module, args, out: captured.append(out[0]))
    try:
        model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device), logits_to_keep=1)
    finally:
        hook.remove()
    return captured[-1][:, batch.first:-1]


def fused_batch_losses(recipe, draft, weight, target, batch: Batch, device, on_policy: bool = False, cached=None,
                       restrict: DraftVocab | None = None) -> dict:
    """`batch_losses` with the draft's head inside the loss (`losses.fused_head_loss`).

    Only the N loss positions of the micro-batch are kept (padding and prompt positions are dropped),
    and over chunks of `loss_chunk_size` of them the draft's logits, the target's (from its hidden
    states online, from the top-k cache otherwise) and every loss term's gradient exist for one chunk
    at a time. `weight` is the draft's head weight (`_fused_head_weight`). Returns the same weighted
    sums as `loss_terms`; their sum carries the gradient of all terms (the first term holds it), so
    backpropagate the sum, as the loop does.
    """
    section = recipe.distill
    keep = batch.loss_mask[:, batch.first:].bool().to(device)  # (B, T)
    hidden = _last_hidden(draft, batch, device)[keep][None]  # (1, N, H)
    labels = batch.input_ids[:, batch.first + 1:].to(device)[keep][None]  # (1, N)
    label_ok = torch.ones(labels.shape, dtype=torch.float32, device=device)
    if restrict is not None:
        labels, inside = restrict.labels(labels)
        label_ok = inside.float()
    vocab = weight.shape[0]
    if not _reads_target(recipe):
        target_chunk = None
    elif on_policy or section.target_signal == "online":
        with torch.no_grad():
            target_weight = _fused_head_weight(recipe, target)
            if target_weight is not None:  # the target's logits are made chunk by chunk too
                target_hidden = _last_hidden(target, batch, device)[keep][None]  # (1, N, H)
                vocab = min(vocab, target_weight.shape[0])
                target_head = _rows(target_weight, vocab, restrict).to(target_hidden.dtype)
                target_chunk = lambda lo, hi: target_hidden[:, lo:hi] @ target_head.T  # noqa: E731
            else:  # a partitioned (ZeRO-3) target runs its own head
                target_logits = _model_logits(target, batch, device)[keep][None]
                vocab = min(vocab, target_logits.shape[-1])
                target_chunk = lambda lo, hi: _columns(target_logits[:, lo:hi], vocab, restrict)  # noqa: E731
    else:
        topk_ids, topk_lp = masked_topk(batch, *cached)
        target_chunk = lambda lo, hi: topk_to_logprobs(topk_ids[lo:hi], topk_lp[lo:hi], vocab, restrict)[None].to(device)  # noqa: E731
    active = _active_losses(section, on_policy)
    values = {name: torch.zeros((), device=device) for name, _, _ in active}

    def chunk_value_and_grad(lo, hi, logits):  # (1, C, V) -> (), (1, C, V)
        target_logits = target_chunk(lo, hi) if target_chunk is not None else None
        ones = logits.new_ones(logits.shape[:2], dtype=torch.float32)
        grad, chunk_value = None, torch.zeros((), device=logits.device)
        for name, w, kwargs in active:
            if name == "sequence_ce":
                value, g = L.ce_value_and_grad(logits, labels[:, lo:hi], label_ok[:, lo:hi])
            else:
                value, g = L.divergence_value_and_grad(name, logits, target_logits, ones,
                                                       temperature=section.temperature, **kwargs)
            values[name] += w * value
            chunk_value += w * value
            grad = g.mul_(w) if grad is None else grad.add_(g, alpha=w)
            del g
        return chunk_value, grad

    total = L.fused_head_loss(hidden, _rows(weight, vocab, restrict), chunk_value_and_grad, section.loss_chunk_size)
    terms = {name: value.detach() for name, value in values.items()}
    if terms:
        first = next(iter(terms))
        terms[first] = terms[first] + (total - total.detach())  # the value of one term, the gradient of all
    return terms


def loss_terms(recipe, draft_logits, target_logits, batch: Batch, on_policy: bool,
               restrict: DraftVocab | None = None) -> dict[str, torch.Tensor]:
    """Each weighted loss as a sum over this micro-batch's completion tokens (normalised later, globally).

    With `restrict` the logits are over its tokens, and a label outside them counts in no sequence_ce term.
    """
    section = recipe.distill
    mask = batch.loss_mask[:, batch.first:].to(draft_logits.device)
    terms = {}
    for name, weight, kwargs in _active_losses(section, on_policy):
        if name == "sequence_ce":
            labels = batch.input_ids[:, batch.first + 1:].to(draft_logits.device)
            ce_mask = mask
            if restrict is not None:
                labels, inside = restrict.labels(labels)
                ce_mask = mask * inside
            value = L.sequence_ce(draft_logits, labels, ce_mask, reduction="sum", chunk_size=section.loss_chunk_size)
        else:
            value = L.DIVERGENCES[name](draft_logits, target_logits, mask, temperature=section.temperature,
                                        reduction="sum", chunk_size=section.loss_chunk_size, **kwargs)
        terms[name] = weight * value
    return terms


@torch.no_grad()
def on_policy_batch(draft, batch: Batch, tokenizer, max_new_tokens: int, temperature: float, seed: int,
                    synced_gpus: bool) -> Batch:
    """The same prompts, completed by the current draft (sampled at the training temperature)."""
    pad = tokenizer.pad_token_id
    prompts = [e.ids[:e.start] for e in batch.examples]
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1
    device = next(draft.parameters()).device
    was_training = draft.training
    draft.eval()
    torch.manual_seed(seed)
    out = draft.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device), do_sample=True,
                         temperature=temperature, top_k=None, top_p=None, max_new_tokens=max_new_tokens,
                         pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, synced_gpus=synced_gpus)
    draft.train(was_training)
    examples = []
    for i, e in enumerate(batch.examples):
        completion = out[i, width:].tolist()
        if tokenizer.eos_token_id in completion:
            completion = completion[: completion.index(tokenizer.eos_token_id) + 1]
        completion = completion or [tokenizer.eos_token_id]
        examples.append(Example(ids=prompts[i] + completion, start=e.start, row=e.row))
    return collate(examples, pad)


def run_distill_stage(recipe, accelerator, target, draft, tokenizer, run_dir: Path, on_checkpoint=None):
    """Train the draft; write `checkpoint-STEP/` every `checkpoint_every` steps and at the end.

    `on_checkpoint(step, path, draft)` runs on every process after each checkpoint is complete (the eval
    hook; it decides itself which process measures). Returns the list of (step, path) checkpoints.
    """
    from train.generate import load_generated

    section = recipe.distill
    run_dir = Path(run_dir)
    done_marker = run_dir / "distill" / "done.json"
    if done_marker.is_file():
        log(f"distill: already finished ({done_marker}); skipped")
        return list_checkpoints(run_dir)
    if not (run_dir / "generate" / "manifest.json").is_file():
        raise UserError(f"distill: no generated data in {run_dir / 'generate'}; run the generate stage first")
    dataset = load_generated(run_dir)
    if section.target_signal == "cached" and "topk_ids" not in dataset.column_names:
        raise UserError("recipe key 'distill.target_signal': 'cached' needs generate.topk_logprobs > 0 "
                        "(the generated data holds no top-k log-probs)")
    examples = build_examples(dataset, section.max_seq_len)
    topk_ids = dataset["topk_ids"] if section.target_signal == "cached" else None
    topk_lp = dataset["topk_logprobs"] if section.target_signal == "cached" else None
    world, rank = accelerator.num_processes, accelerator.process_index
    global_batch = section.batch_size * section.grad_accum * world
    vocab_ids = prepare_draft_vocab(recipe, run_dir, tokenizer, dataset, accelerator)
    restrict = None if vocab_ids is None else DraftVocab.of(vocab_ids, len(tokenizer), accelerator.device)

    torch.manual_seed(recipe.seed)
    if any(p.dtype != torch.float32 for p in draft.parameters()):
        # Master weights in float32; bf16 on GPU comes from autocast (mixed_precision), not from the weights.
        cast_weights(draft, torch.float32)
    if section.freeze_embeddings:
        draft.get_input_embeddings().requires_grad_(False)
        draft.get_output_embeddings().requires_grad_(False)
    draft.train()
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=section.lr,
                                  weight_decay=section.weight_decay, betas=(0.9, 0.95))
    # The schedule is stepped by hand once per optimizer step (accelerate's prepared scheduler steps
    # once per process, which would make the schedule depend on the world size).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(section.warmup_steps, section.max_steps))
    draft, optimizer = accelerator.prepare(draft, optimizer)
    target = prepare_target(accelerator, target) if (section.target_signal == "online" or section.on_policy_lambda > 0) else None
    stage = zero_stage(accelerator)
    device = accelerator.device

    start_step = 0
    resume = latest_good_checkpoint(run_dir)
    if resume is not None:
        step0, path = resume
        state = json.loads((path / STATE_FILE).read_text())
        if state["global_batch"] != global_batch:
            raise UserError(f"distill: {path} was written with a global batch of {state['global_batch']} "
                            f"sequences, this launch has {global_batch}; resume with the same batch_size x "
                            "grad_accum x processes or start a new output_dir")
        accelerator.load_state(str(path / "state"))
        scheduler.load_state_dict(state["scheduler"])
        start_step = step0
        log(f"distill: resuming from {path} (step {step0} of {section.max_steps})")

    log(f"distill: {len(examples)} examples, global batch {global_batch} sequences "
        f"({section.batch_size} x {section.grad_accum} accumulation x {world} processes), steps {start_step}->{section.max_steps}, "
        f"losses {section.losses}, target signal {section.target_signal}, on-policy lambda {section.on_policy_lambda}, "
        f"precision {accelerator.mixed_precision}" + (f", DeepSpeed ZeRO-{stage}" if stage >= 0 else "")
        + (f", draft vocabulary {len(vocab_ids)} tokens" if vocab_ids else ""))

    log_path = run_dir / "distill" / "log.jsonl"  # one JSON line of metrics per optimizer step
    if accelerator.is_main_process:
        _truncate_log(log_path, start_step)
    checkpoints = list_checkpoints(run_dir)
    bar = tqdm(total=section.max_steps, initial=start_step, desc="distill", unit="step",
               disable=not accelerator.is_main_process)
    try:
        for step in range(start_step, section.max_steps):
            t0 = time.perf_counter()
            indices = step_indices(len(examples), step, global_batch, recipe.seed)
            micro = []
            for a in range(section.grad_accum):
                lo = (a * world + rank) * section.batch_size
                micro.append(collate([examples[i] for i in indices[lo:lo + section.batch_size]], tokenizer.pad_token_id))
            # Same draw on every process: a whole optimizer step is on-policy or not.
            gen = torch.Generator().manual_seed(recipe.seed * 7_919 + step)
            on_policy = section.on_policy_lambda > 0 and torch.rand((), generator=gen).item() < section.on_policy_lambda
            if on_policy:
                unwrapped = accelerator.unwrap_model(draft)
                micro = [on_policy_batch(unwrapped, b, tokenizer, recipe.generate.max_new_tokens, section.temperature,
                                         seed=recipe.seed * 1_000_003 + step * 131 + a * 7 + rank,
                                         synced_gpus=stage == 3 and world > 1) for a, b in enumerate(micro)]
            local_tokens = torch.tensor(float(sum(b.tokens for b in micro)), device=device)
            global_tokens = accelerator.reduce(local_tokens, "sum").item()
            # accelerate divides by grad_accum, DDP/DeepSpeed average over processes: undo both so the
            # gradient is sum(all tokens) / global_tokens.
            scale = section.grad_accum * world / max(global_tokens, 1.0)
            sums = {}
            for b in micro:
                with accelerator.accumulate(draft):
                    with accelerator.autocast():
                        terms = batch_losses(recipe, draft, target, b, device, on_policy, cached=(topk_ids, topk_lp),
                                             restrict=restrict)
                    accelerator.backward(sum(terms.values()) * scale)
                    for name, value in terms.items():
                        sums[name] = sums.get(name, 0.0) + value.detach().float()
            names = sorted(sums)
            totals = accelerator.reduce(torch.stack([sums[n] for n in names]).to(device), "sum") / max(global_tokens, 1.0)
            loss_value = totals.sum().item()
            if not math.isfinite(loss_value):
                last = checkpoints[-1][1] if checkpoints else None
                raise UserError(f"distill: loss is {loss_value} at step {step + 1}; stopped. "
                                + (f"Last good checkpoint: {last}" if last else "No checkpoint was written yet"))
            grad_norm = accelerator.clip_grad_norm_(draft.parameters(), section.max_grad_norm)
            lr = scheduler.get_last_lr()[0]  # the rate this step uses
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - t0
            metrics = {"train/loss": loss_value, "train/lr": lr,
                       "train/tokens_per_s": global_tokens / elapsed, "train/tokens": global_tokens,
                       "train/on_policy": float(on_policy)}
            metrics.update({f"train/{n}": v.item() for n, v in zip(names, totals)})
            if grad_norm is not None:
                metrics["train/grad_norm"] = float(grad_norm)
            accelerator.log(metrics, step=step + 1)
            if accelerator.is_main_process:
                with log_path.open("a") as fh:
                    fh.write(json.dumps({"step": step + 1, **metrics}) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{global_tokens / elapsed:.0f}")

            if (step + 1) % section.checkpoint_every == 0 or step + 1 == section.max_steps:
                path = save_checkpoint(recipe, accelerator, draft, scheduler, tokenizer, run_dir, step + 1, global_batch)
                if on_checkpoint is not None:
                    on_checkpoint(step + 1, path, accelerator.unwrap_model(draft))
                prune_checkpoints(accelerator, run_dir, section.keep_checkpoints)
                checkpoints = list_checkpoints(run_dir)
    finally:
        bar.close()  # before any error line, so that the error is the last line printed
    if accelerator.is_main_process:
        atomic_write_json(done_marker, {"steps": section.max_steps, "checkpoints": [p.name for _, p in checkpoints]})
    accelerator.wait_for_everyone()
    return checkpoints


def _truncate_log(path: Path, last_step: int) -> None:
    """Keep the log lines of steps up to `last_step` (a resumed run rewrites the steps after its checkpoint)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = path.read_text().splitlines() if path.is_file() else []
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line + "\n")
        except (ValueError, KeyError):
            break  # a torn last line from a kill
    atomic_write_text(path, "".join(kept))


def save_checkpoint(recipe, accelerator, draft, scheduler, tokenizer, run_dir: Path, step: int, global_batch: int) -> Path:
    """Write `checkpoint-STEP/` atomically: everything goes into a hidden temporary directory that is
    renamed once complete. It holds the draft as a plain Hugging Face model (config, safetensors,
    tokenizer), the accelerate state (optimizer, RNG; DeepSpeed shards under ZeRO), the schedule and
    data position (trainer_state.json, written last) and the resolved recipe."""
    final = run_dir / f"checkpoint-{step}"
    tmp = run_dir / f".checkpoint-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        _write_checkpoint(recipe, accelerator, draft, scheduler, tokenizer, tmp, step, global_batch)
        if accelerator.is_main_process:
            if final.exists():  # a damaged checkpoint of an earlier run at the same step: replaced whole
                shutil.rmtree(final)
            tmp.rename(final)
    except BaseException:
        if accelerator.is_main_process:  # a full disk, a read-only disk: the partial directory goes
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if accelerator.is_main_process:
        log(f"distill: step {step}: checkpoint written to {final}")
    accelerator.wait_for_everyone()
    return final


def _write_checkpoint(recipe, accelerator, draft, scheduler, tokenizer, tmp: Path, step: int, global_batch: int) -> None:
    accelerator.save_state(str(tmp / "state"), safe_serialization=True)
    state_dict = accelerator.get_state_dict(draft)  # gathered from every process under ZeRO-3
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(draft)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        vocab_file = tmp.parent / DRAFT_VOCAB_FILE  # the run's draft vocabulary travels with each checkpoint
        if vocab_file.is_file():
            shutil.copy2(vocab_file, tmp / DRAFT_VOCAB_FILE)
        atomic_write_text(tmp / "recipe.yaml", dump_recipe(recipe))
        state = {"step": step, "global_batch": global_batch, "examples_seen": step * global_batch,
                 "scheduler": scheduler.state_dict(), "processes": accelerator.num_processes}
        state["files"] = _file_sizes(tmp)
        atomic_write_json(tmp / STATE_FILE, state)


def prune_checkpoints(accelerator, run_dir: Path, keep: int) -> None:
    if keep <= 0 or not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return
    summary = run_dir / "eval" / "summary.json"
    best = json.loads(summary.read_text())["best"] if summary.is_file() else None
    for _, path in list_checkpoints(run_dir)[:-keep]:
        if path.name == best:
            continue  # the best measured checkpoint is what export writes; never pruned
        shutil.rmtree(path)
        log(f"distill: removed {path} (keep_checkpoints={keep}); its eval report stays in eval/{path.name}/")
    accelerator.wait_for_everyone()
