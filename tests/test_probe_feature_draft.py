"""scripts/probe_feature_draft.py on tiny models: the feature drafts read the target's states through the target's
own head (or start as the plain layer draft), the probe's speculative loop reproduces vanilla greedy decoding and
keeps every token the target drafts for itself, and training raises acceptance."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch

from conftest import make_model
from train.batches import Example
from train.models import draft_from_layers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import probe_feature_draft as probe  # noqa: E402

V = 64
EVERYTHING = torch.arange(V)


def _vanilla(target, ids: list[int], n: int, eos: int) -> list[int]:
    x = torch.tensor([ids])
    out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, eos_token_id=eos,
                          pad_token_id=0)
    return out[0, len(ids):].tolist()


def _target_text(target, n: int, length: int) -> list[Example]:
    g = torch.Generator().manual_seed(1)
    examples = []
    for i in range(n):
        prompt = torch.randint(3, V, (8,), generator=g).tolist()
        examples.append(Example(ids=prompt + _vanilla(target, prompt, length, eos=-1), start=len(prompt), row=i))
    return examples


def test_the_eagle_draft_reads_a_target_state_as_the_target_does():
    target = make_model(V, layers=3)
    head = torch.arange(10, 50)
    draft = probe.FeatureDraft(target, head.tolist())
    logits, feats = probe.TargetFeatures(target)(torch.randint(0, V, (2, 12)))
    assert torch.allclose(draft.logits(feats), logits[..., head], atol=1e-5)


def test_the_layer_feature_draft_starts_as_the_plain_layer_draft():
    target = make_model(V, layers=3)
    head = torch.arange(10, 50)
    ids = torch.randint(0, V, (2, 12))
    _, feats = probe.TargetFeatures(target)(ids)
    draft = probe.FeatureLayers(target, [0, 2], head.tolist())
    with torch.no_grad():
        ours = draft.logits(draft(ids, feats[:, :-1]))
        plain = draft_from_layers(target, [0, 2])(input_ids=ids).logits[:, 1:, head]
    assert torch.allclose(ours, plain, atol=1e-5)


def test_the_speculative_loop_reproduces_vanilla_decoding_whatever_the_draft():
    target = make_model(V, layers=3)
    cached = probe.CachedTargetFeatures(target, V)
    ids = [5, 9, 17, 3, 40, 22]
    vanilla = _vanilla(target, ids, 24, eos=2)
    new, rounds = probe.speculative(cached, probe.model_proposer(target, EVERYTHING, V), ids, 4, 24, {2})
    assert new == vanilla and all(a == n == b for n, a, b in rounds)  # the target drafting for itself: every token kept
    for draft in (probe.FeatureDraft(target, EVERYTHING.tolist()), probe.FeatureLayers(target, [0], EVERYTHING.tolist())):
        new, rounds = probe.speculative(cached, probe.feature_proposer(draft.eval(), EVERYTHING, V), ids, 4, 24, {2})
        assert new == vanilla and rounds
    summary = probe.summarise([{"domain": "code", "new_tokens": len(new), "rounds": rounds, "identical": True}], 4)
    assert summary["tau"] == len(new) / (len(rounds) + 1) and 0 <= summary["alpha"] <= 1


def test_sampled_decoding_keeps_every_draft_of_the_target_itself():
    target = make_model(V, layers=3)
    g = torch.Generator().manual_seed(0)
    new, rounds = probe.speculative(probe.CachedTargetFeatures(target, V),
                                    probe.model_proposer(target, EVERYTHING, V, 0.7, g), [5, 9, 17], 4, 20, set(), 0.7, g)
    assert len(new) == 20 and all(n == a for n, a, _ in rounds)  # p = q: min(1, p/q) = 1 for every token
    assert all(abs(b - n) < 1e-4 for n, _, b in rounds)  # β = Σ min(p, q) = 1 at every position


def test_training_lowers_the_loss_and_raises_acceptance():
    target = make_model(V, layers=3)
    examples = _target_text(target, 16, 24)
    recipe = types.SimpleNamespace(train_seed=0, distill=types.SimpleNamespace(warmup_steps=5))
    states = probe.target_states(probe.TargetFeatures(target), examples, 8, 0, bf16=False)
    cached = probe.CachedTargetFeatures(target, V)
    for kind in probe.KINDS:
        args = types.SimpleNamespace(seed=0, lr=3e-3, steps=60, batch_size=8, bf16=False, kind=kind, **probe.DEFAULTS[kind])
        draft = probe.make_draft(kind, target, types.SimpleNamespace(draft=types.SimpleNamespace(layers=[0])),
                                 EVERYTHING.tolist())
        accepted = {}
        for name in ("untrained", "trained"):
            if name == "trained":
                with torch.enable_grad():
                    info = probe.train_feature_draft(args, recipe, draft, states, examples, EVERYTHING, 0)
            with torch.no_grad():
                rounds = [r for e in examples[:4] for r in probe.speculative(
                    cached, probe.feature_proposer(draft.eval(), EVERYTHING, V), e.ids[:e.start], 4, 24, set())[1]]
            accepted[name] = sum(a for _, a, _ in rounds)
        assert info["history"][-1]["loss"] < 0.8 * info["history"][0]["loss"], kind
        assert accepted["trained"] > accepted["untrained"], (kind, accepted)


def test_agreement_is_one_for_the_target_itself_and_lower_for_an_untrained_draft():
    target = make_model(V, layers=3)
    examples = _target_text(target, 4, 16)
    sequences = [(e.ids, e.start) for e in examples]
    features = probe.TargetFeatures(target)
    assert probe.agreement(features, target, EVERYTHING, sequences) == 1.0
    weak = probe.FeatureDraft(target, EVERYTHING.tolist()).eval()
    assert probe.agreement(features, weak, EVERYTHING, sequences) < 1.0
