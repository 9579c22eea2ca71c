"""`python -m eval` end to end on tiny models: report.json, requests.jsonl, plots, and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from eval.__main__ import main as eval_main
from eval.metrics import Costs, expected_tokens, optimal_k, percentile, predicted_speedup

REQUEST_FIELDS = {"request_id", "model_pair", "temperature", "k", "tokens_generated", "rounds", "total_drafted",
                  "total_accepted", "acceptance_rate", "alpha", "tau", "speedup_observed", "speedup_theoretical",
                  "fallback_triggered", "domain", "output_ids", "vanilla_output_ids", "alpha_empirical"}


def test_eval_command_writes_report_requests_and_plots(tmp_path, tiny_target_dir, tiny_draft_dir, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "domain": "code", "prompt": "def add(a, b):"}\n'
                       '{"prompt": "Hello! How can I help you?", "domain": "chat"}\n')
    out = tmp_path / "out"
    eval_main(["--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir), "--prompts", str(prompts),
               "--k", "3", "--temperatures", "0,1", "--max-new-tokens", "12", "--out", str(out), "--quiet",
               "--compile", "off"])
    printed = capsys.readouterr().out
    assert "alpha" in printed and "speedup_obs" in printed and "decoder: eager, lean steps (eval.compile=off)" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["eager_steps"] == "lean"
    assert (report["decoder"]["target_steps"], report["decoder"]["draft_steps"]) == ("lean", "lean")
    assert set(report["by_temperature"]) == {"0.0", "1.0"}
    assert set(report["by_domain"]["0.0"]) == {"code", "chat"}
    assert report["greedy_identical_to_vanilla"] == 1.0
    assert report["costs"]["c"] > 0 and set(report["costs"]["t_target_ms"]) >= {"1", "4", "9"}
    assert "alpha" in report["conventions"] and "speedup_theoretical" in report["conventions"]
    for name in report["plots"].values():
        assert (out / name).stat().st_size > 1000
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 4
    for record in records:
        assert REQUEST_FIELDS <= set(record)
        assert record["tokens_generated"] == len(record["output_ids"])
        if record["temperature"] == 0:
            assert record["output_ids"] == record["vanilla_output_ids"]
    greedy = report["by_temperature"]["0.0"]
    assert greedy["tokens_generated"] == sum(r["tokens_generated"] for r in records if r["temperature"] == 0)
    # Speedup is wall time per token: at T = 1 the two decoders may write different lengths.
    for t, agg in report["by_temperature"].items():
        assert agg["speedup_observed"] == pytest.approx(agg["tokens_per_s_spec"] / agg["tokens_per_s_vanilla"])
    greedy_records = [r for r in records if r["temperature"] == 0]
    assert greedy["speedup_observed"] == pytest.approx(sum(r["wall_time_vanilla"] for r in greedy_records)
                                                       / sum(r["wall_time_spec"] for r in greedy_records))
    assert len(greedy["slot_acceptance_conditional"]) == 3


def run_eval(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        eval_main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return exc.value.code, err.strip().splitlines()[-1]


def test_bad_prompt_file_names_file_and_line(tmp_path, tiny_target_dir, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"prompt": broken}\n')
    code, line = run_eval(["--target", str(tiny_target_dir), "--draft", str(tiny_target_dir), "--prompts", str(prompts)], capsys)
    assert code == 2 and f"prompt file '{prompts}' line 2: not valid JSON" in line
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, line = run_eval(["--target", str(tiny_target_dir), "--draft", str(tiny_target_dir), "--prompts", str(empty)], capsys)
    assert code == 2 and "holds no prompts" in line
    code, line = run_eval(["--target", str(tiny_target_dir), "--draft", str(tiny_target_dir), "--k", "0"], capsys)
    assert code == 2 and "must be >= 1" in line
    code, line = run_eval(["--target", str(tiny_target_dir), "--draft", str(tiny_target_dir), "--temperatures", "0,-1"], capsys)
    assert code == 2 and "temperatures must be >= 0" in line
    code, line = run_eval(["--target", str(tiny_target_dir), "--draft", str(tiny_target_dir), "--draft-confidence", "1"], capsys)
    assert code == 2 and line.endswith("--draft-confidence: must be in [0, 1), got 1.0")


def test_eval_with_a_dynamic_draft_length(tmp_path, tiny_target_dir, tiny_draft_dir, capsys):
    """--draft-confidence: k is a cap, drafted_per_round says how many were drafted, the theory is the best fixed k's,
    and the export writes what transformers needs to draft the same way."""
    from eval.metrics import Costs, predicted_speedup
    from train.export import assistant_settings

    out = tmp_path / "out"
    eval_main(["--target", str(tiny_target_dir), "--draft", str(tiny_target_dir), "--k", "6", "--draft-confidence", "0.9",
               "--temperatures", "0,1", "--max-new-tokens", "24", "--num-prompts", "3", "--out", str(out), "--quiet",
               "--no-plots", "--compile", "off", "--eager-steps", "transformers"])
    printed = capsys.readouterr().out
    assert "k<=6, a round stops after a draft token of q < 0.9" in printed and "eager, transformers steps" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["decoder"]["draft_steps"] == "transformers"
    assert report["settings"]["draft_confidence"] == 0.9 and report["greedy_identical_to_vanilla"] == 1.0
    costs = Costs.from_dict(report["costs"])
    for agg in report["by_temperature"].values():
        # The target as its own draft: every draft is accepted, so a round stops early only where it is unsure.
        assert 1 <= agg["drafted_per_round"] < 6
        assert agg["total_drafted"] == pytest.approx(agg["drafted_per_round"] * agg["rounds"])
        assert agg["speedup_theoretical"] == pytest.approx(predicted_speedup(agg["alpha"], agg["optimal_k"], costs))
    assert assistant_settings(report) == (6, 0.9)
    fixed = {**report, "settings": {**report["settings"], "draft_confidence": 0.0}}
    assert assistant_settings(fixed) == (report["by_temperature"]["0.0"]["optimal_k"], 0.0)


def test_observed_speedup_is_taken_per_token():
    from eval.metrics import per_token_speedup

    assert per_token_speedup(2.0, 100, 1.0, 100) == 2.0
    assert per_token_speedup(2.0, 50, 2.0, 100) == 2.0  # the same wall time, but twice the tokens
    assert per_token_speedup(1.0, 0, 1.0, 10) is None


def test_speed_model_matches_leviathan():
    costs = Costs(t_draft=0.01, t_target={m: 0.1 for m in range(1, 10)})  # c = 0.1, verify cost flat
    alpha, k = 0.8, 4
    leviathan = (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * costs.c + 1))
    assert predicted_speedup(alpha, k, costs) == pytest.approx(leviathan)
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1
    assert optimal_k(0.0, costs) == 1 and optimal_k(0.95, costs) == 8
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 50) is None


def test_alpha_needed_inverts_the_speed_model():
    from eval.metrics import Costs, alpha_needed, optimal_k, predicted_speedup

    costs = Costs(t_draft=0.01, t_target={m: 0.06 + 0.005 * (m - 1) for m in range(1, 10)})
    needed = alpha_needed(1.5, costs)
    k = optimal_k(needed, costs)
    assert predicted_speedup(needed, k, costs) == pytest.approx(1.5, abs=1e-6)
    assert predicted_speedup(needed - 0.01, optimal_k(needed - 0.01, costs), costs) < 1.5
    assert alpha_needed(50.0, costs) is None  # beyond k + 1 tokens per round
    assert Costs.from_dict(costs.to_dict()).t_target == pytest.approx(costs.t_target)


def test_eval_reads_the_drafts_vocabulary_file_and_rejects_a_bad_one(tmp_path, tiny_target_dir, tiny_draft_dir, capsys):
    import shutil

    from eval.draft_vocab import save_draft_vocab

    draft = tmp_path / "draft"
    shutil.copytree(tiny_draft_dir, draft)
    save_draft_vocab(draft, list(range(2, 150)))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    common = ["--target", str(tiny_target_dir), "--prompts", str(prompts), "--temperatures", "0,1", "--max-new-tokens", "10",
              "--quiet", "--no-plots", "--compile", "off"]
    eval_main(common + ["--draft", str(draft), "--out", str(tmp_path / "sub")])
    assert "draft vocabulary: 148 tokens" in capsys.readouterr().out
    report = json.loads((tmp_path / "sub" / "report.json").read_text())
    assert report["draft_vocab_size"] == 148 and report["greedy_identical_to_vanilla"] == 1.0
    # How much of the target's own output the reduced head can propose at all, per temperature.
    records = [json.loads(line) for line in (tmp_path / "sub" / "requests.jsonl").read_text().splitlines()]
    for t, coverage in report["draft_vocab_coverage"].items():
        tokens = [x for r in records if r["temperature"] == float(t) for x in r["vanilla_output_ids"]]
        assert coverage == sum(2 <= x < 150 for x in tokens) / len(tokens)
    assert set(report["draft_vocab_coverage"]) == {"0.0", "1.0"}
    eval_main(common + ["--draft", str(draft), "--full-draft-vocab", "--draft-dtype", "bfloat16", "--out", str(tmp_path / "full")])
    full = json.loads((tmp_path / "full" / "report.json").read_text())
    assert full["draft_vocab_size"] is None and full["draft_vocab_coverage"] is None and full["greedy_identical_to_vanilla"] == 1.0
    save_draft_vocab(draft, [5, 300])  # 300 is past the tiny vocabulary
    code, line = run_eval(common + ["--draft", str(draft)], capsys)
    assert code == 2 and "token id 300 is outside" in line
    (draft / "draft_vocab.json").write_text('{"ids": "all"}')
    code, line = run_eval(common + ["--draft", str(draft)], capsys)
    assert code == 2 and "draft_vocab.json" in line and "--full-draft-vocab" in line


def test_a_second_checkpoint_reuses_the_targets_vanilla_decodes(monkeypatch, tiny_tokenizer):
    """With eval.reuse_vanilla, measuring two drafts against one target decodes each request vanilla once: the
    second report carries the first one's vanilla tokens and times; a target changed in place, or reuse off
    (the default), is decoded afresh."""
    import eval.report as report_module
    from eval.prompts import builtin_prompts, spread
    from eval.settings import EvalSettings
    from conftest import make_model, trained_draft

    calls = []
    real = report_module.vanilla_decode
    monkeypatch.setattr(report_module, "vanilla_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    target = make_model(len(tiny_tokenizer), layers=2, seed=0)
    prompts = spread(builtin_prompts("held_out"), 3)
    reuse = EvalSettings(k=3, temperatures=[0.0, 1.0], max_new_tokens=10, compile="off", reuse_vanilla=True)

    def measure(draft, settings=reuse):
        calls.clear()
        report = report_module.evaluate_pair(target, draft, tiny_tokenizer, prompts, settings, target_name="t", draft_name="d",
                                             progress=False, plots=False)
        return report, len(calls)

    first, decoded = measure(make_model(len(tiny_tokenizer), layers=1, hidden=32, seed=1))
    assert decoded == 6 and first["vanilla_reused"] == 0
    second, decoded = measure(trained_draft(target, steps=5))
    assert decoded == 0 and second["vanilla_reused"] == 6
    assert second["greedy_identical_to_vanilla"] == 1.0
    for t in ("0.0", "1.0"):
        assert second["by_temperature"][t]["tokens_per_s_vanilla"] == first["by_temperature"][t]["tokens_per_s_vanilla"]
    _, decoded = measure(trained_draft(target, steps=5), EvalSettings(**{**reuse.to_dict(), "reuse_vanilla": False}))
    assert decoded == 6  # the default: paired, every request decoded vanilla again
    with torch.no_grad():
        target.model.norm.weight.mul_(1.5)
    changed, decoded = measure(trained_draft(target, steps=5))
    assert decoded == 6 and changed["vanilla_reused"] == 0 and changed["greedy_identical_to_vanilla"] == 1.0


def test_compare_pairs_requests_by_prompt_and_temperature(tmp_path, capsys):
    from eval.compare import main as compare_main

    def write(name, alphas):
        rows = [{"request_id": f"p{i}", "temperature": t, "alpha": alpha, "speedup_observed": 1.0 + alpha}
                for (i, t), alpha in alphas.items()]
        (tmp_path / name).mkdir()
        (tmp_path / name / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    a = write("a", {(0, 0.0): 0.2, (1, 0.0): 0.5, (2, 0.0): 0.3, (0, 0.7): 0.1, (3, 0.0): 0.9})
    b = write("b", {(0, 0.0): 0.3, (1, 0.0): 0.7, (2, 0.0): 0.3, (0, 0.7): 0.4})
    compare_main([a, b, "--out", str(tmp_path / "cmp.json")])
    result = json.loads((tmp_path / "cmp.json").read_text())
    assert (result["requests_paired"], result["only_a"], result["only_b"]) == (4, 1, 0)
    greedy = result["by_temperature"]["0.0"]["alpha"]
    # B - A over the three paired greedy prompts: 0.1, 0.2, 0.0 -> mean 0.1, sd 0.1, se 0.1 / sqrt(3).
    assert greedy["a"] == pytest.approx(1 / 3) and greedy["b"] == pytest.approx(1.3 / 3)
    assert greedy["b_minus_a"] == pytest.approx(0.1) and greedy["b_minus_a_se"] == pytest.approx(0.1 / 3 ** 0.5)
    sampled = result["by_temperature"]["0.7"]
    assert sampled["requests"] == 1 and sampled["alpha"]["b_minus_a"] == pytest.approx(0.3)
    assert sampled["alpha"]["b_minus_a_se"] is None
    assert "+0.100 ± 0.058" in capsys.readouterr().out
    c = write("c", {(9, 0.0): 0.5})
    for bad in ([a, c], [a, str(tmp_path / "missing")]):
        with pytest.raises(SystemExit) as exit_:
            compare_main(bad)
        assert exit_.value.code == 2
    assert "share no request" in capsys.readouterr().err


def test_compare_pairs_alpha_by_position_where_both_drafted(tmp_path, capsys):
    from eval.compare import main as compare_main
    from eval.speculative import BUCKET_NAMES

    def write(name, buckets):
        rows = []
        for i, (beta, count) in enumerate(buckets):
            pad = [0.0] * (len(BUCKET_NAMES) - len(beta))
            rows.append({"request_id": f"p{i}", "temperature": 0.0, "alpha": 0.5, "speedup_observed": 1.0,
                         "bucket_beta_sum": beta + pad, "bucket_count": count + [0] * len(pad)})
        (tmp_path / name).mkdir()
        (tmp_path / name / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    # Request p1 drafted nothing past position 99 in A (a fallback): the 100-199 bucket pairs p0 and p2 only.
    a = write("a", [([2.0, 4.0, 5.0, 1.0], [4, 10, 10, 4]), ([1.0, 5.0, 5.0, 0.0], [4, 10, 10, 0]),
                    ([2.0, 4.0, 4.0, 2.0], [4, 10, 10, 4])])
    b = write("b", [([2.0, 5.0, 5.0, 3.0], [4, 10, 10, 4]), ([2.0, 5.0, 6.0, 2.0], [4, 10, 10, 4]),
                    ([2.0, 4.0, 6.0, 3.0], [4, 10, 10, 4])])
    compare_main([a, b, "--by-position", "--out", str(tmp_path / "cmp.json")])
    by_position = json.loads((tmp_path / "cmp.json").read_text())["by_temperature"]["0.0"]["alpha_by_position"]
    assert list(by_position) == list(BUCKET_NAMES[:4])  # buckets no request reached are left out
    late = by_position[BUCKET_NAMES[3]]
    # p0: 0.25 -> 0.75, p2: 0.5 -> 0.75: differences 0.5 and 0.25.
    assert late["requests"] == 2 and late["a"] == pytest.approx(0.375) and late["b"] == pytest.approx(0.75)
    assert late["b_minus_a"] == pytest.approx(0.375) and late["b_minus_a_se"] == pytest.approx(0.125)
    assert by_position[BUCKET_NAMES[2]]["requests"] == 3
    assert by_position[BUCKET_NAMES[2]]["b_minus_a"] == pytest.approx((0.0 + 0.1 + 0.2) / 3)
    out = capsys.readouterr().out
    assert "alpha by position" in out and "+0.375 ± 0.125" in out
