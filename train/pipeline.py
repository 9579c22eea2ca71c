"""The recipe's stages in order: generate -> distill -> eval -> export; each skips work already finished.

One Accelerator serves every stage (created before any model is loaded, so ZeRO-3 partitions them as
they load); rerunning the same command after a crash continues where the run stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import yaml

from eval.draft_vocab import load_draft_vocab
from eval.errors import UserError
from eval.fsutil import atomic_write_json, atomic_write_text
from eval.models import check_model_vocab, describe_processor, load_model, load_tokenizer, log, num_parameters
from train.models import build_draft, cast_weights, served_copy, serving_dtype
from train.recipe import Recipe, dump_recipe, parse_recipe

IDENTITY_KEYS = ("target", "draft", "data", "generate", "distill", "seed")


def prepare_run_dir(recipe: Recipe, overwrite: bool = False):
    """Create the run directory and write the resolved recipe; refuse a directory holding another recipe's run."""
    run_dir = recipe.run_dir
    stored = run_dir / "recipe.yaml"
    if stored.is_file() and not overwrite:
        previous = yaml.safe_load(stored.read_text()) or {}
        try:  # resolved again: a key added to the recipe since that run holds its default, as it did then
            previous = parse_recipe(previous).to_dict()
        except UserError:
            pass  # a key since removed or renamed: compared as written, so it differs
        current = recipe.to_dict()
        changed = [key for key in IDENTITY_KEYS if previous.get(key) != current.get(key)]
        if changed:
            raise UserError(
                f"output directory '{run_dir}' holds a run of a different recipe (section '{changed[0]}' differs); "
                "use another output_dir or pass --overwrite"
            )
    atomic_write_text(stored, dump_recipe(recipe))
    return run_dir


def _wandb_offline_unless_logged_in() -> None:
    """W&B never blocks on the network: without an API key (env or ~/.netrc) it runs offline."""
    netrc = Path.home() / ".netrc"
    logged_in = bool(os.environ.get("WANDB_API_KEY")) or (netrc.is_file() and "api.wandb.ai" in netrc.read_text())
    if not logged_in and not os.environ.get("WANDB_MODE"):
        os.environ["WANDB_MODE"] = "offline"
        log("W&B: no API key found; logging offline into the run directory (wandb sync to upload)")


def run(recipe: Recipe, overwrite: bool = False, dry_run: bool = False) -> None:
    from train.dist import make_accelerator, zero_stage

    started = time.perf_counter()
    if recipe.tracking.report_to == "wandb":
        _wandb_offline_unless_logged_in()
    accelerator = make_accelerator(recipe)
    device = accelerator.device
    log(f"recipe '{recipe.name}': stages {' -> '.join(recipe.stages)}; run directory {recipe.run_dir}; device {device}"
        + (f"; {accelerator.num_processes} processes" if accelerator.num_processes > 1 else ""))
    tokenizer = load_tokenizer(recipe.target.model, trust_remote_code=recipe.target.trust_remote_code,
                               revision=recipe.target.revision)
    target = load_model(recipe.target.model, dtype=recipe.target.dtype, device=device,
                        trust_remote_code=recipe.target.trust_remote_code, revision=recipe.target.revision)
    check_model_vocab(target, tokenizer, recipe.target.model)
    if zero_stage(accelerator) == 3 and recipe.draft.init == "layers":
        raise UserError("recipe key 'draft.init': 'layers' copies the target's weights, which ZeRO-3 partitions; "
                        "use init: pretrained or config under ZeRO-3")
    draft, draft_name = build_draft(recipe, target, tokenizer, device=device)
    n_target, n_draft = num_parameters(target), num_parameters(draft)
    log(f"target {recipe.target.model}: {n_target / 1e6:.1f}M parameters; draft {draft_name}: {n_draft / 1e6:.1f}M parameters")
    if dry_run:
        log("dry run: recipe and model pair are valid; nothing was run")
        return
    if accelerator.is_main_process:
        prepare_run_dir(recipe, overwrite)
    accelerator.wait_for_everyone()
    run_dir = recipe.run_dir
    # A ZeRO-3 target is split over the processes: no single rank can generate or decode with it.
    partitioned = zero_stage(accelerator) == 3 and accelerator.num_processes > 1
    if recipe.tracking.report_to == "wandb":
        start_tracking(recipe, accelerator, run_dir)
    try:
        for stage in recipe.stages:
            with timed_stage(stage, run_dir, accelerator):
                _run_stage(stage, recipe, accelerator, target, draft, tokenizer, draft_name, run_dir, partitioned)
        seconds = time.perf_counter() - started
        log(f"run: {' -> '.join(recipe.stages)} done in {seconds / 60:.1f} min wall time (models loaded included)")
        if accelerator.is_main_process:
            record_time(run_dir, "run: " + " -> ".join(recipe.stages), seconds, accelerator.num_processes)
    finally:
        accelerator.end_training()


def _run_stage(stage, recipe, accelerator, target, draft, tokenizer, draft_name, run_dir, partitioned) -> None:
    """One stage of the recipe; each skips the work a previous run finished."""
    if stage == "generate":
        from train.generate import run_generate_stage

        if partitioned:
            raise UserError("stage 'generate' cannot run under multi-process ZeRO-3 (each process generates "
                            "its own shards); run `python -m train RECIPE --stages generate` first, on one "
                            "process or with the DDP config, then launch distill under ZeRO-3")

        run_generate_stage(recipe, target, tokenizer, run_dir, accelerator)
    elif stage == "distill":
        from train.distill import run_distill_stage

        if partitioned and "eval" in recipe.stages:
            log("distill: under ZeRO-3 the target is partitioned, so checkpoints are measured afterwards by "
                "`python -m train RECIPE --stages eval` on one process")
        hook = None if partitioned else _checkpoint_eval_hook(recipe, accelerator, target, tokenizer, draft_name, run_dir)
        run_distill_stage(recipe, accelerator, target, draft, tokenizer, run_dir, on_checkpoint=hook)
    elif stage == "eval":
        if partitioned:
            log("eval: skipped under multi-process ZeRO-3 (the target is partitioned); measure the checkpoints "
                "with `python -m train RECIPE --stages eval` on one process")
            return
        if accelerator.is_main_process:
            _eval_stage(recipe, target, draft, tokenizer, draft_name, run_dir)
        accelerator.wait_for_everyone()
    elif stage == "export":
        if accelerator.is_main_process:
            from train.export import run_export_stage

            final = run_export_stage(recipe, tokenizer, run_dir, draft=draft, dtype=serving_dtype(recipe, target))
            if recipe.export.wandb_artifact:
                log_model_artifact(recipe, accelerator, final)
        accelerator.wait_for_everyone()


@contextlib.contextmanager
def timed_stage(stage: str, run_dir: Path, accelerator):
    """Log a finished stage's wall time and append it to RUN/timings.json with the processor (a stage that fails
    records nothing; a resumed run appends, so the stages of one run are those after its last `generate`)."""
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    log(f"{stage}: done in {seconds / 60:.1f} min wall time")
    if accelerator.is_main_process:
        record_time(run_dir, stage, seconds, accelerator.num_processes)


def record_time(run_dir: Path, what: str, seconds: float, processes: int = 1) -> None:
    path = Path(run_dir) / "timings.json"
    timings = json.loads(path.read_text()) if path.exists() else {"entries": []}
    timings["entries"].append({"what": what, "seconds": round(seconds, 1), "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "processor": describe_processor(), "processes": processes})
    atomic_write_json(path, timings)


def _checkpoint_eval_hook(recipe, accelerator, target, tokenizer, draft_name, run_dir):
    """Measure each checkpoint as it is written (main process; the others wait) and log it to the tracker."""
    from train.evaluate import checkpoint_metrics, run_eval_stage, summarize

    if "eval" not in recipe.stages:
        return None

    def hook(step, path, draft):
        if accelerator.is_main_process:
            with timed_stage(f"eval {path.name} (within distill)", run_dir, accelerator):
                # Measured as it will be served: a copy in the serving dtype (training holds float32 weights).
                served = served_copy(draft, serving_dtype(recipe, target))
                report = run_eval_stage(recipe, target, served, tokenizer, f"{draft_name}@{path.name}", run_dir, tag=path.name,
                                        draft_vocab=load_draft_vocab(path))
                accelerator.log(checkpoint_metrics(report), step=step)
                tracker = _wandb_tracker(accelerator)
                if tracker is not None:
                    plot = report.get("plots", {}).get("acceptance_by_draft_position")
                    if plot:
                        image = str(Path(run_dir) / "eval" / path.name / plot)
                        tracker.log_images({"eval/acceptance_by_draft_position": [image]}, step=step)
                summary = summarize(run_dir)
                log(f"eval: best so far {summary['best']}")
        accelerator.wait_for_everyone()

    return hook


def start_tracking(recipe, accelerator, run_dir: Path) -> None:
    """One W&B run per run directory: its id is kept in RUN/wandb_run_id, so a resumed job appends to it."""
    id_file = Path(run_dir) / "wandb_run_id"
    if accelerator.is_main_process and not id_file.is_file():
        import uuid

        atomic_write_text(id_file, uuid.uuid4().hex[:16])
    accelerator.wait_for_everyone()
    accelerator.init_trackers(recipe.tracking.project, config=recipe.to_dict(), init_kwargs={"wandb": {
        "name": recipe.tracking.run_name or recipe.name, "dir": str(run_dir), "id": id_file.read_text().strip(),
        "resume": "allow"}})


def log_model_artifact(recipe, accelerator, export_dir: Path) -> None:
    """The exported draft as a W&B model artifact (wandb's own Artifact API)."""
    tracker = _wandb_tracker(accelerator)
    if tracker is None:
        log("export: export.wandb_artifact is set but W&B tracking is off (tracking.report_to: none); no artifact")
        return
    import wandb

    artifact = wandb.Artifact(name=f"{recipe.name}-draft", type="model",
                              metadata=json.loads((export_dir / "specdistill_report.json").read_text())["by_temperature"])
    artifact.add_dir(str(export_dir))
    tracker.run.log_artifact(artifact)
    log(f"export: logged W&B model artifact '{recipe.name}-draft'")


def _wandb_tracker(accelerator):
    """The live W&B tracker, or None when tracking is off."""
    return next((t for t in accelerator.trackers if t.name == "wandb"), None)


def _eval_stage(recipe, target, draft, tokenizer, draft_name, run_dir):
    """Measure every checkpoint not yet measured (or the draft as built when there is none); print the summary."""
    from train.evaluate import run_eval_stage, summarize, summary_table
    from train.checkpoints import list_checkpoints

    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:  # the draft as built, over the run's draft vocabulary once one was chosen
        run_eval_stage(recipe, target, draft, tokenizer, draft_name, run_dir, tag="init", draft_vocab=load_draft_vocab(run_dir))
    for _, path in checkpoints:
        if (Path(run_dir) / "eval" / path.name / "report.json").is_file():
            continue
        trained = cast_weights(load_model(str(path), device=target.device), serving_dtype(recipe, target))
        run_eval_stage(recipe, target, trained, tokenizer, f"{draft_name}@{path.name}", run_dir, tag=path.name,
                       draft_vocab=load_draft_vocab(path))
    summary = summarize(run_dir)
    if summary:
        print(summary_table(summary))
        log(f"eval: best checkpoint {summary['best']} (by measured speedup); table in {Path(run_dir) / 'eval' / 'summary.txt'}")
