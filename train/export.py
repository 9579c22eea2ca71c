"""The export stage: the best checkpoint (by measured speedup, see train/evaluate.py) as a plain Hugging Face model.

RUN/export/ holds safetensors weights, config, tokenizer, a generation_config.json whose
`num_assistant_tokens` is the measured optimal k (schedule `constant`; with a dynamic draft length,
`eval.draft_confidence` > 0, the k it was measured with and `assistant_confidence_threshold` beside it),
and a README.md model card
with the pair, the recipe and the measured tables, the plots beside it. It loads with
`AutoModelForCausalLM.from_pretrained` and serves as `assistant_model=` in `generate()` with no
project code. The directory is built under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from eval.draft_vocab import FILENAME as DRAFT_VOCAB_FILE
from eval.report import describe_decoder, domain_rows, markdown_table, temperature_rows
from eval.settings import EvalSettings
from train.evaluate import summary_table
from eval.errors import UserError
from eval.fsutil import atomic_write_text
from eval.models import load_model, log
from train.models import cast_weights
from eval.models import DEFAULT_TARGET, DEFAULT_TARGET_HUB_ID
from train.recipe import dump_recipe


def best_report(run_dir: Path) -> tuple[str, dict, dict]:
    """(tag, report, summary) of the best measured checkpoint."""
    summary_path = Path(run_dir) / "eval" / "summary.json"
    if not summary_path.is_file():
        raise UserError(f"export: no measurements in {summary_path.parent}; run the eval stage first")
    summary = json.loads(summary_path.read_text())
    tag = summary["best"]
    return tag, json.loads((Path(run_dir) / "eval" / tag / "report.json").read_text()), summary


def serving_k(report: dict) -> int:
    """The optimal fixed k measured at greedy decoding (the assistant's default), else at the lowest temperature."""
    by_t = report["by_temperature"]
    key = "0.0" if "0.0" in by_t else min(by_t, key=float)
    return int(by_t[key]["optimal_k"] or report["settings"]["k"])


def assistant_settings(report: dict) -> tuple[int, float]:
    """(num_assistant_tokens, assistant_confidence_threshold) for transformers, as the draft was measured: the
    optimal fixed k and no threshold, or with a dynamic draft length the k it capped and its threshold. The
    threshold is written even when 0, or transformers would apply its own default (0.4)."""
    settings = EvalSettings.of_report(report)
    if settings.fixed_k is None:
        return settings.k, settings.draft_confidence
    return serving_k(report), 0.0


def model_card(recipe, tag: str, report: dict, summary: dict, plots: list[str]) -> str:
    pair = report["pair"]
    k, confidence = assistant_settings(report)
    fixed_k = serving_k(report)
    generate_note = (f"up to {k} draft tokens a round, stopping after one of draft probability < {confidence:g}"
                     if confidence else f"k = {k}")
    measured_with = f"k = {k}" if not confidence else (
        f"a dynamic draft length (at most {k} tokens a round, a round's drafting stops after a token the draft gives "
        f"a probability below {confidence:g})")
    costs = report["costs"]
    decoded = f", decoded {describe_decoder(report['decoder'])}" if report.get("decoder") else ""
    t_headers, t_rows = temperature_rows(report)
    d_headers, d_rows = domain_rows(report)
    requests = next(iter(report["by_temperature"].values()))["requests"]
    conventions = "\n".join(f"- `{name}`: {text}" for name, text in report["conventions"].items())
    vocab_note = "" if not report.get("draft_vocab_size") else (
        f"\n\nThe draft was trained and measured with a reduced vocabulary: its head scores only the "
        f"{report['draft_vocab_size']} token ids in `{DRAFT_VOCAB_FILE}` (the cheaper draft token above). The weights keep "
        "the full head, so transformers and vLLM load it as is and score every token: the output stays exact, the "
        "draft costs more per token, and acceptance may differ a little from these figures.")
    # The project's alias of the embedded default is no name a user's library knows: give its hub id.
    target_id = DEFAULT_TARGET_HUB_ID if recipe.target.model == DEFAULT_TARGET else recipe.target.model
    plot_lines = "\n".join(f"![{Path(p).stem}](plots/{Path(p).name})" for p in plots)
    return f"""---
library_name: transformers
tags: [speculative-decoding, draft-model, specdistill]
---

# Draft model for `{target_id}`

A draft for speculative decoding, distilled by specdistill from `{pair['target']}` (draft initialised as
`{pair['draft'].split('@')[0]}`), exported from `{tag}`: the checkpoint with the highest measured
speedup ({summary['rule']}).

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
target = AutoModelForCausalLM.from_pretrained("{target_id}")
draft = AutoModelForCausalLM.from_pretrained("path/to/this/directory")
tok = AutoTokenizer.from_pretrained("path/to/this/directory")
inputs = tok.apply_chat_template([{{"role": "user", "content": "Write a haiku about rivers."}}],
                                 add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = target.generate(**inputs, assistant_model=draft, max_new_tokens=64)  # {generate_note}, from generation_config.json
```

vLLM (a fixed k: the optimal k for the measured alpha and costs): `vllm serve {target_id} --speculative-config '{{"model": "path/to/this/directory", "num_speculative_tokens": {fixed_k}}}'`

## Measurements

Measured by specdistill's own speculative decoder on {requests} evaluation prompts, device `{report['device']}` ({report['dtype']}), {measured_with}{decoded}, against vanilla decoding
of the same target in the same run. Costs: draft {costs['t_draft_ms']:.1f} ms/token, target
{costs['t_target_ms']['1']:.1f} ms/token, c = {costs['c']:.3f}. Optimal fixed k from the measured alpha and costs: {fixed_k}.{vocab_note}

Conventions:

{conventions}

### By temperature

{markdown_table(t_headers, t_rows)}

### By temperature and domain

{markdown_table(d_headers, d_rows)}

### Every checkpoint

```
{summary_table(summary)}
```

{plot_lines}

## Recipe

```yaml
{dump_recipe(recipe).strip()}
```
"""


def run_export_stage(recipe, tokenizer, run_dir: Path, draft=None, dtype=None) -> Path:
    """Write RUN/export/ from the best measured checkpoint (or `draft` when the best is the initial draft)."""
    run_dir = Path(run_dir)
    tag, report, summary = best_report(run_dir)
    source = run_dir / tag
    if tag.startswith("checkpoint-"):
        if not source.is_dir():
            raise UserError(f"export: the best checkpoint {source} is gone (keep_checkpoints removed it?)")
        model = load_model(str(source), device="cpu")
    elif draft is not None:
        model = draft
    else:
        raise UserError(f"export: the best measured draft '{tag}' is not a checkpoint; run distill first")
    if dtype is not None:
        model = cast_weights(model, dtype)
    k, confidence = assistant_settings(report)
    final, tmp = run_dir / "export", run_dir / ".export.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    generation = model.generation_config
    generation.num_assistant_tokens = k
    generation.num_assistant_tokens_schedule = "constant"
    generation.assistant_confidence_threshold = confidence
    generation.save_pretrained(tmp)
    if (source / DRAFT_VOCAB_FILE).is_file():  # read by specdistill's decoder; transformers and vLLM use the full head
        shutil.copy2(source / DRAFT_VOCAB_FILE, tmp / DRAFT_VOCAB_FILE)
    plots = []
    for name in (report.get("plots") or {}).values():
        src = run_dir / "eval" / tag / name
        if src.is_file():
            (tmp / "plots").mkdir(exist_ok=True)
            shutil.copy2(src, tmp / "plots" / src.name)
            plots.append(src.name)
    atomic_write_text(tmp / "README.md", model_card(recipe, tag, report, summary, plots))
    (tmp / "specdistill_report.json").write_text(json.dumps(report, indent=2))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    log(f"export: {tag} written to {final} (num_assistant_tokens = {k}, assistant_confidence_threshold = {confidence:g})")
    if recipe.export.push_to_hub:
        from huggingface_hub import create_repo, upload_folder

        create_repo(recipe.export.hub_model_id, exist_ok=True)  # the token comes from HF_TOKEN / the login
        upload_folder(repo_id=recipe.export.hub_model_id, folder_path=str(final))
        log(f"export: pushed to https://huggingface.co/{recipe.export.hub_model_id}")
    return final
