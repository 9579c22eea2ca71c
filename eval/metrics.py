"""Speed model and aggregation of per-request decoding records into the report's metrics.

Conventions (also written into every report, see CONVENTIONS):
- alpha: mean of beta = sum_x min(p_target(x), p_draft(x)) = 1 - TV over verified draft positions
  (greedy: 1[argmax p_target == argmax p_draft]); pooled over requests.
- expected tokens per round, Leviathan et al. 2023 eq. 1: (1 - alpha^(k+1)) / (1 - alpha), the
  target's own token included (not the "accepted drafts only" shortcut alpha(1 - alpha^k)/(1 - alpha)).
- predicted speedup: expected tokens * t_target(1) / (k * t_draft + t_target(k+1)), the costs measured;
  with t_target(k+1) = t_target(1) this is Leviathan's (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)).
  It models rounds of a fixed k. With a confidence threshold (dynamic draft length) there is no such k:
  the prediction is then the best fixed k's (optimal_k), what the same alpha buys without the threshold.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from eval.speculative import BUCKET_NAMES, CachedLM, _sync, as_lm, ratio, shared_vocab_size

CONVENTIONS = {
    "alpha": "mean over verified draft positions of beta = sum_x min(p_target, p_draft) = 1 - TV (greedy: argmax match); pooled over requests",
    "alpha_empirical": "accepted / verified positions (verified = reached before the first rejection of a round)",
    "acceptance_rate": "total_accepted / total_drafted (serving engines' 'draft acceptance rate')",
    "tau": "tokens generated / rounds (mean tokens per target forward, bonus token included)",
    "slot_acceptance_conditional": "per draft slot: accepted / reached (given the earlier slots were accepted)",
    "slot_acceptance_unconditional": "per draft slot: accepted / rounds that drafted the slot",
    "alpha_by_position": "alpha by position of the drafted token in the generated sequence, buckets " + ", ".join(BUCKET_NAMES),
    "c": "t_draft (one draft token, KV cache) / t_target(1) (one target token, KV cache), measured",
    "speedup_theoretical": "(1 - alpha^(k+1)) / (1 - alpha) * t_target(1) / (k t_draft + t_target(k+1)), Leviathan et al. 2023 with measured costs; "
                           "k = the decoder's k, or optimal_k when draft_confidence > 0 (dynamic draft length has no fixed k)",
    "drafted_per_round": "total_drafted / rounds (k with a fixed draft length, less with draft_confidence > 0)",
    "speedup_observed": "wall time per generated token of vanilla target decoding / the same of speculative decoding, "
                        "same prompts, same code, one run (the plain wall-time ratio at greedy decoding, where both write "
                        "the same tokens; sampled outputs differ in length, so time is taken per token)",
    "optimal_k": "the k in 1..8 maximising speedup_theoretical at the measured alpha",
    "max_profitable_temperature": "highest temperature of the sweep, going up from the coldest, whose speedup_theoretical stays above 1",
    "fallback_rate": "share of requests the guardrail switched to vanilla decoding",
}


@dataclass
class Costs:
    """Measured forward times in seconds (median of repeats), with a KV cache of a real prompt."""

    t_draft: float
    t_target: dict[int, float]
    """Target time for verifying m tokens at once, m = 1..k_max+1."""

    @classmethod
    def from_dict(cls, data: dict) -> "Costs":
        return cls(t_draft=data["t_draft_ms"] / 1e3, t_target={int(m): t / 1e3 for m, t in data["t_target_ms"].items()})

    @property
    def c(self) -> float:
        return self.t_draft / self.t_target[1]

    def to_dict(self) -> dict:
        return {
            "t_draft_ms": 1e3 * self.t_draft,
            "t_target_ms": {str(m): 1e3 * t for m, t in sorted(self.t_target.items())},
            "c": self.c,
        }


def _time_once(lm: CachedLM, tokens: list[int]) -> float:
    base = lm.length
    _sync(lm.device)
    start = time.perf_counter()
    lm.forward(tokens, keep=len(tokens))
    _sync(lm.device)
    elapsed = time.perf_counter() - start
    lm.crop(base)
    return elapsed


@torch.no_grad()
def measure_costs(target, draft, prefix_ids: list[int], *, k_max: int = 8, repeats: int = 11,
                  draft_vocab: torch.Tensor | None = None) -> Costs:
    """Time one draft token and target passes over 1..k_max+1 tokens after a cached `prefix_ids`.

    `draft_vocab`: the ids a restricted draft head scores (`speculative_decode`'s argument of that name).
    `target`, `draft`: models (timed eagerly), or the `CachedLM`s the decoder runs (e.g. compiled `StaticLM`s).

    The passes are timed round-robin (draft, target m = 1, 2, ...), `repeats` rounds after one warm-up
    round, and each cost is the median: a slow moment of the machine hits every m alike instead of
    one of them.
    """
    # A given `CachedLM` keeps its own vocabulary; a bare model beside it (auto may compile one and not the
    # other) is wrapped over the same one.
    given = [lm.vocab_size for lm in (target, draft) if isinstance(lm, CachedLM)]
    vocab = given[0] if given else shared_vocab_size(target, draft, draft_vocab)
    probe = (prefix_ids * (1 + (k_max + 1) // max(len(prefix_ids), 1)))[: k_max + 1]
    target_lm, draft_lm = as_lm(target, vocab), as_lm(draft, vocab, draft_vocab)
    target_lm.forward(prefix_ids, keep=1)
    draft_lm.forward(prefix_ids, keep=1)
    sizes = range(1, k_max + 2)
    draft_times, target_times = [], {m: [] for m in sizes}
    for round_ in range(repeats + 1):
        draft_time = _time_once(draft_lm, probe[:1])
        times = {m: _time_once(target_lm, probe[:m]) for m in sizes}
        if round_ > 0:  # the first round warms up
            draft_times.append(draft_time)
            for m in sizes:
                target_times[m].append(times[m])
    return Costs(t_draft=statistics.median(draft_times), t_target={m: statistics.median(t) for m, t in target_times.items()})


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per round (accepted drafts + the target's token), Leviathan et al. eq. 1."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, k: int, costs: Costs) -> float:
    t_verify = costs.t_target.get(k + 1, costs.t_target[max(costs.t_target)])
    return expected_tokens(alpha, k) * costs.t_target[1] / (k * costs.t_draft + t_verify)


def optimal_k(alpha: float, costs: Costs, ks=range(1, 9)) -> int:
    return max(ks, key=lambda k: predicted_speedup(alpha, k, costs))


def alpha_needed(speedup: float, costs: Costs, ks=range(1, 9)) -> float | None:
    """The smallest alpha whose predicted speedup, at its best k, reaches `speedup` with these costs
    (None: not reachable even at alpha = 1). Predicted speedup rises with alpha, so bisection works."""
    best = None
    for k in ks:
        if k + 1 not in costs.t_target or predicted_speedup(1.0, k, costs) < speedup:
            continue
        lo, hi = 0.0, 1.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if predicted_speedup(mid, k, costs) < speedup else (lo, mid)
        best = hi if best is None else min(best, hi)
    return best


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    pos = (len(values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def per_token_speedup(vanilla_time: float, vanilla_tokens: int, spec_time: float, spec_tokens: int) -> float | None:
    """Vanilla wall time per token / speculative wall time per token.

    At T > 0 the two decoders draw different samples, and one may stop at EOS long before the other:
    a plain ratio of wall times would count the length difference as speed. At greedy decoding both
    write the same tokens and this is the wall-time ratio.
    """
    if not (vanilla_time and vanilla_tokens and spec_time and spec_tokens):
        return None
    return (vanilla_time / vanilla_tokens) / (spec_time / spec_tokens)


def theory_k(alpha: float, costs: Costs, k: int | None) -> int:
    """The k `speedup_theoretical` is evaluated at: the decoder's fixed `k`, or (None: dynamic draft length) optimal_k."""
    return optimal_k(alpha, costs) if k is None else k


def aggregate(records: list[dict], costs: Costs, k: int | None) -> dict:
    """Pool per-request records (one temperature, or one domain at one temperature) into metrics.

    `k`: the decoder's draft length, or None when it was dynamic (a confidence threshold)."""
    total = lambda key: sum(r[key] for r in records)  # noqa: E731
    alpha = ratio(total("beta_sum"), total("verified"))
    slots = len(records[0]["slot_reached"]) if records else 0
    slot_sum = lambda key, i: sum(r[key][i] for r in records)  # noqa: E731
    buckets = len(BUCKET_NAMES)
    bucket_alpha = {
        BUCKET_NAMES[b]: ratio(sum(r["bucket_beta_sum"][b] for r in records), sum(r["bucket_count"][b] for r in records))
        for b in range(buckets)
    }
    per_request_alpha = [r["alpha"] for r in records if r["alpha"] is not None]
    theory = predicted_speedup(alpha, theory_k(alpha, costs, k), costs) if alpha is not None else None
    observed = per_token_speedup(total("wall_time_vanilla"), sum(r["vanilla_tokens"] for r in records),
                                 total("wall_time_spec"), total("tokens_generated"))
    return {
        "requests": len(records),
        "tokens_generated": total("tokens_generated"),
        "rounds": total("rounds"),
        "total_drafted": total("total_drafted"),
        "total_accepted": total("total_accepted"),
        "alpha": alpha,
        "alpha_empirical": ratio(total("total_accepted"), total("verified")),
        "acceptance_rate": ratio(total("total_accepted"), total("total_drafted")),
        "tau": ratio(total("tokens_generated"), total("rounds")),
        "drafted_per_round": ratio(total("total_drafted"), total("rounds")),
        "alpha_p50": percentile(per_request_alpha, 50),
        "alpha_p99": percentile(per_request_alpha, 99),
        "slot_acceptance_conditional": [ratio(slot_sum("slot_accepted", i), slot_sum("slot_reached", i)) for i in range(slots)],
        "slot_acceptance_unconditional": [ratio(slot_sum("slot_accepted", i), slot_sum("slot_rounds", i)) for i in range(slots)],
        "alpha_by_position": bucket_alpha,
        "speedup_observed": observed,
        "speedup_theoretical": theory,
        "observed_over_theoretical": ratio(observed, theory) if observed and theory else None,
        "optimal_k": optimal_k(alpha, costs) if alpha is not None else None,
        "speedup_theoretical_at_optimal_k": predicted_speedup(alpha, optimal_k(alpha, costs), costs) if alpha is not None else None,
        "fallback_rate": ratio(sum(bool(r["fallback_triggered"]) for r in records), len(records)),
        "tokens_per_s_spec": ratio(total("tokens_generated"), total("wall_time_spec")),
        "tokens_per_s_vanilla": ratio(sum(r["vanilla_tokens"] for r in records), total("wall_time_vanilla")),
    }


def max_profitable_temperature(by_temperature: dict[float, dict]) -> float | None:
    """The highest temperature, going up from the coldest, whose predicted speedup stays above 1."""
    best = None
    for temperature in sorted(by_temperature):
        speedup = by_temperature[temperature]["speedup_theoretical"]
        if speedup is None or speedup <= 1.0:
            break
        best = temperature
    return best
