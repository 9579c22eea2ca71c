"""Checkpoints of the distill stage: find the newest whole one, validate it, write one atomically, prune old ones.

A checkpoint directory appears only by renaming a complete temporary one; trainer_state.json (written last)
records every file's size, so a damaged checkpoint is recognised and skipped on resume.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from train.draft_vocab import DRAFT_VOCAB_FILE
from eval.fsutil import atomic_write_json, atomic_write_text
from eval.models import log
from train.recipe import dump_recipe

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (the directory name appears only after the rename), oldest first."""
    found = []
    for path in Path(run_dir).glob("checkpoint-*"):
        m = CHECKPOINT_RE.match(path.name)
        if m and path.is_dir():
            found.append((int(m.group(1)), path))
    return sorted(found)


def checkpoint_problem(path: Path) -> str | None:
    """Why a checkpoint cannot be resumed from, or None when it looks whole."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as err:
        return f"{STATE_FILE} unreadable ({err.__class__.__name__})"
    for name in state.get("files", {}):
        f = path / name
        if not f.exists():
            return f"{name} missing"
        if f.is_file() and f.stat().st_size != state["files"][name]:
            return f"{name} has {f.stat().st_size} bytes, expected {state['files'][name]}"
    if (path / "model.safetensors").is_file():
        try:
            from safetensors import safe_open

            with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
                fh.keys()
        except Exception as err:  # noqa: BLE001 - any parse failure means damaged
            return f"model.safetensors unreadable ({err.__class__.__name__})"
    return None


def latest_good_checkpoint(run_dir: Path):
    """(step, path) of the newest checkpoint that passes `checkpoint_problem`; damaged ones are named and skipped."""
    for step, path in reversed(list_checkpoints(run_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return step, path
        log(f"distill: checkpoint {path} is damaged ({problem}); not resuming from it, trying the previous one")
    return None


def _file_sizes(directory: Path) -> dict[str, int]:
    return {p.relative_to(directory).as_posix(): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}


def truncate_log(path: Path, last_step: int) -> None:
    """Keep the log lines of steps up to `last_step` (a resumed run rewrites the steps after its checkpoint)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = path.read_text().splitlines() if path.is_file() else []
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line + "\n")
        except (ValueError, KeyError):
            break  # a torn last line from a kill
    atomic_write_text(path, "".join(kept))


def save_checkpoint(recipe, accelerator, draft, scheduler, tokenizer, run_dir: Path, step: int, global_batch: int) -> Path:
    """Write `checkpoint-STEP/` atomically: everything goes into a hidden temporary directory that is
    renamed once complete. It holds the draft as a plain Hugging Face model (config, safetensors,
    tokenizer), the accelerate state (optimizer, RNG; DeepSpeed shards under ZeRO), the schedule and
    data position (trainer_state.json, written last) and the resolved recipe."""
    final = run_dir / f"checkpoint-{step}"
    tmp = run_dir / f".checkpoint-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        _write_checkpoint(recipe, accelerator, draft, scheduler, tokenizer, tmp, step, global_batch)
        # Every process writes its own RNG state into tmp: rename only once all have, or a late one's file is
        # written into a recreated temporary directory and lost.
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            if final.exists():  # a damaged checkpoint of an earlier run at the same step: replaced whole
                shutil.rmtree(final)
            tmp.rename(final)
    except BaseException:
        if accelerator.is_main_process:  # a full disk, a read-only disk: the partial directory goes
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if accelerator.is_main_process:
        log(f"distill: step {step}: checkpoint written to {final}")
    accelerator.wait_for_everyone()
    return final


def _write_checkpoint(recipe, accelerator, draft, scheduler, tokenizer, tmp: Path, step: int, global_batch: int) -> None:
    accelerator.save_state(str(tmp / "state"), safe_serialization=True)
    state_dict = accelerator.get_state_dict(draft)  # gathered from every process under ZeRO-3
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(draft)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        vocab_file = tmp.parent / DRAFT_VOCAB_FILE  # the run's draft vocabulary travels with each checkpoint
        if vocab_file.is_file():
            shutil.copy2(vocab_file, tmp / DRAFT_VOCAB_FILE)
        atomic_write_text(tmp / "recipe.yaml", dump_recipe(recipe))
        state = {"step": step, "global_batch": global_batch, "examples_seen": step * global_batch,
                 "scheduler": scheduler.state_dict(), "processes": accelerator.num_processes}
        state["files"] = _file_sizes(tmp)
        atomic_write_json(tmp / STATE_FILE, state)


def prune_checkpoints(accelerator, run_dir: Path, keep: int) -> None:
    if keep <= 0 or not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return
    summary = run_dir / "eval" / "summary.json"
    best = json.loads(summary.read_text())["best"] if summary.is_file() else None
    for _, path in list_checkpoints(run_dir)[:-keep]:
        if path.name == best:
            continue  # the best measured checkpoint is what export writes; never pruned
        shutil.rmtree(path)
        log(f"distill: removed {path} (keep_checkpoints={keep}); its eval report stays in eval/{path.name}/")
    accelerator.wait_for_everyone()
