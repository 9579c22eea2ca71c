"""The recipe's eval stage: measure the draft and every checkpoint (each once) with the built-in decoder.

Reports go to RUN/eval/<tag>/ (tag `init` for the draft as built, `checkpoint-STEP` for each
checkpoint). RUN/eval/summary.json lists every measured checkpoint and names the best one, chosen by
measured speedup (mean observed speedup over the recipe's temperatures; ties broken by mean alpha),
never by loss.
"""

from __future__ import annotations

import json
from pathlib import Path

from eval.metrics import Costs, alpha_needed
from eval.report import evaluate_pair, format_table, summary_text
from eval.fsutil import atomic_write_json, atomic_write_text
from eval.models import log
from eval.prompts import eval_prompt_set, spread


def eval_prompts(recipe):
    return spread(eval_prompt_set(recipe.eval.prompts), recipe.eval.num_prompts)


def run_eval_stage(recipe, target, draft, tokenizer, draft_name: str, run_dir: Path, tag: str = "init",
                   draft_vocab: list[int] | None = None) -> dict:
    """Evaluate `draft` into RUN/eval/<tag>/; a finished report (report.json present) is not redone.

    `draft_vocab`: the reduced draft vocabulary the draft was trained on (None: its full head)."""
    out = Path(run_dir) / "eval" / tag
    if (out / "report.json").is_file():
        log(f"eval of '{tag}' already done ({out}/report.json); skipped")
        return json.loads((out / "report.json").read_text())
    was_training = draft.training
    draft.eval()
    report = evaluate_pair(target, draft, tokenizer, eval_prompts(recipe), recipe.eval, target_name=recipe.target.model,
                           draft_name=draft_name, out_dir=out, draft_vocab=draft_vocab, seed=recipe.seed,
                           max_prompt_tokens=recipe.data.max_prompt_tokens)
    draft.train(was_training)
    print(summary_text(report))
    return report


def score(report: dict) -> tuple[float, float]:
    """(mean observed speedup, mean alpha) over the report's temperatures: the key the best checkpoint maximises."""
    rows = list(report["by_temperature"].values())
    speedups = [r["speedup_observed"] or 0.0 for r in rows]
    alphas = [r["alpha"] or 0.0 for r in rows]
    return sum(speedups) / len(speedups), sum(alphas) / len(alphas)


def _step(tag: str) -> int:
    return int(tag.split("-")[1]) if tag.startswith("checkpoint-") else 0


def summarize(run_dir: Path) -> dict | None:
    """Collect every report under RUN/eval/, pick the best checkpoint, write summary.json and summary.txt."""
    eval_dir = Path(run_dir) / "eval"
    entries = []
    for report_path in sorted(eval_dir.glob("*/report.json"), key=lambda p: _step(p.parent.name)):
        report = json.loads(report_path.read_text())
        speedup, alpha = score(report)
        entries.append({"tag": report_path.parent.name, "step": _step(report_path.parent.name),
                        "score_speedup": speedup, "score_alpha": alpha,
                        "by_temperature": {t: {k: r[k] for k in ("alpha", "tau", "speedup_observed", "speedup_theoretical", "optimal_k")}
                                           for t, r in report["by_temperature"].items()},
                        "c": report["costs"]["c"],
                        # What the measured costs ask of the draft: the alpha each speedup needs (best k).
                        "alpha_needed": {f"{x}x": alpha_needed(x, Costs.from_dict(report["costs"])) for x in (1.2, 1.5, 2.0)}})
    if not entries:
        return None
    candidates = [e for e in entries if e["tag"].startswith("checkpoint-")] or entries
    best = max(candidates, key=lambda e: (e["score_speedup"], e["score_alpha"]))
    summary = {"best": best["tag"], "rule": "max mean observed speedup over the eval temperatures; ties by mean alpha",
               "checkpoints": entries}
    atomic_write_json(eval_dir / "summary.json", summary)
    atomic_write_text(eval_dir / "summary.txt", summary_table(summary) + "\n")
    return summary


def summary_table(summary: dict) -> str:
    temps = list(summary["checkpoints"][0]["by_temperature"])
    headers = ["checkpoint", "step"] + [f"{name} T={t}" for t in temps for name in ("alpha", "tau", "speedup")] + ["best"]
    rows = []
    for e in summary["checkpoints"]:
        row = [e["tag"], e["step"]]
        for t in temps:
            r = e["by_temperature"].get(t, {})
            row += [r.get("alpha"), r.get("tau"), r.get("speedup_observed")]
        rows.append(row + ["*" if e["tag"] == summary["best"] else ""])
    return format_table(headers, rows)


def checkpoint_metrics(report: dict) -> dict:
    """Flat metrics of one checkpoint's report, for the tracker."""
    out = {}
    for t, r in report["by_temperature"].items():
        for key in ("alpha", "tau", "speedup_observed", "speedup_theoretical"):
            if r.get(key) is not None:
                out[f"eval/{key}@T={t}"] = r[key]
    out["eval/c"] = report["costs"]["c"]
    return out
