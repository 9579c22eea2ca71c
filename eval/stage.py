"""The recipe's eval stage: measure the draft (each checkpoint once) with the built-in decoder."""

from __future__ import annotations

import json
from pathlib import Path

from eval.report import EvalSettings, evaluate_pair, summary_text
from train.models import log
from train.prompts import builtin_prompts, read_jsonl_prompts, spread


def eval_prompts(recipe):
    section = recipe.eval
    prompts = read_jsonl_prompts(section.prompts) if section.prompts else builtin_prompts("held_out")
    return spread(prompts, section.num_prompts)


def run_eval_stage(recipe, target, draft, tokenizer, draft_name: str, run_dir: Path, tag: str = "init") -> dict:
    """Evaluate `draft` into RUN/eval/<tag>/; a finished report (report.json present) is not redone."""
    out = Path(run_dir) / "eval" / tag
    if (out / "report.json").is_file():
        log(f"eval of '{tag}' already done ({out}/report.json); skipped")
        return json.loads((out / "report.json").read_text())
    settings = EvalSettings.from_recipe(recipe.eval, seed=recipe.seed, max_prompt_tokens=recipe.data.max_prompt_tokens)
    report = evaluate_pair(target, draft, tokenizer, eval_prompts(recipe), settings,
                           target_name=recipe.target.model, draft_name=draft_name, out_dir=out)
    print(summary_text(report))
    return report
