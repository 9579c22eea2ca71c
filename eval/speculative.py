"""Speculative decoding of one request, and vanilla decoding with the same code, both with KV caches.

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding": the draft
proposes k tokens from q, the target scores all of them in one forward pass over k+1 positions,
and drafted token x_i is kept with probability min(1, p_target(x_i) / p_draft(x_i)). At the first
rejection a token is drawn from the residual norm(max(0, p_target - p_draft)); when all k are kept
the target's distribution at the last position gives a bonus token. The output then follows
p_target exactly. Greedy decoding is its own branch: keep drafted tokens while they equal the
target's argmax.

Both models keep a transformers `DynamicCache` holding every token but the last one; a round feeds
the target [last, d_1..d_k] and then crops the rejected positions from both caches, so the
accepted prefix is never recomputed.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from dataclasses import dataclass, field

import torch

# Buckets of the position in the generated sequence (design handbook, "Metrics").
POSITION_BUCKETS = ((0, 10), (10, 50), (50, 100), (100, 200), (200, 500), (500, None))
BUCKET_NAMES = tuple(f"{lo}-{hi - 1}" if hi else f"{lo}+" for lo, hi in POSITION_BUCKETS)


def ratio(num: float, den: float) -> float | None:
    """num / den, or None when nothing was counted (no 0/0 in reports)."""
    return num / den if den else None


def position_bucket(position: int) -> int:
    for index, (lo, hi) in enumerate(POSITION_BUCKETS):
        if hi is None or position < hi:
            return index
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked; the same filters apply to target and draft."""

    temperature: float = 0.0
    """0 means greedy (argmax), its own branch."""
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """softmax(filter(logits / T)) in float32; `logits` (..., V) -> (..., V)."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def cache_kwarg(model) -> str:
    """The forward keyword for the KV cache: `cache` in transformers >= 5.2x, `past_key_values` before."""
    params = inspect.signature(model.forward).parameters
    return "past_key_values" if "past_key_values" in params and "cache" not in params else "cache"


class CachedLM:
    """A causal LM and its KV cache; `forward` appends tokens, `crop` rolls back to a length.

    `token_ids`: the model's head scores only these ids (a reduced draft vocabulary, `eval.draft_vocab`);
    its logits are placed at their ids in a row of -inf, so every other token has probability 0.
    """

    def __init__(self, model, vocab_size: int, token_ids: torch.Tensor | None = None):
        from transformers import DynamicCache

        self.model = model
        self.vocab_size = vocab_size
        self.token_ids = token_ids
        self.cache = DynamicCache(config=model.config)
        self.device = next(model.parameters()).device
        self.cache_kwarg = cache_kwarg(model)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def forward(self, token_ids: list[int], keep: int = 1) -> torch.Tensor:
        """Feed `token_ids` after the cached ones; logits of the last `keep` positions, (keep, V)."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=keep, **{self.cache_kwarg: self.cache})
        # A model spread over several GPUs (device_map) returns logits on its last one: bring them home.
        logits = out.logits[0, -keep:].to(self.device)
        if self.token_ids is None:
            return logits[:, : self.vocab_size]
        full = logits.new_full((keep, self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.token_ids, logits)

    def crop(self, length: int) -> None:
        extra = self.length - length
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5: a negative count removes that many positions


@dataclass
class DecodeResult:
    """One request decoded; counts follow the design handbook's metric conventions."""

    output_ids: list[int]
    wall_time: float
    rounds: int = 0
    """Target forward passes after the prefill (a round verifies k drafts; a vanilla step is a round of 0)."""
    total_drafted: int = 0
    total_accepted: int = 0
    verified: int = 0
    """Drafted positions reached before the first rejection of their round (the rejected one included)."""
    beta_sum: float = 0.0
    """Sum over verified positions of beta = sum_x min(p_target, p_draft) (greedy: argmax match)."""
    slot_reached: list[int] = field(default_factory=list)
    slot_accepted: list[int] = field(default_factory=list)
    slot_rounds: list[int] = field(default_factory=list)
    """Per draft slot i: rounds that drafted slot i."""
    bucket_beta_sum: list[float] = field(default_factory=lambda: [0.0] * len(POSITION_BUCKETS))
    bucket_count: list[int] = field(default_factory=lambda: [0] * len(POSITION_BUCKETS))
    fallback_triggered: bool = False
    fallback_at: int | None = None
    """Tokens generated when the guardrail switched the request to vanilla decoding."""
    finish_reason: str = "length"

    @property
    def tokens_generated(self) -> int:
        return len(self.output_ids)

    @property
    def alpha(self) -> float | None:
        return ratio(self.beta_sum, self.verified)

    @property
    def alpha_empirical(self) -> float | None:
        return ratio(self.total_accepted, self.verified)

    @property
    def acceptance_rate(self) -> float | None:
        return ratio(self.total_accepted, self.total_drafted)

    @property
    def tau(self) -> float | None:
        return ratio(self.tokens_generated, self.rounds)


def sample(probs: torch.Tensor, generator=None) -> torch.Tensor:
    """One index per row drawn from `probs` (..., V) -> (...), by inverting the cumulative distribution.

    The same distribution as `torch.multinomial(probs, 1)`, which on a CPU is slow for one row of a large
    vocabulary (and runs several times a round of speculative decoding); a float64 cumulative sum and a
    binary search take a fraction of its time. A token of probability 0 is never drawn: the cumulative sum does
    not rise at it, and the search returns the first index whose sum exceeds u.
    """
    cdf = probs.double().cumsum(-1)  # (..., V)
    u = torch.rand(cdf.shape[:-1] + (1,), generator=generator, dtype=torch.float64, device=cdf.device) * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(cdf.shape[-1] - 1)


def _pick(probs_or_logits: torch.Tensor, sampling: Sampling, generator) -> torch.Tensor:
    if sampling.greedy:
        return probs_or_logits.argmax(-1)
    return sample(probs_or_logits, generator)


def _finish(tokens: list[int], new: list[int], eos: set[int]) -> bool:
    """Append `new` to `tokens`, stopping after the first EOS; True when an EOS was appended."""
    for token in new:
        tokens.append(token)
        if token in eos:
            return True
    return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prefill(lm: CachedLM, prompt_ids: list[int]) -> None:
    if len(prompt_ids) > 1:
        lm.forward(prompt_ids[:-1], keep=1)


def _target_step(target: CachedLM, tokens: list[int], sampling: Sampling, generator) -> int:
    """One vanilla step: feed the last token, pick the next from p_target."""
    logits = target.forward(tokens[-1:], keep=1)[0]  # (V,)
    scores = logits if sampling.greedy else probs_from_logits(logits, sampling)
    return int(_pick(scores, sampling, generator))


def _draft_probability(q_logits: torch.Tensor, q_row: torch.Tensor, token: int, sampling: Sampling) -> float:
    """q(token): the draft's probability of its own pick (the softmax of the logits at greedy decoding)."""
    if sampling.greedy:
        return float(q_logits.float().softmax(-1)[token])
    return float(q_row[token])


def residual_distribution(p_target: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p_target - p_draft)): where the token comes from after a rejection, (V,) -> (V,)."""
    residual = (p_target - p_draft).clamp_min(0)
    total = residual.sum()
    # p == q on this row has zero rejection probability; guard the 0/0 all the same.
    return residual / total if total > 0 else p_target


def output_vocab_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def shared_vocab_size(target, draft, draft_vocab: torch.Tensor | None = None) -> int:
    """The vocabulary both models' logits are compared over: the rows both heads have (the rest is padding),
    or the target's when the draft's head is restricted to `draft_vocab` (its rows are not the vocabulary)."""
    if draft_vocab is not None:
        return output_vocab_size(target)
    return min(output_vocab_size(target), output_vocab_size(draft))


@torch.no_grad()
def vanilla_decode(
    target,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_token_ids=(),
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
) -> DecodeResult:
    """Plain autoregressive decoding with the same cache handling as `speculative_decode`."""
    lm = CachedLM(target, vocab_size or output_vocab_size(target))
    eos = set(eos_token_ids)
    _sync(lm.device)
    start = time.perf_counter()
    _prefill(lm, prompt_ids)
    tokens = list(prompt_ids)
    stopped = False
    rounds = 0
    while not stopped and len(tokens) - len(prompt_ids) < max_new_tokens:
        stopped = _finish(tokens, [_target_step(lm, tokens, sampling, generator)], eos)
        rounds += 1
    _sync(lm.device)
    result = DecodeResult(tokens[len(prompt_ids):], time.perf_counter() - start, rounds=rounds)
    result.finish_reason = "eos" if stopped else "length"
    return result


@torch.no_grad()
def speculative_decode(
    target,
    draft,
    prompt_ids: list[int],
    *,
    k: int,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_token_ids=(),
    generator: torch.Generator | None = None,
    fallback_window: int = 0,
    fallback_threshold: float = 0.0,
    vocab_size: int | None = None,
    draft_vocab: torch.Tensor | None = None,
    confidence: float = 0.0,
) -> DecodeResult:
    """Decode one request with `draft` proposing `k` tokens a round and `target` verifying them.

    `vocab_size`: the shared vocabulary (logits beyond it, padding rows of one model, are ignored).
    `draft_vocab`: the token ids the draft's head scores, in its order, when it runs under
    `eval.draft_vocab.restricted_head` (None: the full vocabulary).
    `fallback_window`/`fallback_threshold`: when the mean of the last `fallback_window` acceptance
    outcomes falls below the threshold, the request finishes with vanilla decoding.
    `confidence`: dynamic draft length. A round stops drafting after a token the draft gives a probability
    below this (its own q, after temperature and filters), so `k` becomes a cap: long drafts where the
    draft is sure, short ones where it is not (transformers' `assistant_confidence_threshold`). The length
    depends only on the draft's own picks, so each kept token still passes the same acceptance test and
    the output distribution is unchanged. 0 (the default): always `k` tokens a round.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    vocab = vocab_size or shared_vocab_size(target, draft, draft_vocab)
    p_lm, q_lm = CachedLM(target, vocab), CachedLM(draft, vocab, draft_vocab)
    eos = set(eos_token_ids)
    result = DecodeResult([], 0.0, slot_reached=[0] * k, slot_accepted=[0] * k, slot_rounds=[0] * k)
    outcomes: deque[int] = deque(maxlen=max(fallback_window, 1))
    guard = fallback_window > 0 and fallback_threshold > 0
    n_prompt = len(prompt_ids)

    _sync(p_lm.device)
    start = time.perf_counter()
    _prefill(p_lm, prompt_ids)
    tokens = list(prompt_ids)
    stopped = False
    while not stopped and (generated := len(tokens) - n_prompt) < max_new_tokens:
        k_round = min(k, max_new_tokens - generated - 1)
        if k_round == 0 or result.fallback_triggered:
            stopped = _finish(tokens, [_target_step(p_lm, tokens, sampling, generator)], eos)
            result.rounds += 1
            continue

        # Draft k tokens: the draft catches up on tokens it has not seen, then feeds its own picks.
        drafted: list[int] = []
        q_rows = []
        pending = tokens[q_lm.length :]
        for _ in range(k_round):
            q_logits = q_lm.forward(pending, keep=1)[0]  # (V,)
            q_row = q_logits if sampling.greedy else probs_from_logits(q_logits, sampling)
            token = int(_pick(q_row, sampling, generator))
            drafted.append(token)
            q_rows.append(q_row)
            pending = [token]
            if confidence > 0 and _draft_probability(q_logits, q_row, token, sampling) < confidence:
                break  # an unsure draft: verify what we have rather than draft past it
        k_round = len(drafted)

        # Verify all k in one target pass over [last, d_1..d_k]: row i scores d_{i+1}, row k is the bonus.
        p_logits = p_lm.forward([tokens[-1]] + drafted, keep=k_round + 1)  # (k+1, V)
        d = torch.tensor(drafted, device=p_logits.device)
        q_all = torch.stack(q_rows)  # (k, V)
        if sampling.greedy:
            p_pick = p_logits.argmax(-1)  # (k+1,)
            accept = p_pick[:k_round] == d
            beta = (q_all.argmax(-1) == p_pick[:k_round]).float()
        else:
            p_all = probs_from_logits(p_logits, sampling)  # (k+1, V)
            idx = torch.arange(k_round, device=d.device)
            u = torch.rand(k_round, generator=generator, device=d.device)
            accept = u * q_all[idx, d] < p_all[idx, d]  # u < p/q without dividing by q
            beta = torch.minimum(p_all[:k_round], q_all).sum(-1)
        n_accept = int(accept.long().cumprod(0).sum())

        if sampling.greedy:
            extra = int(p_pick[n_accept])
        elif n_accept < k_round:
            residual = residual_distribution(p_all[n_accept], q_all[n_accept])
            extra = int(sample(residual, generator))
        else:
            extra = int(_pick(p_all[k_round], sampling, generator))

        reached = min(n_accept + 1, k_round)
        beta_list = beta[:reached].tolist()
        result.rounds += 1
        result.total_drafted += k_round
        result.total_accepted += n_accept
        result.verified += reached
        result.beta_sum += sum(beta_list)
        for slot in range(k_round):
            result.slot_rounds[slot] += 1
        for slot in range(reached):
            result.slot_reached[slot] += 1
            result.slot_accepted[slot] += int(slot < n_accept)
            bucket = position_bucket(generated + slot)
            result.bucket_beta_sum[bucket] += beta_list[slot]
            result.bucket_count[bucket] += 1
            outcomes.append(int(slot < n_accept))

        # Roll back: keep the accepted prefix in both caches (each holds all tokens but the last).
        p_lm.crop(len(tokens) + n_accept)
        q_lm.crop(min(q_lm.length, len(tokens) + n_accept))
        stopped = _finish(tokens, drafted[:n_accept] + [extra], eos)

        if guard and not stopped and len(outcomes) == outcomes.maxlen and sum(outcomes) < fallback_threshold * len(outcomes):
            result.fallback_triggered = True
            result.fallback_at = len(tokens) - n_prompt

    _sync(p_lm.device)
    result.wall_time = time.perf_counter() - start
    result.output_ids = tokens[n_prompt:]
    result.finish_reason = "eos" if stopped else "length"
    return result
