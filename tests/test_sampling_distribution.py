"""Sampled speculative output follows the target's distribution (chi-square over thousands of samples)."""

from __future__ import annotations

import pytest
import torch

import eval.speculative as spec_mod
from conftest import make_model
from eval.speculative import Sampling, probs_from_logits, speculative_decode

V = 8
PROMPT = [3, 1, 4]
N = 3000


def exact_two_token_distribution(target, sampling):
    """p_target(x1, x2 | prompt) for every pair, from the target's own (filtered) distributions."""
    with torch.no_grad():
        p1 = probs_from_logits(target(torch.tensor([PROMPT])).logits[0, -1], sampling)
        seqs = torch.tensor([PROMPT + [x] for x in range(V)])
        p2 = probs_from_logits(target(seqs).logits[:, -1], sampling)  # (V, V)
    return p1[:, None] * p2  # (V, V)


def chi_square_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square test; cells with expected count < 5 are pooled into one."""
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


def sample_counts(target, draft, sampling, k):
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(V * V, dtype=torch.float64)
    for _ in range(N):
        out = speculative_decode(target, draft, PROMPT, k=k, max_new_tokens=2, sampling=sampling, generator=g)
        counts[out.output_ids[0] * V + out.output_ids[1]] += 1
    return counts


@pytest.fixture(scope="module")
def pair():
    target = make_model(V, layers=1, hidden=32, seed=0, scale=6.0)
    draft = make_model(V, layers=1, hidden=32, seed=5, scale=6.0)
    return target, draft


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.8, top_k=5, top_p=0.9)], ids=["T1", "T0.8-topk-topp"])
def test_sampled_output_follows_target(pair, sampling):
    target, draft = pair
    with torch.no_grad():
        p = probs_from_logits(target(torch.tensor([PROMPT])).logits[0, -1], sampling)
        q = probs_from_logits(draft(torch.tensor([PROMPT])).logits[0, -1], sampling)
    assert 0.5 * (p - q).abs().sum() > 0.2, "the draft must differ from the target for the test to mean anything"
    expected = exact_two_token_distribution(target, sampling).flatten() * N
    counts = sample_counts(target, draft, sampling, k=1)
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_broken_residual_is_detected(pair, monkeypatch):
    """Drawing a rejected position from p_target instead of the residual biases the output: caught."""
    target, draft = pair
    sampling = Sampling(1.0)
    monkeypatch.setattr(spec_mod, "residual_distribution", lambda p_target, p_draft: p_target)
    expected = exact_two_token_distribution(target, sampling).flatten() * N
    counts = sample_counts(target, draft, sampling, k=1)
    assert chi_square_pvalue(counts, expected) < 1e-3


def test_sample_draws_from_the_distribution_and_never_a_zero_probability_token():
    from eval.speculative import sample

    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(probs, g) for _ in range(4000)])
    counts = torch.bincount(draws, minlength=6).float()
    assert counts[[0, 2, 5]].sum() == 0
    torch.testing.assert_close(counts / 4000, probs, atol=0.03, rtol=0)
    rows = sample(torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]), g)  # one index per row
    assert rows.tolist() == [1, 2]


def test_sampled_output_follows_target_with_a_reduced_draft_vocabulary(pair):
    """The draft proposes from half the tokens only (q = 0 on the rest): the output still follows p_target."""
    from eval.draft_vocab import restricted_head

    target, draft = pair
    sampling = Sampling(1.0)
    ids = [0, 2, 3, 6]
    g = torch.Generator().manual_seed(99)
    counts = torch.zeros(V * V, dtype=torch.float64)
    with restricted_head(draft, ids):
        for _ in range(N):
            out = speculative_decode(target, draft, PROMPT, k=2, max_new_tokens=2, sampling=sampling, generator=g,
                                     draft_vocab=torch.tensor(ids))
            counts[out.output_ids[0] * V + out.output_ids[1]] += 1
    expected = exact_two_token_distribution(target, sampling)
    assert expected[[i for i in range(V) if i not in ids]].sum() > 0.2, "the target must often pick tokens outside"
    assert chi_square_pvalue(counts, expected.flatten() * N) > 1e-3


def test_sampled_output_follows_target_with_a_dynamic_draft_length(pair):
    """Drafting stops after a draft token of q < 0.17 (two tokens at most; about a third of the draft's first
    picks are below it): whether the second token comes from
    an accepted draft or from the target's bonus, the first two tokens still follow p_target."""
    target, draft = pair
    sampling = Sampling(1.0)
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(V * V, dtype=torch.float64)
    first_round = [0, 0]  # rounds drafting slot 0, slot 1
    for _ in range(N):
        out = speculative_decode(target, draft, PROMPT, k=2, max_new_tokens=3, sampling=sampling, generator=g,
                                 confidence=0.17)
        counts[out.output_ids[0] * V + out.output_ids[1]] += 1
        first_round[0] += out.slot_rounds[0] > 0
        first_round[1] += out.slot_rounds[1] > 0
    assert 0.1 * N < first_round[1] < 0.9 * N, "the threshold must cut some first rounds short and not others"
    expected = exact_two_token_distribution(target, sampling).flatten() * N
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_compiled_sampled_output_follows_target(pair):
    """The same test through the compiled decoder (static caches, compiled steps; eval/compiled.py)."""
    from eval.compiled import StaticLM, compile_supported

    if compile_supported(torch.device("cpu")) is not None:
        pytest.skip("torch.compile cannot run here")
    target, draft = pair
    sampling = Sampling(1.0)
    lms = [StaticLM(model, V, max_length=16, max_verify=3) for model in pair]
    expected = exact_two_token_distribution(target, sampling).flatten() * N
    counts = sample_counts(*lms, sampling, k=2)
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_lean_sampled_output_follows_target(pair):
    """The same test through lean steps (eval/lean.py: plain-tensor caches, rolled back by length)."""
    from eval.lean import LeanLM

    target, draft = pair
    sampling = Sampling(1.0)
    expected = exact_two_token_distribution(target, sampling).flatten() * N
    counts = sample_counts(LeanLM(target, V), LeanLM(draft, V), sampling, k=2)
    assert chi_square_pvalue(counts, expected) > 1e-3


def batched_pair_counts(target, sampling, seed=0, steps="lean"):
    """(first, second) token counts of N rows of PROMPT written in one `generate_batch` call (EOS is token 2:
    a row that writes it first stops there and is counted at (2, 0))."""
    from types import SimpleNamespace

    from train.completions import Row, generate_batch

    rows = [Row(None, PROMPT, sampling.temperature, s) for s in range(N)]
    settings = SimpleNamespace(max_new_tokens=2, top_p=sampling.top_p, top_k=sampling.top_k, topk_logprobs=0)
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=2)
    counts = torch.zeros(V * V, dtype=torch.float64)
    for ids, finish, _ in generate_batch(target, tokenizer, rows, settings, seed=seed, steps=steps):
        counts[ids[0] * V + (ids[1] if len(ids) > 1 else 0)] += 1
    return counts


def expected_with_eos_first(target, sampling):
    pairs = exact_two_token_distribution(target, sampling)
    eos_first = pairs[2].sum()  # the row ends at EOS: all its mass in one cell
    pairs[2] = 0.0
    pairs[2, 0] = eos_first
    return pairs.flatten() * N


@pytest.mark.parametrize("steps", ["lean", "transformers"])
@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.8, top_k=5, top_p=0.9)], ids=["T1", "T0.8-topk-topp"])
def test_generate_stage_samples_follow_the_target(pair, sampling, steps):
    """The generate stage's own batched loop (train/completions.py), with either `generate.steps`, draws rows
    from the target's filtered distribution; rows that wrote EOS leave the batch and the others go on."""
    target, _ = pair
    expected = expected_with_eos_first(target, sampling)
    assert 0.05 * N < expected[2 * V] < 0.95 * N, "some rows must stop at EOS after one token for the test to mean it"
    assert chi_square_pvalue(batched_pair_counts(target, sampling, steps=steps), expected) > 1e-3


def test_generate_stage_sampler_that_ignores_the_filters_is_detected(pair, monkeypatch):
    import train.completions as completions

    target, _ = pair
    sampling = Sampling(0.8, top_k=5, top_p=0.9)
    monkeypatch.setattr(completions, "probs_from_logits", lambda logits, s: logits.float().softmax(-1))
    expected = expected_with_eos_first(target, sampling)
    assert chi_square_pvalue(batched_pair_counts(target, sampling), expected) < 1e-3


def sorted_top_p_reference(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by definition over the whole sorted vocabulary: a token is dropped when the mass ranked above it
    already reaches top_p (the most likely token always stays). (..., V) -> bool (..., V), True = kept."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    p = sorted_logits.softmax(-1)
    keep_sorted = (p.cumsum(-1) - p) < top_p
    return keep_sorted.scatter(-1, order, keep_sorted)


@pytest.mark.parametrize("scale", [8.0, 1.0, 0.05], ids=["peaked", "moderate", "flat"])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999])
def test_top_p_filter_keeps_exactly_the_sorted_definitions_tokens(scale, top_p):
    """The filter looks among the top k tokens first (k grown until they hold top_p in every row); on a flat
    distribution that means most of the vocabulary, and the kept set is the full sort's either way."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 5000, generator=g) * scale  # distinct values: no ties to order
    logits[3] = logits[3].clamp(max=-2.0) + torch.arange(5000) * 1e-6  # one row far flatter than the others
    kept = probs_from_logits(logits, Sampling(1.0, top_p=top_p)) > 0
    assert torch.equal(kept, sorted_top_p_reference(logits, top_p))
    kept_k = probs_from_logits(logits, Sampling(1.0, top_k=40, top_p=top_p)) > 0  # top-k first, then top-p
    masked = logits.masked_fill(logits < torch.topk(logits, 40).values[:, -1:], float("-inf"))
    assert torch.equal(kept_k, sorted_top_p_reference(masked, top_p))
