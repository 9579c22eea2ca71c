"""Self-written prompts (data.source: self): the chat-template prefix, duplicate filtering, reproducibility for a
seed, resumption from the written rounds, and the generate stage answering them."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_model
from train.recipe import parse_recipe
from train.self_written import NearDuplicates, accept, normalize, request_prefix, write_self_prompts

SELF = {"num_prompts": 12, "domains": {"code": "Ask about code.", "chat": ""}, "max_tokens": 8, "min_words": 1,
        "keep_unfinished": True, "near_duplicate": 0.5}


def recipe_for(tmp_path, seed=0, max_prompts=None, **self_written):
    return parse_recipe({"name": "self", "output_dir": str(tmp_path / "run"), "seed": seed, "stages": ["generate"],
                         "data": {"source": "self", "self_written": {**SELF, **self_written}, "max_prompts": max_prompts},
                         "generate": {"temperatures": [0.0], "max_new_tokens": 6, "batch_size": 4}})


@pytest.fixture(scope="module")
def target(tiny_tokenizer):
    torch.manual_seed(0)
    return make_model(len(tiny_tokenizer), layers=2, seed=0, scale=2.0)


def test_prefix_is_the_template_up_to_the_user_text(tiny_tokenizer):
    ids = request_prefix(tiny_tokenizer, "Ask about code.")
    text = tiny_tokenizer.decode(ids)
    assert text == "<s>system\nAsk about code.</s>\n<s>user\n"
    assert tiny_tokenizer.decode(request_prefix(tiny_tokenizer, "")) == "<s>user\n"


def test_exact_and_near_duplicates_are_seen():
    seen = NearDuplicates(0.6)
    seen.add("How do I reverse a list in Python?")
    assert seen.seen("how do i reverse a list in python")  # case, punctuation
    assert seen.seen("How do I  reverse a list in Python, please?")  # near
    assert not seen.seen("Write a poem about the sea at night.")
    assert normalize("  A,  b!\nC ") == "a b c"


def test_accept_drops_cut_and_short_requests():
    cfg = parse_recipe({"data": {"source": "self"}}).data.self_written
    assert accept("  Fix my code please  ", "eos", cfg) == "Fix my code please"
    assert accept("Fix my code please", "length", cfg) is None  # cut at max_tokens: not a whole request
    assert accept("Hi there", "eos", cfg) is None  # fewer than min_words (3)


def written(path):
    return [json.loads(line) for line in (path / "prompts.jsonl").read_text().splitlines()]


def test_self_written_prompts_are_deduplicated_reproducible_and_resume(tmp_path, target, tiny_tokenizer):
    recipe = recipe_for(tmp_path)
    first = write_self_prompts(recipe, target, tiny_tokenizer, tmp_path / "a")
    rows = written(tmp_path / "a")
    assert len(rows) == len(first) > 0
    assert {r["domain"] for r in rows} == {"code", "chat"} and all(r["family"] == f"self-{r['domain']}" for r in rows)
    per_domain = {d: sum(r["domain"] == d for r in rows) for d in ("code", "chat")}
    assert max(per_domain.values()) <= 6  # the quota: 12 prompts over two domains
    check = NearDuplicates(0.5)
    for r in rows:  # no kept request is a (near) duplicate of an earlier one
        assert not check.seen(r["prompt"]), r["prompt"]
        check.add(r["prompt"])

    # The same seed writes the same prompts; another seed other ones.
    write_self_prompts(recipe, target, tiny_tokenizer, tmp_path / "b")
    assert written(tmp_path / "b") == rows
    write_self_prompts(recipe_for(tmp_path, seed=5), target, tiny_tokenizer, tmp_path / "c")
    assert [r["prompt"] for r in written(tmp_path / "c")] != [r["prompt"] for r in rows]

    # A run killed after its first round resumes from the rounds on disk and keeps the same set.
    rounds = sorted((tmp_path / "a" / "self_written").glob("round-*.jsonl"))
    assert len(rounds) >= 2
    (tmp_path / "a" / "prompts.jsonl").unlink()
    for path in rounds[1:]:
        path.unlink()
    write_self_prompts(recipe, target, tiny_tokenizer, tmp_path / "a")
    assert written(tmp_path / "a") == rows


def test_generate_stage_answers_self_written_prompts(tmp_path, target, tiny_tokenizer):
    from train.dist import distributed_state
    from train.generate import load_generated, run_generate_stage

    recipe = recipe_for(tmp_path, with_builtin=True, max_prompts=30)
    run_generate_stage(recipe, target, tiny_tokenizer, tmp_path / "run", distributed_state())
    rows = load_generated(tmp_path / "run").to_list()
    ids = {r["prompt_id"] for r in rows}
    assert any(i.startswith("self-") for i in ids) and any(not i.startswith("self-") for i in ids)  # the mixture
    self_ids = {r["id"] for r in written(tmp_path / "run" / "generate")}
    assert self_ids <= ids
