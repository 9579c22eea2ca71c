"""Faults survived and bad input refused: kills at chosen points, damaged checkpoints, NaN loss, full or
read-only disk, secrets, determinism. Every run is the real command in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import (ROOT, assert_weights_close, prepared, rows_of, run_train, steps_logged, weights,
                      write_distill_recipe as write_recipe)
from train.batches import step_indices
from train.checkpoints import checkpoint_problem

KW = dict(max_steps=6, checkpoint_every=2)


def start(recipe):
    return subprocess.Popen([sys.executable, "-m", "train", str(recipe)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})


def kill_when(proc, condition, timeout=300, poll=0.001):
    deadline = time.time() + timeout
    while time.time() < deadline and not condition():
        if proc.poll() is not None:
            break
        time.sleep(poll)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def last_error(proc):
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("specdistill: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return errors[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, generated, tiny_target_dir):  # noqa: F811
    tmp = tmp_path_factory.mktemp("faults-ref")
    run_dir, recipe = prepared(tmp, generated, "whole", tiny_target_dir, **KW)
    assert run_train(recipe).returncode == 0
    return run_dir


def test_kill_while_a_checkpoint_is_written_then_resume(tmp_path, generated, tiny_target_dir, uninterrupted):  # noqa: F811
    run_dir, recipe = prepared(tmp_path, generated, "killed", tiny_target_dir, **KW)
    proc = start(recipe)
    kill_when(proc, lambda: (run_dir / ".checkpoint-4.tmp").exists())
    assert (run_dir / "checkpoint-2").is_dir() and not (run_dir / "checkpoint-6").exists()
    assert checkpoint_problem(run_dir / "checkpoint-2") is None  # the earlier checkpoint is whole
    if not (run_dir / ".checkpoint-4.tmp").exists():  # the kill landed just after the rename: make the torn write
        shutil.copytree(run_dir / "checkpoint-2", run_dir / ".checkpoint-4.tmp", ignore=shutil.ignore_patterns("trainer_state.json"))
    resumed = run_train(recipe)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not (run_dir / ".checkpoint-4.tmp").exists()
    assert_weights_close(weights(uninterrupted, 6), weights(run_dir, 6))
    assert [r["train/loss"] for r in steps_logged(run_dir)] == pytest.approx([r["train/loss"] for r in steps_logged(uninterrupted)], rel=1e-5)


def test_damaged_newest_checkpoint_is_skipped_with_a_message(tmp_path, generated, tiny_target_dir, uninterrupted):  # noqa: F811
    run_dir, recipe = prepared(tmp_path, generated, "damaged", tiny_target_dir, **KW)
    proc = start(recipe)
    kill_when(proc, lambda: (run_dir / "checkpoint-4").is_dir(), poll=0.01)
    assert not (run_dir / "checkpoint-6").exists()
    weights_file = run_dir / "checkpoint-4" / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:100])  # a torn copy, a bad disk
    assert "model.safetensors" in checkpoint_problem(run_dir / "checkpoint-4")
    resumed = run_train(recipe)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "checkpoint-4 is damaged" in resumed.stderr and "checkpoint-2 (step 2" in resumed.stderr
    assert_weights_close(weights(uninterrupted, 6), weights(run_dir, 6))


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path, generated, tiny_target_dir):  # noqa: F811
    import pyarrow as pa
    import pyarrow.parquet as pq

    run_dir, recipe = prepared(tmp_path, generated, "nan", tiny_target_dir, target_signal="cached", max_steps=6,
                               checkpoint_every=1)
    # Corrupt the cached target log-probs of one row used by step 4 (rows are read in manifest order).
    (shard,) = sorted((run_dir / "generate" / "data").glob("shard-*.parquet"))
    table = pq.read_table(shard)
    n = table.num_rows
    row = step_indices(n, 3, 4, seed=1)[0]
    values = table.column("topk_logprobs").to_pylist()
    values[row] = [[float("nan")] * len(v) for v in values[row]]
    table = table.set_column(table.schema.get_field_index("topk_logprobs"), "topk_logprobs",
                             pa.array(values, type=table.schema.field("topk_logprobs").type))
    pq.write_table(table, shard)
    proc = run_train(recipe)
    assert proc.returncode == 2
    error = last_error(proc)
    assert "loss is nan at step 4" in error and "checkpoint-3" in error
    assert checkpoint_problem(run_dir / "checkpoint-3") is None and not (run_dir / "checkpoint-4").exists()


FAILING_WRITE = """
import errno, pathlib, sys
import transformers
{patch}
from train.__main__ import main
main([{recipe!r}])
"""

FULL_DISK = """
original = transformers.PreTrainedModel.save_pretrained
def save_pretrained(self, path, *args, **kwargs):
    if str(path).endswith(".checkpoint-4.tmp"):
        (pathlib.Path(path) / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(pathlib.Path(path) / "model.safetensors"))
    return original(self, path, *args, **kwargs)
transformers.PreTrainedModel.save_pretrained = save_pretrained
"""

READ_ONLY = """
original = pathlib.Path.rename
def rename(self, target):
    if self.name == ".checkpoint-4.tmp":
        raise OSError(errno.EROFS, "Read-only file system", str(target))
    return original(self, target)
pathlib.Path.rename = rename
"""


@pytest.mark.parametrize("patch,message", [(FULL_DISK, "No space left on device"), (READ_ONLY, "Read-only file system")],
                         ids=["disk-full", "read-only"])
def test_full_or_read_only_disk_is_a_clear_error_and_the_previous_checkpoint_loads(patch, message, tmp_path, generated,  # noqa: F811
                                                                                     tiny_target_dir, uninterrupted):
    from transformers import AutoModelForCausalLM

    run_dir, recipe = prepared(tmp_path, generated, "disk", tiny_target_dir, **KW)
    script = FAILING_WRITE.format(patch=textwrap.dedent(patch), recipe=str(recipe))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2
    error = last_error(proc)
    assert message in error and "rerun the same command" in error
    assert not (run_dir / ".checkpoint-4.tmp").exists() and not (run_dir / "checkpoint-4").exists()
    assert checkpoint_problem(run_dir / "checkpoint-2") is None
    AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint-2")
    resumed = run_train(recipe)  # space freed: the same command finishes the job
    assert resumed.returncode == 0 and "resuming from" in resumed.stderr
    assert_weights_close(weights(uninterrupted, 6), weights(run_dir, 6))


def test_kill_during_eval_then_resume_gives_the_same_measurements(tmp_path, generated, tiny_target_dir):  # noqa: F811
    eval_ = {"k": 2, "temperatures": [0.0, 1.0], "max_new_tokens": 10, "num_prompts": 2}
    runs = {}
    for name in ("eval-whole", "eval-killed"):
        run_dir = tmp_path / name
        shutil.copytree(generated, run_dir / "generate")
        runs[name] = (run_dir, write_recipe(tmp_path, tiny_target_dir, run_dir, stages=("distill", "eval"), eval_=eval_,
                                            max_steps=4, checkpoint_every=2))
    assert run_train(runs["eval-whole"][1]).returncode == 0
    run_dir, recipe = runs["eval-killed"]
    proc = start(recipe)
    kill_when(proc, lambda: (run_dir / "eval" / "checkpoint-2").is_dir())
    assert not (run_dir / "eval" / "checkpoint-2" / "report.json").exists() or not (run_dir / "checkpoint-4").exists()
    resumed = run_train(recipe)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for tag in ("checkpoint-2", "checkpoint-4"):
        a = json.loads((runs["eval-whole"][0] / "eval" / tag / "report.json").read_text())
        b = json.loads((run_dir / "eval" / tag / "report.json").read_text())
        for t in ("0.0", "1.0"):
            for key in ("alpha", "tau", "tokens_generated", "total_accepted"):
                assert a["by_temperature"][t][key] == pytest.approx(b["by_temperature"][t][key], abs=1e-9), (tag, t, key)


def test_same_recipe_and_seed_give_the_same_dataset_and_weights(tmp_path, tiny_target_dir):

    dirs = []
    for name in ("first", "second"):
        run_dir = tmp_path / name
        recipe = write_recipe(tmp_path, tiny_target_dir, run_dir, max_steps=3, checkpoint_every=3)
        assert run_train(recipe).returncode == 0
        dirs.append(run_dir)
    assert rows_of(dirs[0]) == rows_of(dirs[1])  # sampled rows (T=1) included
    a, b = weights(dirs[0], 3), weights(dirs[1], 3)
    assert all((a[k] == b[k]).all() for k in a)  # bitwise, same machine


def test_bad_prompt_files_and_mismatched_draft_exit_2_with_nothing_written(tmp_path, tiny_target_dir):
    from conftest import make_model, make_tokenizer

    cases = []
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases.append(({"data": {"source": "files", "path": str(empty)}}, "holds no prompts"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": broken\n')
    cases.append(({"data": {"source": "files", "path": str(bad)}}, f"{bad}' line 2"))
    other = tmp_path / "other-draft"
    tok = make_tokenizer(vocab_size=280, extra="zzz qqq")
    make_model(len(tok), layers=1).save_pretrained(other)
    tok.save_pretrained(other)
    cases.append(({"draft": {"init": "pretrained", "model": str(other)}}, "the draft must use the target's tokenizer"))
    cases.append(({"target": {"model": str(tmp_path / "nowhere")}}, "not found"))
    for i, (change, message) in enumerate(cases):
        run_dir = tmp_path / f"bad{i}"
        recipe = write_recipe(tmp_path, tiny_target_dir, run_dir)
        data = json.loads(recipe.read_text())
        for section, values in change.items():
            data[section] = {**data[section], **values}
        recipe.write_text(json.dumps(data))
        proc = run_train(recipe)
        assert proc.returncode == 2, (message, proc.stderr[-2000:])
        assert message in last_error(proc), message
        assert not (run_dir / "generate").exists() and not list(run_dir.glob("checkpoint-*"))


NO_PICKLE = """
import torch
original = torch.load
def load(*args, **kwargs):
    if kwargs.get("weights_only") is not True:
        raise AssertionError("torch.load without weights_only=True")
    return original(*args, **kwargs)
torch.load = load
"""


def test_resume_loads_no_pickle(tmp_path, generated, tiny_target_dir, uninterrupted):  # noqa: F811
    """Resuming reads weights from safetensors and the optimizer/RNG state with torch.load(weights_only=True)."""
    run_dir, recipe = prepared(tmp_path, generated, "nopickle", tiny_target_dir, **KW)
    proc = start(recipe)
    kill_when(proc, lambda: (run_dir / "checkpoint-4").is_dir(), poll=0.01)
    script = FAILING_WRITE.format(patch=NO_PICKLE, recipe=str(recipe))
    resumed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    assert_weights_close(weights(uninterrupted, 6), weights(run_dir, 6))
