"""Recipes: every YAML under recipes/ parses; bad input is one clear line and exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from conftest import ROOT
from train.__main__ import main as train_main
from eval.errors import UserError
from train.recipe import dump_recipe, load_recipe, parse_recipe

RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if not {"accelerate", "studies"} & set(p.parts))
ACCELERATE_CONFIGS = sorted((ROOT / "recipes" / "accelerate").rglob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_recipe_parses_and_reads_back_as_written(path):
    recipe = load_recipe(path)
    assert recipe.name == yaml.safe_load(path.read_text())["name"]
    # What a run directory stores (recipe.yaml) parses back to the same recipe.
    assert parse_recipe(yaml.safe_load(dump_recipe(recipe))) == recipe


def test_recipes_exist():
    assert len(RECIPES) >= 2


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_configs_parse(path):
    config = yaml.safe_load(path.read_text())
    assert config["distributed_type"] in {"MULTI_GPU", "DEEPSPEED", "NO"}
    if config["distributed_type"] == "DEEPSPEED":
        import json

        ds_file = ROOT / config["deepspeed_config"]["deepspeed_config_file"]
        ds = json.loads(ds_file.read_text())
        stage = ds["zero_optimization"]["stage"]
        assert path.stem == f"zero{stage}"
        # Left to specdistill, which fills them from the recipe (no dataloader is prepared).
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
            assert ds[key] == "auto", key
        assert config["deepspeed_config"]["zero3_init_flag"] == (stage == 3)


def test_real_scale_recipes_are_there():
    names = {p.stem for p in RECIPES}
    assert {"default", "smoke", "qwen2.5-7b-to-0.5b", "llama3.1-70b-to-3.2-1b", "code-qwen2.5-coder-7b-to-0.5b"} <= names
    assert load_recipe(ROOT / "recipes" / "llama3.1-70b-to-3.2-1b.yaml").draft.init == "pretrained"  # ZeRO-3 needs it


def test_overrides_apply_with_types(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: r\ndistill:\n  lr: 1.0e-4\n")
    recipe = load_recipe(path, ["distill.lr=3e-4", "eval.k=3", "eval.temperatures=[0, 0.5]", "draft.layers=[0,1]"])
    assert recipe.distill.lr == pytest.approx(3e-4)
    assert recipe.eval.k == 3 and recipe.eval.temperatures == [0.0, 0.5]
    assert recipe.draft.layers == [0, 1]


BAD = [
    ({"distil": {}}, "unknown recipe key 'distil'"),
    ({"distill": {"lrr": 1}}, "unknown recipe key 'distill.lrr'"),
    ({"distill": {"lr": "fast"}}, "recipe key 'distill.lr': expected a number"),
    ({"distill": {"max_steps": 0}}, "recipe key 'distill.max_steps': must be > 0"),
    ({"distill": {"batch_size": -2}}, "recipe key 'distill.batch_size': must be > 0"),
    ({"distill": {"losses": {"kl": 1.0}}}, "recipe key 'distill.losses.kl': unknown loss"),
    ({"eval": {"k": 0}}, "recipe key 'eval.k': must be >= 1"),
    ({"eval": {"draft_confidence": 1.0}}, "recipe key 'eval.draft_confidence': must be in"),
    ({"eval": {"temperatures": [0.7, -1]}}, "recipe key 'eval.temperatures': temperatures must be >= 0"),
    ({"eval": {"compile": "yes"}}, "recipe key 'eval.compile': expected one of 'auto', 'on', 'off', 'draft' or true/false"),
    ({"generate": {"temperatures": [-0.5]}}, "recipe key 'generate.temperatures'"),
    ({"draft": {"init": "magic"}}, "recipe key 'draft.init': expected one of"),
    ({"draft": {"init": "pretrained"}}, "recipe key 'draft.model': required"),
    ({"tracking": {"report_to": True}}, "recipe key 'tracking.report_to'"),
    ({"seed": 1.5}, "recipe key 'seed': expected an integer"),
]


@pytest.mark.parametrize("data,message", BAD, ids=[m for _, m in BAD])
def test_bad_recipe_is_refused_with_the_key(data, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_recipe({"name": "x", **data})


def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        train_main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    # Progress lines may come first; the error is one line, and the last.
    errors = [line for line in err.strip().splitlines() if line.startswith("specdistill: error:")]
    assert len(errors) <= 1 and (not errors or err.strip().splitlines()[-1] == errors[0])
    return exc.value.code, errors


def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ndistill:\n  lr: -1\n")
    code, err = run_cli([str(bad), "--dry-run"], capsys)
    assert code == 2 and err == ["specdistill: error: recipe key 'distill.lr': must be > 0"]
    code, err = run_cli([str(tmp_path / "missing.yaml")], capsys)
    assert code == 2 and len(err) == 1 and "missing.yaml' not found" in err[0]
    code, err = run_cli([str(bad), "distill.lr"], capsys)
    assert code == 2 and "expected key.sub=value" in err[0]
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    code, err = run_cli([str(broken)], capsys)
    assert code == 2 and "not valid YAML" in err[0] and len(err) == 1


def test_missing_model_path_is_refused(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\noutput_dir: {tmp_path / 'run'}\ntarget:\n  model: {tmp_path / 'nope'}\n")
    code, err = run_cli([str(recipe), "--dry-run"], capsys)
    assert code == 2 and err == [f"specdistill: error: model path '{tmp_path / 'nope'}' not found"]
    assert not (tmp_path / "run").exists()


def test_resolved_recipe_is_written_and_other_recipe_refused(tmp_path, tiny_target_dir, capsys):
    recipe = tmp_path / "r.yaml"
    run_dir = tmp_path / "run"
    recipe.write_text(f"name: r\noutput_dir: {run_dir}\ntarget:\n  model: {tiny_target_dir}\nstages: [generate]\n"
                      "draft:\n  layers: [1]\n")
    train_main([str(recipe), "eval.k=2"])
    resolved = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert resolved["eval"]["k"] == 2 and resolved["target"]["model"] == str(tiny_target_dir)
    before = (run_dir / "recipe.yaml").read_text()
    code, err = run_cli([str(recipe), "distill.lr=0.5"], capsys)
    assert code == 2 and "holds a run of a different recipe (section 'distill' differs)" in err[-1]
    assert (run_dir / "recipe.yaml").read_text() == before  # nothing already written is touched
    train_main([str(recipe), "distill.lr=0.5", "--overwrite"])
    # A run written before a recipe key existed is the same recipe when the new key holds its default.
    stored = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    del stored["distill"]["group_by_length"]
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(stored))
    train_main([str(recipe), "distill.lr=0.5"])
    code, err = run_cli([str(recipe), "distill.lr=0.5", "distill.group_by_length=true"], capsys)
    assert code == 2 and "section 'distill' differs" in err[-1]


def test_subprocess_exit_status_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nunknown_section: 1\n")
    proc = subprocess.run([sys.executable, "-m", "train", str(bad)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "specdistill: error: unknown recipe key 'unknown_section'; expected one of: data, distill, draft, eval, "
        "export, generate, name, output_dir, seed, stages, target, tracking"
    ]
