"""Decoder correctness: greedy speculative == vanilla greedy; sampled output follows the target."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import StubDraft, make_model, trained_draft
from eval.speculative import CachedLM, speculative_decode, vanilla_decode

V = 64


@pytest.fixture(scope="module")
def target():
    return make_model(V, layers=2, seed=0)


PROMPTS = [[5, 9, 17, 3], [40, 41, 2 + 10, 7, 7, 30, 22], [11]]


@pytest.mark.parametrize("which", ["self", "random", "trained"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_equals_vanilla(target, which, k):
    draft = {"self": lambda: target, "random": lambda: make_model(V, layers=1, hidden=32, seed=7),
             "trained": lambda: trained_draft(target)}[which]()
    for prompt in PROMPTS:
        vanilla = vanilla_decode(target, prompt, max_new_tokens=40)
        spec = speculative_decode(target, draft, prompt, k=k, max_new_tokens=40)
        assert spec.output_ids == vanilla.output_ids
        assert spec.tokens_generated == 40


@pytest.mark.parametrize("which", ["random", "trained"])
def test_greedy_speculative_equals_vanilla_with_a_dynamic_draft_length(target, which):
    draft = make_model(V, layers=1, hidden=32, seed=7) if which == "random" else trained_draft(target)
    k = 6
    lengths = set()
    for prompt in PROMPTS:
        vanilla = vanilla_decode(target, prompt, max_new_tokens=40)
        with torch.no_grad():  # a threshold the draft's confidence crosses often: its median on this text
            confidence = float(draft(torch.tensor([prompt + vanilla.output_ids])).logits.softmax(-1).amax(-1).median())
        spec = speculative_decode(target, draft, prompt, k=k, max_new_tokens=40, confidence=confidence)
        assert spec.output_ids == vanilla.output_ids
        assert spec.rounds - 1 <= spec.slot_rounds[0] <= spec.rounds  # every round drafts a token (but a last one of 0)
        lengths.update(i + 1 for i in range(k) if spec.slot_rounds[i] > (spec.slot_rounds[i + 1] if i + 1 < k else 0))
    assert len(lengths) > 1, "the threshold should give rounds of different lengths"


def test_draft_confidence_sets_the_draft_length(target):
    """0 drafts k tokens a round; a threshold above every probability stops every round after one token."""
    n = 41
    vanilla = vanilla_decode(target, PROMPTS[0], max_new_tokens=n)
    never = next(t for t in range(V) if t not in vanilla.output_ids)
    fixed = speculative_decode(target, StubDraft(target, never), PROMPTS[0], k=4, max_new_tokens=n)
    # One token a round (never accepted); a round drafts min(4, tokens left - 1): 37 rounds of 4, then 3, 2, 1, 0.
    assert fixed.rounds == n and fixed.slot_rounds == [40, 39, 38, 37]
    draft = make_model(V, layers=1, hidden=32, seed=7)  # its probabilities stay far below 0.999
    one = speculative_decode(target, draft, PROMPTS[0], k=4, max_new_tokens=n, confidence=0.999)
    assert one.total_drafted == one.slot_rounds[0] > 0 and one.slot_rounds[1:] == [0, 0, 0]
    assert one.output_ids == vanilla.output_ids


def test_eos_stops_both_decoders(target):
    vanilla = vanilla_decode(target, PROMPTS[0], max_new_tokens=30)
    eos = vanilla.output_ids[12]
    first = vanilla.output_ids.index(eos)
    spec = speculative_decode(target, target, PROMPTS[0], k=4, max_new_tokens=30, eos_token_ids=[eos])
    van = vanilla_decode(target, PROMPTS[0], max_new_tokens=30, eos_token_ids=[eos])
    assert spec.output_ids == van.output_ids == vanilla.output_ids[: first + 1]
    assert spec.finish_reason == van.finish_reason == "eos"


def test_always_accepted_draft_round_counts(target):
    k, n = 4, 40
    spec = speculative_decode(target, target, PROMPTS[1], k=k, max_new_tokens=n)
    # Every round keeps k drafts plus the bonus token; the last round is shortened to fit n.
    assert spec.rounds == math.ceil(n / (k + 1))
    assert spec.total_accepted == spec.total_drafted
    assert spec.alpha == pytest.approx(1.0) and spec.alpha_empirical == 1.0 and spec.acceptance_rate == 1.0
    assert spec.slot_accepted == spec.slot_reached


def test_never_accepted_draft_round_counts(target):
    n = 30
    vanilla = vanilla_decode(target, PROMPTS[0], max_new_tokens=n)
    never = next(t for t in range(V) if t not in vanilla.output_ids)
    spec = speculative_decode(target, StubDraft(target, never), PROMPTS[0], k=3, max_new_tokens=n)
    assert spec.output_ids == vanilla.output_ids
    assert spec.rounds == n  # one token per round: the target's correction
    assert spec.total_accepted == 0 and spec.alpha == 0.0
    assert spec.slot_reached == [n - 1, 0, 0]  # only slot 0 is ever reached (the last round drafts 0)


def test_cached_and_uncached_target_logits_agree(target):
    ids = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]
    full = target(torch.tensor([ids])).logits[0]  # (T, V)
    lm = CachedLM(target, V)
    pieces = [lm.forward(ids[:4], keep=4), lm.forward(ids[4:5], keep=1), lm.forward(ids[5:], keep=5)]
    torch.testing.assert_close(torch.cat(pieces), full, atol=1e-4, rtol=1e-4)
    lm.crop(6)  # roll back and recompute the same positions
    torch.testing.assert_close(lm.forward(ids[6:], keep=4), full[6:], atol=1e-4, rtol=1e-4)


def test_fallback_guardrail_switches_to_vanilla(target):
    vanilla = vanilla_decode(target, PROMPTS[0], max_new_tokens=40)
    never = next(t for t in range(V) if t not in vanilla.output_ids)
    spec = speculative_decode(target, StubDraft(target, never), PROMPTS[0], k=3, max_new_tokens=40,
                              fallback_window=10, fallback_threshold=0.4)
    assert spec.fallback_triggered and spec.fallback_at == 10
    assert spec.output_ids == vanilla.output_ids
    good = speculative_decode(target, target, PROMPTS[0], k=3, max_new_tokens=40,
                              fallback_window=10, fallback_threshold=0.4)
    assert not good.fallback_triggered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linears_compute_the_same_logits_and_restore_the_model(dtype):
    from eval.packed import packed_linears, packing_supported

    if not packing_supported(dtype):
        pytest.skip(f"oneDNN packing of {dtype} is not supported on this CPU")
    model = make_model(V, layers=2, seed=0).to(dtype).eval()
    ids = torch.tensor([[3, 14, 15, 9, 26, 5]])
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    keys = set(model.state_dict())
    with torch.no_grad():
        plain = model(ids).logits.float()
        with packed_linears(model), packed_linears(model):  # nested: the target as its own draft
            assert all("forward" in vars(m) and hasattr(m, "_packed_weight") for m in linears)
            packed = model(ids).logits.float()
        after = model(ids).logits.float()
    assert not any("forward" in vars(m) or hasattr(m, "_packed_weight") for m in linears)
    assert set(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied weights stay tied
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(packed, plain, atol=tol, rtol=tol)
    torch.testing.assert_close(after, plain, atol=0, rtol=0)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_equals_vanilla_with_packed_linears(target, k):
    from eval.packed import packed_linears

    draft = trained_draft(target)
    with packed_linears(target), packed_linears(draft):
        assert "forward" in vars(target.lm_head)
        for prompt in PROMPTS:
            vanilla = vanilla_decode(target, prompt, max_new_tokens=40)
            spec = speculative_decode(target, draft, prompt, k=k, max_new_tokens=40)
            assert spec.output_ids == vanilla.output_ids


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_equals_vanilla_with_a_reduced_draft_vocabulary(target, k):
    """A draft head that scores a third of the tokens never proposes the others; the output is still the target's."""
    from eval.draft_vocab import restricted_head

    draft = trained_draft(target)
    ids = list(range(0, V, 3))
    sub = torch.tensor(ids)
    reached = set()
    with restricted_head(draft, ids):
        assert draft.get_output_embeddings().weight.shape[0] == len(ids)
        for prompt in PROMPTS:
            vanilla = vanilla_decode(target, prompt, max_new_tokens=40)
            spec = speculative_decode(target, draft, prompt, k=k, max_new_tokens=40, draft_vocab=sub)
            assert spec.output_ids == vanilla.output_ids
            assert spec.total_accepted > 0
            reached |= set(vanilla.output_ids) - set(ids)
    assert reached, "the target must write tokens the draft cannot propose for the test to mean anything"
    assert draft.get_output_embeddings().weight.shape[0] == V  # the full head is back


def test_restricted_head_scores_the_chosen_rows(target):
    from eval.draft_vocab import restricted_head

    ids = [1, 5, 9, 60]
    x = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        full = target(x).logits
        with restricted_head(target, ids):
            part = target(x).logits
            lm = CachedLM(target, V, torch.tensor(ids))
            row = lm.forward([3, 4, 5])[0]
    torch.testing.assert_close(part, full[..., ids])
    assert target.lm_head.weight is target.model.embed_tokens.weight  # tied weights stay tied
    assert torch.isinf(row).sum() == V - len(ids)
    torch.testing.assert_close(row[ids], full[0, -1, ids])
