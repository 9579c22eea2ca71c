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

    This one runs eagerly with a transformers `DynamicCache`; `eval.compiled.StaticLM` keeps a static cache
    and compiled steps behind the same three methods. `length` is counted here, in Python, so reading it
    never waits for the device.

    `token_ids`: the model's head scores only these ids (a reduced draft vocabulary, `eval.draft_vocab`);
    its logits are placed at their ids in a row of -inf, so every other token has probability 0.
    """

    def __init__(self, model, vocab_size: int, token_ids: torch.Tensor | None = None):
        self.model = model
        self.vocab_size = vocab_size
        self.token_ids = token_ids
        self.device = next(model.parameters()).device
        self.cache_kwarg = cache_kwarg(model)
        self.cache = self.new_cache()
        self.length = 0

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def reset(self) -> None:
        """Forget every token (a new request)."""
        self.cache = self.new_cache()
        self.length = 0

    def forward(self, token_ids: list[int], keep: int = 1) -> torch.Tensor:
        """Feed `token_ids` after the cached ones; logits of the last `keep` positions, (keep, V)."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        logits = self.run(ids, keep)
        self.length += len(token_ids)
        return logits

    def run(self, ids: torch.Tensor, keep: int) -> torch.Tensor:
        """One forward pass over `ids` (1, n) with the cache: the last `keep` rows of logits, (keep, V)."""
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=keep, **{self.cache_kwarg: self.cache})
        return self.place(out.logits[0, -keep:])

    def place(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's logits (n, V_model) as rows over the shared vocabulary (n, V)."""
        # A model spread over several GPUs (device_map) returns logits on its last one: bring them home.
        logits = logits.to(self.device)
        if self.token_ids is None:
            return logits[:, : self.vocab_size]
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.token_ids, logits)

    def crop(self, length: int) -> None:
        extra = self.length - length
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5: a negative count removes that many positions
            self.length = length


def as_lm(model_or_lm, vocab_size: int, token_ids: torch.Tensor | None = None) -> CachedLM:
    """A model wrapped in a fresh eager `CachedLM`, or a given `CachedLM` (e.g. a compiled one) reset for a new request."""
    if isinstance(model_or_lm, CachedLM):
        model_or_lm.reset()
        return model_or_lm
    return CachedLM(model_or_lm, vocab_size, token_ids)


class Ratio:
    """A read-only attribute: one count of the object over another, None when nothing was counted."""

    def __init__(self, num: str, den: str):
        self.num, self.den = num, den

    def __get__(self, obj, owner=None):
        return self if obj is None else ratio(getattr(obj, self.num), getattr(obj, self.den))


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

    alpha = Ratio("beta_sum", "verified")
    """Mean beta over verified positions (the design handbook's alpha)."""
    alpha_empirical = Ratio("total_accepted", "verified")
    acceptance_rate = Ratio("total_accepted", "total_drafted")
    tau = Ratio("tokens_generated", "rounds")
    """Tokens per target forward pass, the target's own token included."""

    def record_round(self, generated: int, drafted: int, accepted: int, beta: torch.Tensor) -> list[int]:
        """Count one verified round whose first drafted token lands at position `generated`; returns the
        acceptance outcome (1/0) of each verified slot, in order, for the guardrail."""
        reached = min(accepted + 1, drafted)
        beta_list = beta[:reached].tolist()
        self.rounds += 1
        self.total_drafted += drafted
        self.total_accepted += accepted
        self.verified += reached
        self.beta_sum += sum(beta_list)
        outcomes = []
        for slot in range(drafted):
            self.slot_rounds[slot] += 1
        for slot in range(reached):
            self.slot_reached[slot] += 1
            self.slot_accepted[slot] += int(slot < accepted)
            bucket = position_bucket(generated + slot)
            self.bucket_beta_sum[bucket] += beta_list[slot]
            self.bucket_count[bucket] += 1
            outcomes.append(int(slot < accepted))
        return outcomes


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
    """Cache every prompt token but the last (each cache holds all tokens but the last)."""
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
    or the target's when the draft's head is restricted to `draft_vocab` (its rows are not the vocabulary).
    Either may be a `CachedLM` (one model compiled, the other eager): its model's head counts."""
    target, draft = (m.model if isinstance(m, CachedLM) else m for m in (target, draft))
    if draft_vocab is not None:
        return output_vocab_size(target)
    return min(output_vocab_size(target), output_vocab_size(draft))


def draft_tokens(draft: CachedLM, tokens: list[int], k: int, sampling: Sampling, generator,
                 confidence: float) -> tuple[list[int], torch.Tensor]:
    """Up to `k` draft tokens after `tokens` and the draft's rows they were picked from, (n, V): greedy logits,
    else probabilities. The draft first catches up on the tokens it has not seen. With `confidence` > 0 the
    round stops after a token the draft gives q below it (transformers' assistant_confidence_threshold)."""
    drafted, q_rows = [], []
    pending = tokens[draft.length:]
    for _ in range(k):
        q_logits = draft.forward(pending, keep=1)[0]  # (V,)
        q_row = q_logits if sampling.greedy else probs_from_logits(q_logits, sampling)
        token = int(_pick(q_row, sampling, generator))
        drafted.append(token)
        q_rows.append(q_row)
        pending = [token]
        if confidence > 0 and _draft_probability(q_logits, q_row, token, sampling) < confidence:
            break  # an unsure draft: verify what we have rather than draft past it
    return drafted, torch.stack(q_rows)


def verify_greedy(p_logits: torch.Tensor, q_rows: torch.Tensor, drafted: torch.Tensor, generator=None):
    """Keep drafted tokens while they equal the target's argmax; the target's argmax after them is the extra token.

    `p_logits` (n+1, V) target rows for [last, d_1..d_n]; `q_rows` (n, V) the draft's logits; `drafted` (n,).
    Returns (accepted count, extra token, beta (n,)), beta = 1[argmax q == argmax p] per slot."""
    n = len(drafted)
    p_pick = p_logits.argmax(-1)  # (n+1,)
    accepted = int((p_pick[:n] == drafted).long().cumprod(0).sum())
    beta = (q_rows.argmax(-1) == p_pick[:n]).float()
    return accepted, int(p_pick[accepted]), beta


def verify_sampled(p_rows: torch.Tensor, q_rows: torch.Tensor, drafted: torch.Tensor, generator=None):
    """Leviathan et al. 2023, Algorithm 1: keep d_i with probability min(1, p(d_i) / q(d_i)) until the first
    rejection, draw the extra token from norm(max(0, p - q)) there, or from p after the last slot.

    `p_rows` (n+1, V) and `q_rows` (n, V) are probabilities. Returns (accepted count, extra token, beta (n,)),
    beta = sum_x min(p, q) per slot."""
    n = len(drafted)
    idx = torch.arange(n, device=drafted.device)
    u = torch.rand(n, generator=generator, device=drafted.device)
    keep = u * q_rows[idx, drafted] < p_rows[idx, drafted]  # u < p/q without dividing by q
    accepted = int(keep.long().cumprod(0).sum())
    if accepted < n:
        extra = sample(residual_distribution(p_rows[accepted], q_rows[accepted]), generator)
    else:
        extra = sample(p_rows[n], generator)
    return accepted, int(extra), torch.minimum(p_rows[:n], q_rows).sum(-1)


class Guardrail:
    """Rolling acceptance over the last `window` verified slots; `tripped` when it falls below `threshold`."""

    def __init__(self, window: int, threshold: float):
        self.enabled = window > 0 and threshold > 0
        self.outcomes: deque[int] = deque(maxlen=max(window, 1))
        self.threshold = threshold

    def tripped(self, outcomes: list[int]) -> bool:
        self.outcomes.extend(outcomes)
        full = len(self.outcomes) == self.outcomes.maxlen
        return self.enabled and full and sum(self.outcomes) < self.threshold * len(self.outcomes)


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
    """Plain autoregressive decoding with the same cache handling as `speculative_decode`.

    `target`: a model, or a `CachedLM` (e.g. `eval.compiled.StaticLM`) to decode with."""
    target = as_lm(target, vocab_size or (None if isinstance(target, CachedLM) else output_vocab_size(target)))
    eos, result, tokens, stopped = set(eos_token_ids), DecodeResult([], 0.0), list(prompt_ids), False
    start = _start(target, prompt_ids)
    while not stopped and len(tokens) - len(prompt_ids) < max_new_tokens:
        stopped = _finish(tokens, [_target_step(target, tokens, sampling, generator)], eos)
        result.rounds += 1
    return _done(result, target, tokens[len(prompt_ids):], start, stopped)


def _start(target: CachedLM, prompt_ids: list[int]) -> float:
    """The request's clock starts, and the prompt is cached (the prefill is timed with the request)."""
    _sync(target.device)
    start = time.perf_counter()
    _prefill(target, prompt_ids)
    return start


def _done(result: DecodeResult, target: CachedLM, output_ids: list[int], start: float, stopped: bool) -> DecodeResult:
    _sync(target.device)
    result.wall_time = time.perf_counter() - start
    result.output_ids = output_ids
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

    `target`, `draft`: models, or `CachedLM`s built for them (e.g. `eval.compiled.StaticLM`, which then carry
    the vocabulary and draft_vocab they were built with).
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
    if target is draft and isinstance(target, CachedLM):
        raise ValueError("target and draft need a cache each: build two CachedLMs (of the same model if need be)")
    if vocab_size is None and not isinstance(target, CachedLM):
        vocab_size = shared_vocab_size(target, draft, draft_vocab)
    target, draft = as_lm(target, vocab_size), as_lm(draft, vocab_size, draft_vocab)
    verify = verify_greedy if sampling.greedy else verify_sampled
    eos = set(eos_token_ids)
    result = DecodeResult([], 0.0, slot_reached=[0] * k, slot_accepted=[0] * k, slot_rounds=[0] * k)
    guard = Guardrail(fallback_window, fallback_threshold)
    n_prompt, tokens, stopped = len(prompt_ids), list(prompt_ids), False

    start = _start(target, prompt_ids)
    while not stopped and (generated := len(tokens) - n_prompt) < max_new_tokens:
        k_round = min(k, max_new_tokens - generated - 1)
        if k_round == 0 or result.fallback_triggered:
            stopped = _finish(tokens, [_target_step(target, tokens, sampling, generator)], eos)
            result.rounds += 1
            continue

        drafted, q_rows = draft_tokens(draft, tokens, k_round, sampling, generator, confidence)  # n, (n, V)
        # One target pass over [last, d_1..d_n]: row i scores d_{i+1}, row n gives the extra token.
        p_logits = target.forward([tokens[-1]] + drafted, keep=len(drafted) + 1)  # (n+1, V)
        p_rows = p_logits if sampling.greedy else probs_from_logits(p_logits, sampling)
        accepted, extra, beta = verify(p_rows, q_rows, torch.tensor(drafted, device=p_rows.device), generator)
        outcomes = result.record_round(generated, len(drafted), accepted, beta)

        # Roll back: keep the accepted prefix in both caches (each holds all tokens but the last).
        target.crop(len(tokens) + accepted)
        draft.crop(min(draft.length, len(tokens) + accepted))
        stopped = _finish(tokens, drafted[:accepted] + [extra], eos)
        if guard.tripped(outcomes) and not stopped:
            result.fallback_triggered, result.fallback_at = True, len(tokens) - n_prompt

    return _done(result, target, tokens[n_prompt:], start, stopped)
