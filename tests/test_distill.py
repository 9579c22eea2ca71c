"""Distill stage on tiny models: checkpoints, per-checkpoint eval, W&B offline, exact normalisation,
resume after SIGKILL, and real 2-process DDP against one process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import (ROOT, assert_weights_close, free_port, make_model, prepared, run_train, steps_logged, weights,
                      write_distill_recipe as write_recipe)

SECRET = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_target_dir):
    """generate -> distill (checkpoint every 3 steps, each measured) -> eval, with W&B offline and a key in the env."""
    tmp = tmp_path_factory.mktemp("distill-full")
    run_dir = tmp / "full"
    recipe = write_recipe(tmp, tiny_target_dir, run_dir, stages=("generate", "distill", "eval", "export"), tracking="wandb")
    data = json.loads(recipe.read_text())
    # A reduced draft vocabulary of 120 of the 300 tokens: chosen once, carried by checkpoints and the export.
    recipe.write_text(json.dumps({**data, "draft": {"layers": [0], "vocab_size": 120}, "export": {"wandb_artifact": True}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_API_KEY=SECRET, HF_TOKEN=SECRET, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "train", str(recipe)], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_checkpoints_hold_a_loadable_draft_and_the_training_state(full_run):
    from transformers import AutoModelForCausalLM

    run_dir, proc = full_run
    assert [p.name for p in sorted(run_dir.glob("checkpoint-*"))] == ["checkpoint-3", "checkpoint-6"]
    assert not list(run_dir.glob(".checkpoint-*"))  # no temporary directory left behind
    ckpt = run_dir / "checkpoint-6"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "recipe.yaml", "trainer_state.json",
                 "state/optimizer.bin", "state/random_states_0.pkl"):
        assert (ckpt / name).is_file(), name
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["global_batch"] == 4 and state["examples_seen"] == 24
    assert state["scheduler"]["last_epoch"] == 6
    draft = AutoModelForCausalLM.from_pretrained(ckpt)  # plain transformers, no project code
    assert draft.config.num_hidden_layers == 1
    log = steps_logged(run_dir)
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert all(r["train/loss"] > 0 and r["train/tokens"] > 0 for r in log)
    assert log[0]["train/lr"] < log[1]["train/lr"]  # warm-up


def test_every_checkpoint_is_measured_and_the_best_is_chosen_by_speedup(full_run):
    from train.evaluate import score

    run_dir, proc = full_run
    summary = json.loads((run_dir / "eval" / "summary.json").read_text())
    assert [e["tag"] for e in summary["checkpoints"]] == ["checkpoint-3", "checkpoint-6"]
    reports = {t: json.loads((run_dir / "eval" / t / "report.json").read_text()) for t in ("checkpoint-3", "checkpoint-6")}
    for report in reports.values():
        assert set(report["by_temperature"]) == {"0.0", "1.0"}
        assert report["by_temperature"]["0.0"]["speedup_observed"] > 0
        assert report["greedy_identical_to_vanilla"] == 1.0
    best = max(reports, key=lambda t: score(reports[t]))
    assert summary["best"] == best
    vocab = json.loads((run_dir / "draft_vocab.json").read_text())
    assert vocab["size"] == len(vocab["ids"]) == 120 and 2 in vocab["ids"]  # EOS always kept
    assert 0 < vocab["generated_tokens_covered"] <= 1
    for tag, report in reports.items():
        assert report["draft_vocab_size"] == 120
        assert json.loads((run_dir / tag / "draft_vocab.json").read_text())["ids"] == vocab["ids"]
    assert "draft vocabulary 120 tokens" in proc.stderr
    assert "best" in proc.stdout and "checkpoint-6" in proc.stdout  # the summary table is printed


def test_wandb_offline_run_holds_the_measured_alpha_and_no_secret(full_run):
    run_dir, _ = full_run
    (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(wandb_file)],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:  # older wandb CLIs: fall back to the entry point next to the interpreter
        out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "wandb"), "leet", "inspect", "--json",
                              str(wandb_file)], capture_output=True, text=True, timeout=120)
    history = [json.loads(line)["history"]["item"] for line in out.stdout.splitlines() if '"type":"history"' in line]
    report = json.loads((run_dir / "eval" / "checkpoint-6" / "report.json").read_text())
    logged = [h for h in history if "eval/alpha@T=0.0" in h]
    assert len(logged) == 2
    assert logged[-1]["eval/alpha@T=0.0"] == pytest.approx(report["by_temperature"]["0.0"]["alpha"])
    assert any("eval/acceptance_by_draft_position.filenames" in h for h in history)
    assert any("train/reverse_kl" in h and "train/tokens_per_s" in h for h in history)
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"a secret (W&B key, hub token) was written to {path}"


def test_export_is_a_plain_transformers_draft_that_assists_generate(full_run, tiny_target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, proc = full_run
    export = run_dir / "export"
    summary = json.loads((run_dir / "eval" / "summary.json").read_text())
    report = json.loads((run_dir / "eval" / summary["best"] / "report.json").read_text())
    generation = json.loads((export / "generation_config.json").read_text())
    assert generation["num_assistant_tokens"] == report["by_temperature"]["0.0"]["optimal_k"]
    assert generation["num_assistant_tokens_schedule"] == "constant"
    assert generation["assistant_confidence_threshold"] == 0.0  # measured with a fixed k: transformers' 0.4 is off
    card = (export / "README.md").read_text()
    assert summary["best"] in card and "| T | alpha |" in card and "| T | domain |" in card and "```yaml" in card
    assert f", decoded {report['decoder']['mode']}" in card  # how it was decoded: compiled, or eager (lean steps here)
    assert (export / "plots" / "acceptance_by_draft_position.png").is_file() and "plots/acceptance_by_draft_position.png" in card
    assert not list(run_dir.glob(".export*"))
    assert (export / "draft_vocab.json").read_text() == (run_dir / summary["best"] / "draft_vocab.json").read_text()
    assert "draft_vocab.json" in card
    draft = AutoModelForCausalLM.from_pretrained(export)  # no project code; the full head
    assert draft.get_output_embeddings().weight.shape[0] == 300
    tokenizer = AutoTokenizer.from_pretrained(export)
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    for text in ("def add(a, b):", "The river", '{"name": '):
        ids = tokenizer(text, return_tensors="pt")
        alone = target.generate(**ids, do_sample=False, max_new_tokens=24, pad_token_id=0)
        assisted = target.generate(**ids, do_sample=False, max_new_tokens=24, pad_token_id=0, assistant_model=draft)
        assert assisted.tolist() == alone.tolist()
    assert "logged W&B model artifact" in proc.stderr


def test_accumulation_gives_the_same_training_as_a_bigger_batch(tmp_path, generated, tiny_target_dir):
    a_dir, a = prepared(tmp_path, generated, "accum", tiny_target_dir, batch_size=2, grad_accum=2)
    b_dir, b = prepared(tmp_path, generated, "batch", tiny_target_dir, batch_size=4, grad_accum=1)
    for recipe in (a, b):
        proc = run_train(recipe)
        assert proc.returncode == 0, proc.stderr[-3000:]
    la, lb = steps_logged(a_dir), steps_logged(b_dir)
    assert [r["train/tokens"] for r in la] == [r["train/tokens"] for r in lb]
    for ra, rb in zip(la, lb, strict=True):
        assert ra["train/loss"] == pytest.approx(rb["train/loss"], rel=1e-5)
    assert_weights_close(weights(a_dir, 6), weights(b_dir, 6))


def test_distill_seed_repeats_the_training_run_alone(tmp_path, generated, tiny_target_dir):
    """distill.seed defaults to the recipe's seed; another value trains differently on the same generated data."""
    runs = {}
    for name, kw in {"default": {}, "same": {"seed": 1}, "other": {"seed": 2}}.items():  # the recipe's seed is 1
        runs[name], recipe = prepared(tmp_path, generated, name, tiny_target_dir, **kw)
        proc = run_train(recipe)
        assert proc.returncode == 0, proc.stderr[-3000:]
    losses = {name: [row["train/loss"] for row in steps_logged(run)] for name, run in runs.items()}
    assert losses["same"] == losses["default"] != losses["other"]
    assert_weights_close(weights(runs["same"], 6), weights(runs["default"], 6), atol=0)
    default, other = weights(runs["default"], 6), weights(runs["other"], 6)
    assert any(not torch.equal(default[key], other[key]) for key in default)


def test_two_ddp_processes_match_one_process(tmp_path, generated, tiny_target_dir):
    one_dir, one = prepared(tmp_path, generated, "one", tiny_target_dir, batch_size=2, grad_accum=2)
    two_dir, two = prepared(tmp_path, generated, "two", tiny_target_dir, batch_size=1, grad_accum=2)
    assert run_train(one).returncode == 0
    launcher = ("-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes/accelerate/ddp.yaml"),
                "--num_processes", "2", "--main_process_port", str(free_port()))
    proc = run_train(two, launcher=launcher, env={"ACCELERATE_USE_CPU": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 x 2 accumulation x 2 processes" in proc.stderr  # 2 processes really ran, as one group
    state = json.loads((two_dir / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["processes"] == 2 and (two_dir / "checkpoint-6" / "state" / "random_states_1.pkl").is_file()
    for r1, r2 in zip(steps_logged(one_dir), steps_logged(two_dir), strict=True):
        assert r1["train/loss"] == pytest.approx(r2["train/loss"], rel=1e-5)
    # Without a gradient all-reduce, rank 0 would train on half the batch: weights off by ~lr, far above this.
    assert_weights_close(weights(one_dir, 6), weights(two_dir, 6))
    # The same run resumed from its mid checkpoint by one process gives the same end (global batch kept).
    shutil.rmtree(two_dir / "checkpoint-6")
    (two_dir / "distill" / "done.json").unlink()
    resumed = run_train(write_recipe(tmp_path, tiny_target_dir, two_dir, stages=("distill",), batch_size=2, grad_accum=2),
                        "--overwrite")  # the recipe's batch split changed; the global batch did not
    assert resumed.returncode == 0 and "resuming from" in resumed.stderr
    assert_weights_close(weights(one_dir, 6), weights(two_dir, 6))


def test_resume_after_sigkill_ends_with_the_uninterrupted_weights(tmp_path, generated, tiny_target_dir):
    kw = dict(max_steps=8, checkpoint_every=2)
    whole_dir, whole = prepared(tmp_path, generated, "whole", tiny_target_dir, **kw)
    assert run_train(whole).returncode == 0
    run_dir, recipe = prepared(tmp_path, generated, "killed", tiny_target_dir, **kw)
    proc = subprocess.Popen([sys.executable, "-m", "train", str(recipe)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while time.time() < deadline and not (run_dir / "checkpoint-4").is_dir():
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "checkpoint-8").exists(), "the kill should land mid-run"
    resumed = run_train(recipe)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    assert [r["step"] for r in steps_logged(run_dir)] == list(range(1, 9))
    for r1, r2 in zip(steps_logged(whole_dir), steps_logged(run_dir), strict=True):
        assert r1["train/loss"] == pytest.approx(r2["train/loss"], rel=1e-5)
    assert_weights_close(weights(whole_dir, 8), weights(run_dir, 8))
    again = run_train(recipe)
    assert again.returncode == 0 and "already finished" in again.stderr


def test_cached_signal_and_on_policy_runs(tmp_path, generated, tiny_target_dir, tiny_draft_dir):
    """The cached signal is what the loop learns from: the same run with another target (other weights, same
    tokenizer; the draft loaded from disk, so it does not start from the target's layers) trains identically,
    while with the online signal the target's weights change the loss."""
    from eval.models import load_tokenizer

    other = tmp_path / "other-target"
    make_model(len(load_tokenizer(str(tiny_target_dir))), layers=2, seed=9).save_pretrained(other)
    load_tokenizer(str(tiny_target_dir)).save_pretrained(other)
    logs = {}
    for signal_, target in (("cached", tiny_target_dir), ("cached", other), ("online", tiny_target_dir), ("online", other)):
        run_dir, recipe = prepared(tmp_path, generated, f"{signal_}-{target.name}", target, target_signal=signal_,
                                   max_steps=2, checkpoint_every=2)
        data = json.loads(recipe.read_text())
        recipe.write_text(json.dumps({**data, "draft": {"init": "pretrained", "model": str(tiny_draft_dir)}}))
        proc = run_train(recipe)
        assert proc.returncode == 0, proc.stderr[-3000:]
        logs[signal_, target.name] = [r["train/loss"] for r in steps_logged(run_dir)]
    assert logs["cached", other.name] == logs["cached", tiny_target_dir.name]
    assert logs["online", other.name] != logs["online", tiny_target_dir.name]
    policy_dir, policy = prepared(tmp_path, generated, "policy", tiny_target_dir, on_policy_lambda=1.0, max_steps=2,
                                  checkpoint_every=2)
    proc = run_train(policy)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = steps_logged(policy_dir)
    assert all(r["train/on_policy"] == 1.0 and "train/sequence_ce" not in r for r in log)


def test_cached_target_rows_are_distributions_with_the_stored_top_k():
    from train.batches import Example, collate
    from train.target_signal import target_rows

    vocab, k = 50, 4
    batch = collate([Example(ids=[5, 6, 7, 8, 9], start=2, row=0), Example(ids=[1, 2, 3, 4], start=3, row=1)], pad_id=0)
    ids = [[[1, 2, 3, 4], [4, 3, 2, 1], [9, 8, 7, 6]], [[7, 6, 5, 4]]]
    lp = [torch.log_softmax(torch.randn(n, 10), -1).topk(k, dim=-1).values.tolist() for n in (3, 1)]
    assert batch.first == 1 and batch.positions.sum() == 4  # positions 1..3 of the first example, 2 of the second
    signal = target_rows("cached", target=None, batch=batch, device="cpu", cached=(ids, lp))
    out = signal.rows(0, 4, vocab, None)[0]  # (4, V), example by example, position by position
    assert signal.vocab is None and out.shape == (4, vocab)
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(4))
    for j, (r, i) in enumerate([(0, 0), (0, 1), (0, 2), (1, 0)]):
        torch.testing.assert_close(out[j, ids[r][i]], torch.tensor(lp[r][i]))
    torch.testing.assert_close(signal.rows(1, 3, vocab, None)[0], out[1:3])  # a chunk is the same rows


@pytest.mark.parametrize("signal,on_policy", [("online", False), ("cached", False), ("cached", True)])
@pytest.mark.parametrize("losses", [{"forward_kl": 1.0, "sequence_ce": 0.5}, {"reverse_kl": 1.0}, {"jsd": 0.7, "tvd": 1.0}])
@pytest.mark.parametrize("freeze_head", [False, True])
@pytest.mark.parametrize("restricted", [False, True], ids=["full-vocab", "draft-vocab"])
def test_fused_head_losses_equal_the_plain_path(signal, on_policy, losses, freeze_head, restricted, monkeypatch):
    """loss_chunk_size > 0 runs the draft's head inside the loss, chunk by chunk: same loss terms and the
    same gradients for every draft parameter as the plain path (full logits); the draft's vocabulary is
    padded past the target's, as Qwen2.5's are. Also with a reduced draft vocabulary (every other token)."""
    from conftest import make_model
    from train import losses as L
    from train.batches import Example, collate
    from train.distill import batch_losses
    from train.draft_vocab import DraftVocab
    from train.recipe import parse_recipe

    fused_calls = []
    real = L.fused_head_loss
    monkeypatch.setattr(L, "fused_head_loss", lambda *a, **k: fused_calls.append(1) or real(*a, **k))
    V = 40
    target = make_model(V, layers=2, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    examples = [Example(ids=torch.randint(3, V, (n,), generator=g).tolist(), start=s, row=i)
                for i, (n, s) in enumerate([(11, 3), (8, 5), (13, 2)])]
    batch = collate(examples, pad_id=0)
    topk_ids = [torch.randint(0, V, (n - s, 5), generator=g).tolist() for n, s in [(11, 3), (8, 5), (13, 2)]]
    topk_lp = [torch.randn(n - s, 5, generator=g).log_softmax(-1).tolist() for n, s in [(11, 3), (8, 5), (13, 2)]]

    def run(chunk):
        draft = make_model(V + 8, layers=1, seed=5).train()  # 8 padding rows past the target's vocabulary
        draft.get_output_embeddings().weight.requires_grad_(not freeze_head)
        recipe = parse_recipe({"distill": {"losses": losses, "loss_chunk_size": chunk, "target_signal": signal,
                                           "temperature": 1.3}})
        restrict = DraftVocab.of(list(range(0, V, 2)), V, "cpu") if restricted else None
        terms = batch_losses(recipe, draft, target, batch, torch.device("cpu"), on_policy, cached=(topk_ids, topk_lp),
                             restrict=restrict)
        sum(terms.values()).backward()
        return ({k: v.item() for k, v in terms.items()},
                {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})

    plain_terms, plain_grads = run(0)
    assert not fused_calls
    fused_terms, fused_grads = run(4)
    assert fused_calls
    assert fused_terms.keys() == plain_terms.keys() and plain_terms
    for name in plain_terms:
        assert fused_terms[name] == pytest.approx(plain_terms[name], rel=1e-4, abs=1e-5)
    assert fused_grads.keys() == plain_grads.keys()
    assert ("lm_head.weight" in fused_grads or "model.embed_tokens.weight" in fused_grads) != freeze_head
    for name in plain_grads:
        torch.testing.assert_close(fused_grads[name], plain_grads[name], atol=1e-5, rtol=1e-4)


def test_losses_over_a_draft_vocabulary_are_the_restricted_distributions():
    """With a reduced draft vocabulary both sides are renormalised over its tokens, and a label outside it is
    no sequence_ce target; the cached top-k rows are the full rows' columns."""
    from conftest import make_model
    from train.batches import Example, collate
    from train.distill import batch_losses
    from train.draft_vocab import DraftVocab
    from train.target_signal import topk_to_logprobs
    from train.recipe import parse_recipe

    V = 30
    ids = [0, 2, 5, 7, 11, 13, 17, 19, 23, 29]
    restrict = DraftVocab.of(ids, V, "cpu")
    g = torch.Generator().manual_seed(1)
    top_ids = torch.randint(0, V, (6, 4), generator=g)
    top_lp = torch.randn(6, 4, generator=g).log_softmax(-1) - 0.5
    torch.testing.assert_close(topk_to_logprobs(top_ids, top_lp, V, restrict), topk_to_logprobs(top_ids, top_lp, V)[:, ids])

    target, draft = make_model(V, layers=1, seed=0).eval(), make_model(V, layers=1, seed=4).eval()
    batch = collate([Example(ids=[3, 4, 5, 7, 9, 2, 11, 13], start=3, row=0)], pad_id=0)
    recipe = parse_recipe({"distill": {"losses": {"forward_kl": 1.0, "sequence_ce": 1.0}, "target_signal": "online"}})
    with torch.no_grad():
        terms = batch_losses(recipe, draft, target, batch, torch.device("cpu"), restrict=restrict)
        x = batch.input_ids
        q = draft(x).logits[0, 2:-1][:, ids].log_softmax(-1)  # positions 2..6 predict tokens 7, 9, 2, 11, 13
        p = target(x).logits[0, 2:-1][:, ids].log_softmax(-1)
    assert terms["forward_kl"].item() == pytest.approx((p.exp() * (p - q)).sum().item(), rel=1e-5)
    inside = [(row, ids.index(t)) for row, t in enumerate([7, 9, 2, 11, 13]) if t in ids]  # 9 is outside
    assert len(inside) == 4
    assert terms["sequence_ce"].item() == pytest.approx(-sum(q[r, c].item() for r, c in inside), rel=1e-5)


def test_draft_vocabulary_keeps_the_most_probable_tokens_and_eos():
    from eval.draft_vocab import build_draft_vocab

    rows = [[[5, 6], [5, 7]], [[8, 5]]]
    lps = [[[-0.1, -2.5], [-0.2, -3.0]], [[-0.5, -1.0]]]  # mass: 5 > 8 > 6 > 7
    assert build_draft_vocab(rows, lps, 3, vocab=20, always=[19]) == [5, 8, 19]
    assert build_draft_vocab(rows, lps, 6, vocab=20) == [0, 1, 5, 6, 7, 8]  # filled with the lowest unused ids
    assert build_draft_vocab(rows, lps, 50, vocab=20) == list(range(20))


def test_data_order_covers_every_example_once_per_epoch():
    from train.batches import step_indices

    seen = [i for s in range(5) for i in step_indices(10, s, 4, seed=0)]  # 20 = two epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert step_indices(10, 3, 4, seed=0) == step_indices(10, 3, 4, seed=0)
    assert step_indices(10, 0, 4, seed=0) != step_indices(10, 0, 4, seed=1)


def test_grouped_data_order_batches_alike_lengths_and_covers_every_example_once_per_epoch():
    from train.batches import GROUP_SPAN, step_indices

    n, batch = 1003, 8  # not a multiple of the batch: steps straddle epochs
    lengths = tuple(int(x) for x in torch.randint(20, 200, (n,), generator=torch.Generator().manual_seed(0)))
    steps = 3 * n // batch
    grouped = [step_indices(n, s, batch, seed=0, lengths=lengths) for s in range(steps)]
    plain = [step_indices(n, s, batch, seed=0) for s in range(steps)]
    flat = [i for step in grouped for i in step]
    for epoch in range(2):
        assert sorted(flat[epoch * n:(epoch + 1) * n]) == list(range(n))

    def spread(step):  # the padding a step's longest example costs the others
        return max(lengths[i] for i in step) - min(lengths[i] for i in step)

    whole = [spread(step) for step in grouped]
    # Every whole step of an epoch is one length group (a span of GROUP_SPAN steps sorted: about 180 / 50 wide);
    # only the steps that straddle two epochs mix, as without grouping.
    straddling = {s for s in range(steps) if (s * batch) // n != ((s + 1) * batch - 1) // n}
    assert max(w for s, w in enumerate(whole) if s not in straddling) <= 4 * 180 / GROUP_SPAN
    assert sum(whole) < 0.2 * sum(spread(step) for step in plain)
    assert grouped == [step_indices(n, s, batch, seed=0, lengths=lengths) for s in range(steps)]  # resumable
    assert grouped[:GROUP_SPAN] != [step_indices(n, s, batch, seed=1, lengths=lengths) for s in range(GROUP_SPAN)]
    # Long and short steps are shuffled over the epoch, not cycled from short to long within each span.
    firsts = [sum(lengths[i] for i in step) for step in grouped[:GROUP_SPAN]]
    assert firsts != sorted(firsts)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_two_processes_match_one_process(stage, tmp_path, generated, tiny_target_dir, tiny_draft_dir):
    """ZeRO-2 and ZeRO-3 (target partitioned too) with 2 CPU processes against one plain process.

    The draft is loaded from disk: ZeRO-3 initialises fresh weights partitioned, with other random draws.
    """
    draft = {"init": "pretrained", "model": str(tiny_draft_dir)}
    one_dir, one = prepared(tmp_path, generated, "one", tiny_target_dir, batch_size=2, grad_accum=2)
    two_dir, two = prepared(tmp_path, generated, "two", tiny_target_dir, batch_size=1, grad_accum=2)
    for path in (one, two):
        recipe = json.loads(path.read_text())
        path.write_text(json.dumps({**recipe, "draft": draft}))
    assert run_train(one).returncode == 0
    launcher = ("-m", "accelerate.commands.launch", "--config_file", str(ROOT / f"recipes/accelerate/zero{stage}.yaml"),
                "--num_processes", "2", "--main_process_port", str(free_port()))
    proc = run_train(two, launcher=launcher, env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 x 2 accumulation x 2 processes" in proc.stderr and f"DeepSpeed ZeRO-{stage}" in proc.stderr
    assert (two_dir / "checkpoint-6" / "state" / "random_states_1.pkl").is_file()
    for r1, r2 in zip(steps_logged(one_dir), steps_logged(two_dir), strict=True):
        assert r1["train/loss"] == pytest.approx(r2["train/loss"], rel=1e-5)
    # ZeRO reduce-scatters the gradients in another order; on the Intel Xeon CI machine one embedding entry in
    # 9,600 landed 4e-5 away after 6 Adam steps. A missing sync or a wrong normalisation is ~lr (3e-3) away.
    assert_weights_close(weights(one_dir, 6), weights(two_dir, 6), atol=1e-4)


def test_a_checkpoint_is_measured_without_the_training_autocast():
    """The eval hook's copy of a draft trained in bf16 mixed precision runs as served: no autocast, and through
    packed float32 linears (which refuse the bf16 inputs autocast would give them)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from eval.packed import packed_linears
    from train.models import served_copy

    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        draft = accelerator.unwrap_model(accelerator.prepare(make_model(vocab_size=64)))
    finally:
        AcceleratorState._reset_state(True)
    seen = []
    draft.model.layers[0].register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        draft(ids)
        served = served_copy(draft, torch.float32)
        with packed_linears(served):
            logits = served(ids).logits
        draft(ids)
    assert seen == [True, False, True]  # the training model keeps its autocast; the served copy has none
    assert logits.dtype == torch.float32 and not served.training
    torch.testing.assert_close(logits, served(ids).logits, rtol=1e-4, atol=1e-4)
