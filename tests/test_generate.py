"""Generate stage on a tiny target: columns, correctness, resume after SIGKILL, two processes, prompt sources."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from conftest import ROOT, free_port, rows_of
from train.generate import load_generated, load_prompts
from train.recipe import parse_recipe


def write_recipe(tmp_path, target_dir, run_dir, **generate):
    gen = {"temperatures": [0.0, 1.0], "max_new_tokens": 12, "batch_size": 4, "shard_size": 6, "num_samples": 2, **generate}
    text = json.dumps({"name": "gen", "output_dir": str(run_dir), "seed": 3, "stages": ["generate"],
                       "target": {"model": str(target_dir)}, "draft": {"layers": [0]},
                       "data": {"max_prompts": 10}, "generate": gen})
    path = tmp_path / f"{run_dir.name}.yaml"
    path.write_text(text)  # JSON is YAML
    return path


def run_train(recipe, *extra, env=None):
    return subprocess.run([sys.executable, "-m", "train", str(recipe), *extra], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_target_dir):
    tmp = tmp_path_factory.mktemp("gen-ref")
    recipe = write_recipe(tmp, tiny_target_dir, tmp / "ref", topk_logprobs=3)
    proc = run_train(recipe)
    assert proc.returncode == 0, proc.stderr
    return tmp / "ref", proc


def test_generated_dataset_columns_and_counts(reference, tiny_target_dir):
    run_dir, proc = reference
    manifest = json.loads((run_dir / "generate" / "manifest.json").read_text())
    # 10 prompts: greedy once + 2 samples at T=1 -> 30 rows in shards of 6
    assert manifest["rows"] == 30 and len(manifest["shards"]) == 5 and manifest["processes"] == 1
    assert manifest["steps"] == "lean"  # a Llama target on the CPU (generate.steps)
    ds = load_generated(run_dir)
    assert {"prompt_id", "domain", "temperature", "prompt_ids", "completion_ids", "finish_reason", "topk_ids",
            "topk_logprobs"} <= set(ds.column_names)
    for row in ds:
        assert 1 <= len(row["completion_ids"]) <= 12
        assert row["finish_reason"] in {"eos", "length"}
        assert len(row["topk_ids"]) == len(row["completion_ids"]) and len(row["topk_ids"][0]) == 3
        assert row["topk_logprobs"][0][0] >= row["topk_logprobs"][0][1]
    assert "tokens/s" in proc.stderr and "30 rows" in proc.stderr


def test_greedy_rows_equal_unbatched_greedy_decoding(reference, tiny_target_dir):
    from eval.speculative import vanilla_decode
    from eval.models import load_model

    target = load_model(str(tiny_target_dir), device="cpu")
    ds = load_generated(reference[0])
    greedy = [r for r in ds if r["temperature"] == 0]
    assert len(greedy) == 10
    for row in greedy[:5]:
        alone = vanilla_decode(target, row["prompt_ids"], max_new_tokens=12, eos_token_ids=[2])
        assert row["completion_ids"] == alone.output_ids


def test_stored_topk_is_the_targets_own_distribution_at_each_completion_position(reference, tiny_target_dir):
    """The top-k log-probs recorded during generation are, position by position, those of the target over the
    prompt and the completion in one pass (no step shifted, none missing, temperature 1)."""
    import torch

    from eval.models import load_model

    target = load_model(str(tiny_target_dir), device="cpu")
    rows = list(load_generated(reference[0]))
    for row in [r for r in rows if r["temperature"] == 0][:3] + [r for r in rows if r["temperature"] > 0][:3]:
        prompt, completion = row["prompt_ids"], row["completion_ids"]
        with torch.no_grad():
            logits = target(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        values, indices = logits.float().log_softmax(-1).topk(3, dim=-1)
        assert row["topk_ids"] == indices.tolist()
        assert torch.allclose(torch.tensor(row["topk_logprobs"]), values, atol=2e-2)
        if row["temperature"] == 0:
            assert [ids[0] for ids in row["topk_ids"]] == completion  # greedy: the recorded top-1 is the token written


def test_rerun_is_a_no_op_and_kill_then_resume_matches(reference, tmp_path, tiny_target_dir):
    ref_dir, _ = reference
    again = run_train(write_recipe(tmp_path, tiny_target_dir, ref_dir, topk_logprobs=3))
    assert again.returncode == 0 and "already finished" in again.stderr

    # Uninterrupted run with one row per shard (shards are the unit of seeding, so compare like with like).
    whole_dir = tmp_path / "whole"
    assert run_train(write_recipe(tmp_path, tiny_target_dir, whole_dir, topk_logprobs=3, shard_size=1)).returncode == 0
    run_dir = tmp_path / "killed"
    recipe = write_recipe(tmp_path, tiny_target_dir, run_dir, topk_logprobs=3, shard_size=1)
    proc = subprocess.Popen([sys.executable, "-m", "train", str(recipe)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    data = run_dir / "generate" / "data"
    deadline = time.time() + 120
    while time.time() < deadline and len(list(data.glob("shard-*.parquet"))) < 3:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(data.glob("shard-*.parquet")))
    assert 3 <= done < 30, "the kill should land mid-run"
    assert not (run_dir / "generate" / "manifest.json").exists()
    (data / ".shard-00029.parquet.tmp-1").write_bytes(b"half a shard")  # a torn write is never read
    resumed = run_train(recipe)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{done} of this process's 30 shards already written" in resumed.stderr
    assert rows_of(run_dir) == rows_of(whole_dir)  # no row lost or duplicated


def test_generate_dtype_writes_with_a_bf16_copy_of_the_target(tmp_path, tiny_target_dir):
    from eval.models import load_model
    from eval.speculative import vanilla_decode

    run_dir = tmp_path / "bf16"
    proc = run_train(write_recipe(tmp_path, tiny_target_dir, run_dir, temperatures=[0.0], batch_size=1, dtype="bfloat16"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the target writes in bfloat16 (generate.dtype: bfloat16; loaded in float32)" in proc.stderr
    assert json.loads((run_dir / "generate" / "manifest.json").read_text())["dtype"] == "bfloat16"
    bf16 = load_model(str(tiny_target_dir), dtype="bfloat16", device="cpu")
    rows = list(load_generated(run_dir))
    assert len(rows) == 10
    for row in rows[:4]:
        alone = vanilla_decode(bf16, row["prompt_ids"], max_new_tokens=12, eos_token_ids=[2])
        assert row["completion_ids"] == alone.output_ids


def test_generation_dtype_auto_follows_the_hardware(monkeypatch):
    import torch

    import train.models as models

    target = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)  # what the function reads of a model
    monkeypatch.setattr(models, "cpu_flags", lambda: {"avx512f"})
    assert models.generation_dtype("auto", target) == torch.float32
    assert models.generation_dtype("target", target) == torch.float32
    assert models.generation_dtype("bfloat16", target) == torch.bfloat16
    monkeypatch.setattr(models, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert models.generation_dtype("auto", target) == torch.bfloat16


def test_two_processes_write_the_same_dataset(reference, tmp_path, tiny_target_dir):
    run_dir = tmp_path / "ddp"
    recipe = write_recipe(tmp_path, tiny_target_dir, run_dir, topk_logprobs=3)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes/accelerate/ddp.yaml"),
           "--num_processes", "2", "--main_process_port", str(free_port()), "-m", "train", str(recipe)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((run_dir / "generate" / "manifest.json").read_text())
    assert manifest["processes"] == 2
    assert "generate [1]" in proc.stderr  # rank 1 really ran
    assert rows_of(run_dir) == rows_of(reference[0])


def test_prompt_sources_csv_parquet_and_saved_dataset(tmp_path):
    import datasets

    rows = [{"q": "What is 2+2?", "kind": "math", "uid": "a"}, {"q": "Write a poem.", "kind": "prose", "uid": "b"}]
    ds = datasets.Dataset.from_list(rows)
    ds.to_csv(str(tmp_path / "p.csv"))
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for source, path in [("files", "p.csv"), ("files", "p.parquet"), ("hub", "saved")]:
        recipe = parse_recipe({"name": "x", "data": {"source": source, "path": str(tmp_path / path), "prompt_column": "q",
                                                     "domain_column": "kind", "id_column": "uid"}})
        prompts = load_prompts(recipe.data)
        assert [(p.id, p.domain, p.prompt) for p in prompts] == [("a", "math", "What is 2+2?"), ("b", "prose", "Write a poem.")]
    chat = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}]}])
    chat.save_to_disk(str(tmp_path / "chat"))
    recipe = parse_recipe({"name": "x", "data": {"source": "hub", "path": str(tmp_path / "chat"), "chat_column": "messages"}})
    assert load_prompts(recipe.data)[0].as_messages() == [{"role": "user", "content": "hi"}]


def test_builtin_split_leaves_no_template_family_on_both_sides():
    from eval.prompts import builtin_prompts

    train, held_out = builtin_prompts("train"), builtin_prompts("held_out")
    assert len(train) + len(held_out) == len(builtin_prompts("all")) >= 300
    assert {p.domain for p in held_out} == {"code", "math", "json", "prose", "chat"}
    assert all(p.family for p in train + held_out)
    assert not {p.family for p in train} & {p.family for p in held_out}
    assert not {p.id for p in train} & {p.id for p in held_out}


def test_independent_set_is_large_varied_and_shares_nothing_with_the_builtin_set():
    from eval.prompts import builtin_prompts, eval_prompt_set

    independent = eval_prompt_set("independent")
    builtin = builtin_prompts("all")
    assert len(independent) >= 150
    counts = {d: sum(p.domain == d for p in independent) for d in ("code", "math", "json", "prose", "chat")}
    assert min(counts.values()) >= 30, counts
    assert len({p.id for p in independent}) == len(independent)
    # Not written from the templates: no shared opening, and varied openings among themselves.
    openings = {p.prompt[:25].lower() for p in builtin}
    assert not [p.prompt for p in independent if p.prompt[:25].lower() in openings]
    assert len({p.prompt[:25].lower() for p in independent}) >= 0.95 * len(independent)
    lengths = sorted(len(p.prompt.split()) for p in independent)
    assert lengths[0] <= 8 and lengths[-1] >= 25  # short and long requests


def test_shard_batches_keep_temperatures_apart_and_group_prompt_lengths():
    from train.completions import Row
    from train.generate import shard_batches

    lengths = [7, 2, 9, 4, 4, 1, 8, 3, 6, 5]
    rows = [Row(None, [3] * n, t, 0) for t in (0.0, 0.7) for n in lengths] + [Row(None, [3] * 5, 0.0, 0)]
    batches = shard_batches(rows, 4)
    assert sorted(i for b in batches for i in b) == list(range(len(rows)))  # every row once
    assert all(1 <= len(b) <= 4 and len({rows[i].temperature for i in b}) == 1 for b in batches)
    assert len(batches) == 6  # 11 greedy rows in 3 batches, 10 sampled in 3
    for b in batches:  # alike lengths together: each batch's longest prompt is at most the next batch's shortest
        following = [c for c in batches if c is not b and rows[c[0]].temperature == rows[b[0]].temperature
                     and batches.index(c) > batches.index(b)]
        if following:
            assert max(len(rows[i].prompt_ids) for i in b) <= min(len(rows[i].prompt_ids) for i in following[0])
    assert shard_batches(rows, 4) == batches  # the same batches (and seeds) when a run resumes


@pytest.mark.parametrize("steps", ["lean", "transformers"])
def test_batched_loop_equals_transformers_generate_with_rows_leaving_at_eos(steps):
    """Greedy rows of our batched loop (left padding, rows leaving the batch at EOS), with either steps
    (`generate.steps`), are transformers' `generate()` rows token for token, and the recorded top-k are its
    logits' log-softmax top-k."""
    import torch

    from conftest import make_model
    from train.completions import Row, generate_batch

    target = make_model(16, layers=2, hidden=32, seed=4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 16, (n,), generator=g).tolist() for n in (2, 5, 3, 8, 4, 6, 7, 2, 5, 3)]
    rows = [Row(None, ids, 0.0, 0) for ids in prompts]
    settings = SimpleNamespace(max_new_tokens=10, top_p=1.0, top_k=0, topk_logprobs=3)
    ours = generate_batch(target, SimpleNamespace(pad_token_id=0, eos_token_id=2), rows, settings, seed=0, steps=steps)
    assert 2 <= sum(finish == "eos" for _, finish, _ in ours) < len(rows), "some rows, not all, must stop early"
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=2,
                              pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    for i, (completion, finish, (top_ids, top_values)) in enumerate(ours):
        written = ref.sequences[i, width:].tolist()
        if 2 in written:
            written = written[: written.index(2) + 1]
        assert completion == written and finish == ("eos" if written[-1] == 2 else "length")
        values, indices = torch.stack([step[i] for step in ref.logits[: len(completion)]]).float().log_softmax(-1).topk(3)
        assert top_ids == indices.tolist()
        torch.testing.assert_close(torch.tensor(top_values), values, atol=2e-3, rtol=0)
