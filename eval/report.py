"""Measure a (target, draft) pair on a prompt set: vanilla vs speculative decoding, report.json, requests.jsonl, plots.

`evaluate_pair` runs, for each temperature and prompt, vanilla decoding of the target and
speculative decoding with the draft back to back (same prompts, same code, one run), then
aggregates per temperature and per domain (see eval/metrics.py for the conventions).

A vanilla decode depends on the target, the prompt, the settings and the request's seed, never on the
draft: with `eval.reuse_vanilla`, a process that measures several checkpoints against one target (the
pipeline's checkpoint evals) decodes each request vanilla once and reuses it, tokens and wall time
(`VanillaCache`).
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eval.compiled import prepare_decoders
from eval.packed import weights_version
from eval.draft_vocab import restricted_head
from eval.metrics import (CONVENTIONS, aggregate, max_profitable_temperature, measure_costs, per_token_speedup, predicted_speedup,
                          theory_k)
from eval.settings import EvalSettings
from eval.speculative import Sampling, speculative_decode, vanilla_decode
from eval.fsutil import atomic_write_json, atomic_write_text
from eval.prompts import Prompt, encode_prompt


def eos_ids(tokenizer, model) -> list[int]:
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(source)
    return sorted(ids)


def _request_record(prompt: Prompt, temperature: float, settings: EvalSettings, pair: str, spec, vanilla, costs) -> dict:
    alpha = spec.alpha
    return {
        "request_id": prompt.id,
        "model_pair": pair,
        "domain": prompt.domain,
        "temperature": temperature,
        "k": settings.k,
        "tokens_generated": spec.tokens_generated,
        "rounds": spec.rounds,
        "total_drafted": spec.total_drafted,
        "total_accepted": spec.total_accepted,
        "verified": spec.verified,
        "beta_sum": spec.beta_sum,
        "acceptance_rate": spec.acceptance_rate,
        "alpha": alpha,
        "alpha_empirical": spec.alpha_empirical,
        "tau": spec.tau,
        "speedup_observed": per_token_speedup(vanilla.wall_time, vanilla.tokens_generated, spec.wall_time, spec.tokens_generated),
        "speedup_theoretical": predicted_speedup(alpha, theory_k(alpha, costs, settings.fixed_k), costs) if alpha is not None else None,
        "fallback_triggered": spec.fallback_triggered,
        "fallback_at": spec.fallback_at,
        "finish_reason": spec.finish_reason,
        "wall_time_spec": spec.wall_time,
        "wall_time_vanilla": vanilla.wall_time,
        "vanilla_tokens": vanilla.tokens_generated,
        "slot_reached": spec.slot_reached,
        "slot_accepted": spec.slot_accepted,
        "slot_rounds": spec.slot_rounds,
        "bucket_beta_sum": spec.bucket_beta_sum,
        "bucket_count": spec.bucket_count,
        "output_ids": spec.output_ids,
        "vanilla_output_ids": vanilla.output_ids,
    }


class VanillaCache:
    """The vanilla decodes of one target, kept for the rest of the process.

    A request's key is everything its vanilla decode depends on: the target's steps (compiled kernels have their
    own numerics, lean steps their own timing), the target's weights (their version counters: a target changed in place is decoded
    afresh), the prompt, the sampling settings, the token budget, the stop tokens and the seed."""

    _per_target: "weakref.WeakKeyDictionary[object, VanillaCache]" = weakref.WeakKeyDictionary()

    def __init__(self):
        self.results = {}

    @classmethod
    def of(cls, target) -> "VanillaCache":
        return cls._per_target.setdefault(target, cls())

    def decode(self, target, lm, ids: list[int], *, steps: str, seed: int, device, **common):
        """(vanilla result, whether it was reused) for one request; `lm`: what decodes (the target, its `LeanLM` or its
        `StaticLM`), whose steps are `steps` (`eval.compiled.steps_of`)."""
        key = (steps, weights_version(target), tuple(ids), seed, common["sampling"], common["max_new_tokens"],
               tuple(common["eos_token_ids"]), common["vocab_size"])
        if key in self.results:
            return self.results[key], True
        result = vanilla_decode(lm, ids, generator=torch.Generator(device).manual_seed(seed), **common)
        self.results[key] = result
        return result, False


@torch.no_grad()
def evaluate_pair(
    target,
    draft,
    tokenizer,
    prompts: list[Prompt],
    settings: EvalSettings,
    *,
    target_name: str,
    draft_name: str,
    out_dir: str | Path | None = None,
    progress: bool = True,
    plots: bool = True,
    draft_vocab: list[int] | None = None,
    seed: int = 0,
    max_prompt_tokens: int = 512,
) -> dict:
    """Decode every prompt at every temperature with and without the draft; return (and write) the report.

    `draft_vocab`: token ids the draft's head is restricted to (`eval.draft_vocab`); None: its full head.
    `seed`: every request's sampling seed derives from it; `max_prompt_tokens`: longer prompts keep their end.
    `settings.reuse_vanilla`: take a request's vanilla decode from an earlier measurement of the same target in
    this process where there is one (`VanillaCache`); off: decode it again, back to back with the speculative one.
    """
    if not prompts:
        raise ValueError("no prompts to evaluate")
    pair = f"{target_name} <- {draft_name}"
    eos = eos_ids(tokenizer, target)
    vocab = len(tokenizer)
    encoded = [encode_prompt(tokenizer, p, max_prompt_tokens) for p in prompts]

    device = next(target.parameters()).device
    sub_ids = None if draft_vocab is None else torch.as_tensor(draft_vocab, dtype=torch.long, device=device)
    with restricted_head(draft, draft_vocab):
        decoders = prepare_decoders(target, draft, settings.compile, vocab_size=vocab, draft_vocab=sub_ids, probe_ids=encoded[0],
                                    max_length=max(map(len, encoded)) + settings.max_new_tokens, k=settings.k,
                                    eager_steps=settings.eager_steps)
        with decoders.running(target, draft):
            cache = VanillaCache.of(target) if settings.reuse_vanilla else VanillaCache()
            records, costs = _decode_all(decoders, cache, target, prompts, encoded, settings, pair, eos, vocab, sub_ids,
                                         device, progress, seed)

    report = build_report(records, costs, settings, target_name=target_name, draft_name=draft_name,
                          device=str(device), dtype=str(next(target.parameters()).dtype))
    report["settings"] |= {"seed": seed, "max_prompt_tokens": max_prompt_tokens}
    report["draft_vocab_size"] = None if draft_vocab is None else len(draft_vocab)
    report["draft_vocab_coverage"] = None if draft_vocab is None else vocab_coverage(records, draft_vocab)
    report["decoder"] = decoders.to_dict()
    report["vanilla_reused"] = sum(r["vanilla_reused"] for r in records)
    if out_dir is not None:
        write_report(report, records, out_dir, plots=plots)
    return report


def vocab_coverage(records: list[dict], draft_vocab: list[int]) -> dict[str, float]:
    """Per temperature, the share of the target's own tokens (its vanilla outputs) inside the draft's reduced head.
    The draft can never propose the others, so a position whose target token lies outside is always rejected
    at T = 0: what the reduced head costs in alpha, where the training data's token counts miss the prompts'."""
    inside = set(draft_vocab)
    coverage = {}
    for temperature in sorted({r["temperature"] for r in records}):
        tokens = [t for r in records if r["temperature"] == temperature for t in r["vanilla_output_ids"]]
        coverage[str(float(temperature))] = sum(t in inside for t in tokens) / len(tokens) if tokens else None
    return coverage


def _decode_all(decoders, vanilla_cache: VanillaCache, model, prompts, encoded, settings: EvalSettings, pair: str, eos,
                vocab: int, sub_ids, device, progress: bool, seed: int):
    """Every prompt at every temperature, vanilla (or its earlier decode from `vanilla_cache`) then speculative;
    (records, measured costs). `model`: the target model itself, whichever decoder runs it."""
    target, draft = decoders.target, decoders.draft
    # Warm both models up (first calls allocate), then measure the costs on a real prompt.
    speculative_decode(target, draft, encoded[0], k=settings.k, max_new_tokens=4, vocab_size=vocab, draft_vocab=sub_ids)
    costs = measure_costs(target, draft, encoded[0], k_max=max(8, settings.k), draft_vocab=sub_ids)
    records = []
    bar = tqdm(total=len(prompts) * len(settings.temperatures), desc="eval requests", unit="req", disable=not progress)
    for t_index, temperature in enumerate(settings.temperatures):
        sampling = Sampling(temperature, settings.top_k, settings.top_p)
        for p_index, (prompt, ids) in enumerate(zip(prompts, encoded)):
            request_seed = seed * 1_000_003 + t_index * 10_007 + p_index
            common = dict(max_new_tokens=settings.max_new_tokens, sampling=sampling, eos_token_ids=eos, vocab_size=vocab)
            vanilla, reused = vanilla_cache.decode(model, target, ids, steps=decoders.target_steps, seed=request_seed,
                                                   device=device, **common)
            spec = speculative_decode(
                target, draft, ids, k=settings.k, generator=torch.Generator(device).manual_seed(request_seed),
                fallback_window=settings.fallback_window, fallback_threshold=settings.fallback_threshold,
                draft_vocab=sub_ids, confidence=settings.draft_confidence, **common,
            )
            records.append(_request_record(prompt, temperature, settings, pair, spec, vanilla, costs) | {"vanilla_reused": reused})
            bar.update(1)
            bar.set_postfix(T=temperature, alpha=f"{spec.alpha or 0:.2f}", tau=f"{spec.tau or 0:.2f}")
    bar.close()
    return records, costs


def build_report(records: list[dict], costs, settings: EvalSettings, *, target_name, draft_name, device, dtype) -> dict:
    by_temperature, by_domain = {}, {}
    for temperature in settings.temperatures:
        group = [r for r in records if r["temperature"] == temperature]
        by_temperature[temperature] = aggregate(group, costs, settings.fixed_k)
        domains = sorted({r["domain"] for r in group})
        by_domain[temperature] = {d: aggregate([r for r in group if r["domain"] == d], costs, settings.fixed_k) for d in domains}
    greedy = [r for r in records if r["temperature"] == 0]
    return {
        "pair": {"target": target_name, "draft": draft_name},
        "settings": settings.to_dict(),
        "device": device,
        "dtype": dtype,
        "conventions": CONVENTIONS,
        "costs": costs.to_dict(),
        "overall": aggregate(records, costs, settings.fixed_k),
        "by_temperature": {str(t): v for t, v in by_temperature.items()},
        "by_domain": {str(t): v for t, v in by_domain.items()},
        "max_profitable_temperature": max_profitable_temperature(by_temperature),
        "greedy_identical_to_vanilla": (sum(r["output_ids"] == r["vanilla_output_ids"] for r in greedy) / len(greedy)) if greedy else None,
    }


def write_report(report: dict, records: list[dict], out_dir: str | Path, plots: bool = True) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "requests.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    if plots:
        from eval.plots import write_plots

        report["plots"] = write_plots(report, records, out_dir)
    atomic_write_json(out_dir / "report.json", report)  # last: its presence marks a finished eval


def _fmt(value, digits=3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(headers: list[str], rows: list[list]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda row: "  ".join(c.rjust(w) for c, w in zip(row, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows])


def temperature_rows(report: dict) -> tuple[list[str], list[list]]:
    headers = ["T", "alpha", "alpha_emp", "acc_rate", "drafted", "tau", "speedup_obs", "speedup_theo", "opt_k", "fallback",
               "P50 a", "P99 a"]
    rows = [
        [float(t), a["alpha"], a["alpha_empirical"], a["acceptance_rate"], a.get("drafted_per_round"), a["tau"], a["speedup_observed"],
         a["speedup_theoretical"], a["optimal_k"], a["fallback_rate"], a["alpha_p50"], a["alpha_p99"]]
        for t, a in report["by_temperature"].items()
    ]
    return headers, rows


def domain_rows(report: dict) -> tuple[list[str], list[list]]:
    headers = ["T", "domain", "requests", "alpha", "tau", "speedup_obs", "speedup_theo"]
    rows = [
        [float(t), d, a["requests"], a["alpha"], a["tau"], a["speedup_observed"], a["speedup_theoretical"]]
        for t, domains in report["by_domain"].items()
        for d, a in domains.items()
    ]
    return headers, rows


def describe_decoder(decoder: dict) -> str:
    """A report's `decoder` in words: its mode and how the eager models ran ("eager, lean steps")."""
    steps = {decoder[f"{m}_steps"] for m in ("target", "draft")} - {"compiled"} if "target_steps" in decoder else set()
    return decoder["mode"] + "".join(f", {s} steps" for s in sorted(steps))


def summary_text(report: dict) -> str:
    costs = report["costs"]
    settings = EvalSettings.of_report(report)
    k = settings.k
    rounds = f"k={k}" if settings.fixed_k else f"k<={k}, a round stops after a draft token of q < {settings.draft_confidence:g}"
    head = (
        f"pair: {report['pair']['target']} <- {report['pair']['draft']}   {rounds}   device={report['device']} ({report['dtype']})"
        + (f"   draft vocabulary: {report['draft_vocab_size']} tokens" if report.get("draft_vocab_size") else "")
        + (" (share of the target's tokens inside: " + ", ".join(f"{100 * c:.1f}% at T={t}" for t, c in
                                                              report["draft_vocab_coverage"].items() if c is not None) + ")"
           if report.get("draft_vocab_coverage") else "") + "\n"
        f"costs: draft {costs['t_draft_ms']:.1f} ms/token, target {costs['t_target_ms']['1']:.1f} ms (1 token), "
        f"{costs['t_target_ms'][str(k + 1)]:.1f} ms ({k + 1} tokens), c = {costs['c']:.3f}\n"
    )
    decoder = report.get("decoder")
    if decoder:
        head += f"decoder: {describe_decoder(decoder)} (eval.compile={decoder['requested']}"
        head += f", compiling took {decoder['compile_seconds']:.0f} s" if decoder["compile_seconds"] else ""
        head += f"; {decoder['note']})\n" if decoder["note"] else ")\n"
    headers, rows = temperature_rows(report)
    domain_headers, domains = domain_rows(report)
    tail = f"max profitable temperature: {_fmt(report['max_profitable_temperature'])}"
    if report["greedy_identical_to_vanilla"] is not None:
        tail += f"   greedy output identical to vanilla: {100 * report['greedy_identical_to_vanilla']:.0f}% of requests"
    if report.get("vanilla_reused"):
        tail += (f"\nvanilla decodes (tokens and wall time) of {report['vanilla_reused']} of {report['overall']['requests']} requests "
                 "reused from an earlier measurement of this target in this process")
    return (
        head + "\n" + format_table(headers, rows) + "\n\n"
        + format_table(domain_headers, domains)
        + "\n\n" + tail
    )
