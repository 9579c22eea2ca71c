"""Studies on tiny models: shared data generated once, one row per variant, resume after a kill with only
the unfinished variants redone, bad variants refused before any work. Every run is the real command."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import ROOT, free_port

VARIANTS = {
    "fkl": ["distill.losses={forward_kl: 1.0}"],
    "rkl": ["distill.losses={reverse_kl: 1.0}"],
    "longer_data": ["generate.max_new_tokens=8", "distill.losses={reverse_kl: 1.0}"],
}


def write_study(tmp_path, target_dir, name="s", variants=None):
    base = {"name": "base", "seed": 1, "target": {"model": str(target_dir)}, "draft": {"layers": [0]},
            "data": {"max_prompts": 6},
            "generate": {"temperatures": [0.0], "max_new_tokens": 6, "batch_size": 8, "topk_logprobs": 4},
            "distill": {"losses": {"reverse_kl": 1.0}, "max_steps": 2, "batch_size": 2, "checkpoint_every": 2,
                        "lr": 3e-3, "warmup_steps": 1, "loss_chunk_size": 4, "mixed_precision": "no"},
            "eval": {"k": 2, "temperatures": [0.0, 1.0], "max_new_tokens": 6, "num_prompts": 2, "compile": "off"},
            "tracking": {"report_to": "none"}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    study = {"name": name, "base": "base.yaml", "output_dir": str(tmp_path / "runs" / name),
             "overrides": ["distill.max_steps=2"], "variants": variants or VARIANTS}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path, tmp_path / "runs" / name


def run_study(study, *extra):
    return subprocess.run([sys.executable, "-m", "train.study", str(study), *extra], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)


def test_study_shares_data_writes_one_row_per_variant_and_resumes_only_unfinished(tmp_path, tiny_target_dir):
    study, run_dir = write_study(tmp_path, tiny_target_dir)
    proc = subprocess.Popen([sys.executable, "-m", "train.study", str(study)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            start_new_session=True)
    # Kill the whole study (driver and child) once the first variant is finished and the second has started.
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and not (run_dir / "rkl" / "recipe.yaml").is_file():
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = run_dir / "fkl" / "study_row.json"
    assert first.is_file() and not (run_dir / "rkl" / "study_row.json").exists()
    partial = json.loads((run_dir / "study.json").read_text())  # the table so far, written after each variant
    assert [r["variant"] for r in partial["variants"]] == ["fkl"] and partial["pending"] == ["rkl", "longer_data"]
    finished_at = first.stat().st_mtime_ns
    export_at = (run_dir / "fkl" / "export" / "model.safetensors").stat().st_mtime_ns

    done = run_study(study)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 of 3 variants already finished (fkl)" in done.stderr, done.stderr[:3000]
    # The finished variant was not redone: neither its row nor its export was written again.
    assert first.stat().st_mtime_ns == finished_at
    assert (run_dir / "fkl" / "export" / "model.safetensors").stat().st_mtime_ns == export_at

    # Two data sets for three variants: fkl and rkl share one, generated once; longer_data has its own.
    data_dirs = sorted((run_dir / "_data").iterdir())
    assert len(data_dirs) == 2
    for v in VARIANTS:
        assert (run_dir / v / "generate").is_symlink()
    fkl, rkl, longer = ((run_dir / v / "generate").resolve() for v in VARIANTS)
    assert fkl == rkl != longer
    assert all(len(list((d / "generate").glob("manifest.json"))) == 1 for d in data_dirs)

    result = json.loads((run_dir / "study.json").read_text())
    assert [r["variant"] for r in result["variants"]] == list(VARIANTS) and result["pending"] == []
    assert result["winner"] in VARIANTS
    for row in result["variants"]:
        assert set(row["by_temperature"]) == {"0.0", "1.0"}
        assert row["by_temperature"]["0.0"]["requests"] == 2 and row["by_temperature"]["0.0"]["alpha_se"] is not None
        assert row["by_temperature"]["0.0"]["alpha"] is not None and row["distill_steps"] == 2
        assert row["distill_tokens"] > 0 and row["best_checkpoint"] == "checkpoint-2"
        log = [json.loads(line) for line in (run_dir / row["variant"] / "distill" / "log.jsonl").read_text().splitlines()]
        # Two steps: one step at each end for the loss, the median over both for the throughput.
        assert row["distill_loss"] == {"steps": 1, "first": log[0]["train/loss"], "last": log[1]["train/loss"]}
        assert row["distill_tokens_per_s"] == pytest.approx(sum(s["train/tokens_per_s"] for s in log) / 2)
        assert (run_dir / row["variant"] / "export" / "config.json").is_file()
        # Wall time per stage from the runs' timings.json: the shared data's generate, the variant's own stages.
        wall = row["wall_seconds"]
        assert set(wall) == {"generate", "distill", "eval", "export", "total"}
        assert wall["total"] == pytest.approx(sum(v for k, v in wall.items() if k != "total")) and wall["distill"] > 0
    timings = json.loads((run_dir / "fkl" / "timings.json").read_text())["entries"]
    whats = [e["what"] for e in timings]
    assert "eval checkpoint-2 (within distill)" in whats and whats[-1].startswith("run: ")
    assert all(e["seconds"] >= 0 and e["processor"] and e["processes"] == 1 for e in timings)
    sizes = {r["variant"]: r["data"]["completion_tokens"] for r in result["variants"]}
    assert sizes["fkl"] == sizes["rkl"] and sizes["longer_data"] >= sizes["fkl"]
    table = (run_dir / "study.md").read_text()
    assert all(f"| {v} " in table for v in VARIANTS)
    assert all(r["draft_head"] == {"size": None, "coverage": None} for r in result["variants"]) and "| full |" in table
    assert (run_dir / "study.png").stat().st_size > 0

    again = run_study(study)  # everything finished: nothing is redone, the table is written again
    assert again.returncode == 0 and "3 of 3 variants already finished" in again.stderr
    assert first.stat().st_mtime_ns == finished_at
    rows_again = run_study(study, "--report")  # the rows computed again from the variants' files, nothing run
    assert rows_again.returncode == 0, rows_again.stderr[-2000:]
    assert json.loads((run_dir / "study.json").read_text())["variants"] == result["variants"]
    assert (run_dir / "fkl" / "export" / "model.safetensors").stat().st_mtime_ns == export_at

    # The same tables over finished run directories, without the study file: the same rows, named by directory.
    collected = tmp_path / "collected"
    proc = collect(run_dir / "fkl", run_dir / "longer_data", "--out", collected)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads((collected / "study.json").read_text())
    assert got["collected"] and [r["variant"] for r in got["variants"]] == ["fkl", "longer_data"]
    for row, want in zip(got["variants"], (result["variants"][0], result["variants"][2])):
        assert {k: v for k, v in row.items() if k != "overrides"} == {k: v for k, v in want.items() if k != "overrides"}
    assert f"- `fkl`: `{run_dir / 'fkl'}/recipe.yaml`" in (collected / "study.md").read_text()
    assert (collected / "study.png").stat().st_size > 0
    # A run measured with other eval settings is refused, naming the setting: its figures would not compare.
    other = tmp_path / "other"
    shutil.copytree(run_dir / "rkl", other)  # the data copied, not linked: the link is relative
    report_path = other / "eval" / "checkpoint-2" / "report.json"
    report = json.loads(report_path.read_text())
    report["settings"]["max_new_tokens"] = 12
    report_path.write_text(json.dumps(report))
    refused = collect(run_dir / "fkl", other, "--out", tmp_path / "refused")
    assert refused.returncode == 2 and not (tmp_path / "refused").exists()
    assert refused.stderr.strip().splitlines()[-1] == (
        f"specdistill: error: --runs: '{other}' was measured with max_new_tokens 12, '{run_dir / 'fkl'}' with 6: "
        "their figures do not compare")


def collect(*args):
    return subprocess.run([sys.executable, "-m", "train.study", "--runs", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


def test_distill_progress_averages_the_ends_and_takes_the_median_after_the_first_quarter():
    from train.study import distill_progress

    steps = [{"train/loss": float(i), "train/tokens_per_s": float(i)} for i in range(200)]
    assert distill_progress(steps) == {"distill_loss": {"steps": 50, "first": 24.5, "last": 174.5},
                                       "distill_tokens_per_s": 124.5}  # the median of steps 50..199
    assert distill_progress(steps[:12])["distill_loss"] == {"steps": 3, "first": 1.0, "last": 10.0}
    assert distill_progress([]) == {"distill_loss": None, "distill_tokens_per_s": None}


@pytest.mark.parametrize("variants, message", [
    ({"ok": [], "bad": ["distill.nope=1"]}, "study variant 'bad': unknown recipe key 'distill.nope'"),
    ({"ok": [], "bad": ["distill.lr=-1"]}, "study variant 'bad': recipe key 'distill.lr': must be > 0"),
    ({"ok": [], "bad": ["distill.lr"]}, "study variant 'bad': override 'distill.lr': expected key.sub=value"),
])
def test_a_bad_variant_is_refused_before_any_work(tmp_path, tiny_target_dir, variants, message):
    study, run_dir = write_study(tmp_path, tiny_target_dir, variants=variants)
    proc = run_study(study)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"specdistill: error: {message}")
    assert not run_dir.exists()


def test_dry_run_lists_variants_and_resolved_recipes(tmp_path, tiny_target_dir):
    study, run_dir = write_study(tmp_path, tiny_target_dir)
    proc = run_study(study, "--dry-run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    recipes = [yaml.safe_load(part.split("\n", 1)[1]) for part in proc.stdout.split("# variant ")[1:]]
    assert [r["name"] for r in recipes] == ["s-fkl", "s-rkl", "s-longer_data"]
    assert recipes[0]["distill"]["losses"] == {"forward_kl": 1.0} and recipes[0]["distill"]["max_steps"] == 2
    assert recipes[2]["generate"]["max_new_tokens"] == 8
    only = run_study(study, "--dry-run", "--variants", "rkl")
    assert only.returncode == 0, only.stderr[-2000:]
    assert [part.split(" ", 1)[0] for part in only.stdout.split("# variant ")[1:]] == ["rkl"]
    assert "3 variants (1 selected by --variants)" in only.stderr
    assert not run_dir.exists()


def test_a_study_under_accelerate_launch_runs_each_variant_on_both_processes(tmp_path, tiny_target_dir):

    study, run_dir = write_study(tmp_path, tiny_target_dir, variants={"fkl": VARIANTS["fkl"], "rkl": VARIANTS["rkl"]})
    launcher = ["-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes/accelerate/ddp.yaml"),
                "--num_processes", "2", "--main_process_port", str(free_port())]
    proc = subprocess.run([sys.executable, *launcher, "-m", "train.study", str(study)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((run_dir / "study.json").read_text())
    assert [r["variant"] for r in result["variants"]] == ["fkl", "rkl"]
    for name in ("fkl", "rkl"):  # each variant's children formed one 2-process group
        assert f"run directory {run_dir / name}; device cpu:0; 2 processes" in proc.stderr
    assert proc.stderr.count("global batch 4 sequences (2 x 1 accumulation x 2 processes)") >= 2
    assert len(list((run_dir / "_data").iterdir())) == 1


def test_every_study_file_in_recipes_resolves(tmp_path):
    from train.study import load_study, resolve_variants

    studies = sorted((ROOT / "recipes" / "studies").glob("*.yaml"))
    assert studies
    for path in studies:
        study, base, _ = load_study(path)
        variants = resolve_variants(study, base, tmp_path / study.name)
        assert len(variants) == len(study.variants) >= 2


def test_a_repeat_with_another_training_seed_shares_the_data(tmp_path, tiny_target_dir):
    """distill.seed changes the training run only; the recipe's seed changes the generated data too."""
    from train.study import load_study, resolve_variants

    path, _ = write_study(tmp_path, tiny_target_dir, variants={"a": [], "a_seed2": ["distill.seed=2"], "b": ["seed=2"]})
    study, base, run_dir = load_study(path)
    keys = {v.name: v.data_key for v in resolve_variants(study, base, run_dir)}
    assert keys["a"] == keys["a_seed2"] != keys["b"]


def test_a_key_added_since_a_variant_ran_is_no_difference():
    """A finished variant's stored recipe lacks keys a newer version added (their defaults apply); any stored key
    that changed, in a section or a whole value such as the losses, is a difference."""
    from train.recipe import load_recipe
    from train.study import _differs

    current = json.loads(json.dumps(load_recipe(ROOT / "recipes" / "default.yaml").to_dict()))
    stored = json.loads(json.dumps(current))
    del stored["eval"]["compile"]
    assert not _differs(stored, current)
    stored["distill"]["losses"]["jsd"] = 1.0
    assert _differs(stored, current)
    stored = json.loads(json.dumps(current))
    stored["data"]["self_written"]["num_prompts"] = 5
    assert _differs(stored, current)
    stored = json.loads(json.dumps(current))
    stored["old_key"] = 1
    assert _differs(stored, current)


def test_the_draft_head_column():
    from train.study import _head

    temps = ["0.0", "0.7"]
    assert _head({"size": 8192, "coverage": {"0.0": 0.9256, "0.7": 0.9535}}, temps) == "8192 (92.6% / 95.3% inside)"
    assert _head({"size": 8192, "coverage": None}, temps) == "8192"  # a report from before coverage was kept
    assert _head({"size": None, "coverage": None}, temps) == "full" and _head(None, temps) == "-"


def test_variants_option_runs_only_the_named_variants(tmp_path, tiny_target_dir):
    study, run_dir = write_study(tmp_path, tiny_target_dir, variants={"fkl": VARIANTS["fkl"], "rkl": VARIANTS["rkl"]})
    unknown = run_study(study, "--variants", "rkl,nope")
    assert unknown.returncode == 2 and not run_dir.exists()
    assert unknown.stderr.strip().splitlines()[-1] == (
        "specdistill: error: --variants: no variant 'nope' in study 's' (variants: fkl, rkl)")

    proc = run_study(study, "--variants", "rkl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "rkl" / "study_row.json").is_file() and not (run_dir / "fkl").exists()
    result = json.loads((run_dir / "study.json").read_text())
    assert [r["variant"] for r in result["variants"]] == ["rkl"] and result["pending"] == ["fkl"]
