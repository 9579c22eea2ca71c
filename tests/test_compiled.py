"""The compiled decoder (eval/compiled.py) on the CPU with tiny models: a static KV cache rolled back by position,
compiled steps, and the same outputs and statistics as eager decoding."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from conftest import StubDraft, make_model, trained_draft
from eval.compiled import StaticLM, compile_supported, forget_compiled, prepare_decoders, static_lm
from eval.lean import LeanLM
from eval.speculative import Sampling, speculative_decode, vanilla_decode

V = 64
PROMPTS = [[5, 9, 17, 3], [40, 41, 12, 7, 7, 30, 22], [11]]
MAX_LENGTH = 64

pytestmark = pytest.mark.skipif(compile_supported(torch.device("cpu")) is not None, reason="torch.compile cannot run here")


def static(model, compiled=True, **kwargs):
    return StaticLM(model, V, max_length=MAX_LENGTH, max_verify=6, compiled=compiled, **kwargs)


@pytest.fixture(scope="module")
def models():
    target = make_model(V, layers=2, seed=0)
    drafts = {"self": make_model(V, layers=2, seed=0), "random": make_model(V, layers=1, hidden=32, seed=7),
              "trained": trained_draft(target)}
    return target, drafts


@pytest.fixture(scope="module")
def lms(models):
    """Compiled LMs, built once: every test reuses them, each request resets them."""
    target, drafts = models
    return static(target), {name: static(draft) for name, draft in drafts.items()}


def test_static_cache_logits_equal_a_full_pass_after_rollbacks(models):
    target, _ = models
    ids = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]
    full = target(torch.tensor([ids])).logits[0]  # (T, V)
    for compiled in (False, True):
        lm = static(target, compiled=compiled)
        pieces = [lm.forward(ids[:4], keep=4), lm.forward(ids[4:5], keep=1), lm.forward(ids[5:], keep=5)]
        torch.testing.assert_close(torch.cat(pieces), full, atol=1e-4, rtol=1e-4)
        lm.crop(6)  # roll back and recompute the same positions over the stale entries
        torch.testing.assert_close(lm.forward(ids[6:], keep=4), full[6:], atol=1e-4, rtol=1e-4)
        lm.crop(2)
        torch.testing.assert_close(lm.forward(ids[2:4], keep=1), full[3:4], atol=1e-4, rtol=1e-4)  # two one-token steps
        lm.reset()
        assert lm.length == 0
        torch.testing.assert_close(lm.forward(ids[:3], keep=3), full[:3], atol=1e-4, rtol=1e-4)
        with pytest.raises(ValueError, match="static cache"):
            lm.forward([1] * MAX_LENGTH, keep=1)


@pytest.mark.parametrize("which", ["self", "random", "trained"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_compiled_greedy_speculative_equals_vanilla(models, lms, which, k):
    target, _ = models
    target_lm, draft_lms = lms
    for prompt in PROMPTS:
        eager = vanilla_decode(target, prompt, max_new_tokens=40)
        vanilla = vanilla_decode(target_lm, prompt, max_new_tokens=40)
        spec = speculative_decode(target_lm, draft_lms[which], prompt, k=k, max_new_tokens=40)
        assert vanilla.output_ids == eager.output_ids
        assert spec.output_ids == vanilla.output_ids and spec.tokens_generated == 40


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_and_eager_decoding_count_the_same(models, lms, temperature):
    """Same seed, same draws: every per-round statistic (slots, position buckets, beta) matches eager decoding."""
    target, drafts = models
    target_lm, draft_lms = lms
    sampling = Sampling(temperature)
    for prompt in PROMPTS:
        args = dict(k=4, max_new_tokens=30, sampling=sampling, confidence=0.3)
        eager = speculative_decode(target, drafts["trained"], prompt, generator=torch.Generator().manual_seed(3), **args)
        compiled = speculative_decode(target_lm, draft_lms["trained"], prompt, generator=torch.Generator().manual_seed(3), **args)
        assert compiled.output_ids == eager.output_ids
        for key in ("rounds", "total_drafted", "total_accepted", "verified", "slot_reached", "slot_accepted", "slot_rounds",
                    "bucket_count"):
            assert getattr(compiled, key) == getattr(eager, key), key
        assert compiled.beta_sum == pytest.approx(eager.beta_sum, abs=1e-4)


def test_compiled_fallback_guardrail_and_restricted_head(models, lms):
    from eval.draft_vocab import restricted_head

    target, drafts = models
    target_lm, _ = lms
    vanilla = vanilla_decode(target_lm, PROMPTS[0], max_new_tokens=40)
    never = next(t for t in range(V) if t not in vanilla.output_ids)
    stub = static(StubDraft(target, never))
    spec = speculative_decode(target_lm, stub, PROMPTS[0], k=3, max_new_tokens=40, fallback_window=10, fallback_threshold=0.4)
    assert spec.fallback_triggered and spec.fallback_at == 10 and spec.output_ids == vanilla.output_ids

    ids = list(range(0, V, 2))
    sub = torch.tensor(ids)
    draft = drafts["trained"]
    with restricted_head(draft, ids):
        lm = static(draft, token_ids=sub)
        for prompt in PROMPTS:
            out = speculative_decode(target_lm, lm, prompt, k=3, max_new_tokens=30)
            assert out.output_ids == vanilla_decode(target, prompt, max_new_tokens=30).output_ids
        row = lm.forward([3, 4, 5], keep=1)[0]
    assert torch.isinf(row).sum() == V - len(ids)


def test_one_lm_cannot_be_both_target_and_draft(lms):
    target_lm, _ = lms
    with pytest.raises(ValueError, match="cache each"):
        speculative_decode(target_lm, target_lm, PROMPTS[0], k=2, max_new_tokens=4)


def test_prepare_decoders_modes(models):
    target, drafts = models
    kwargs = dict(vocab_size=V, draft_vocab=None, probe_ids=PROMPTS[1], max_length=40, k=3)
    off = prepare_decoders(target, drafts["random"], "off", **kwargs)
    assert not off.compiled and off.mode == "eager" and (off.target_steps, off.draft_steps) == ("lean", "lean")
    assert isinstance(off.target, LeanLM) and off.target.model is target and off.to_dict()["draft_steps"] == "lean"
    own = prepare_decoders(target, drafts["random"], "off", eager_steps="transformers", **kwargs)
    assert own.target is target and own.draft is drafts["random"] and own.target_steps == "transformers"
    on = prepare_decoders(target, drafts["random"], "on", **kwargs)
    assert on.compiled and isinstance(on.target, StaticLM) and on.compile_seconds > 0 and on.mode == "compiled"
    again = prepare_decoders(target, drafts["random"], "on", **kwargs)
    assert again.target is on.target  # compiled once per process
    draft_only = prepare_decoders(target, drafts["trained"], "draft", **kwargs)
    assert isinstance(draft_only.target, LeanLM) and isinstance(draft_only.draft, StaticLM) and draft_only.mode == "compiled draft"
    assert (draft_only.target_steps, draft_only.draft_steps) == ("lean", "compiled")
    assert not draft_only.target_compiled and draft_only.draft_compiled and draft_only.compile_seconds > 0
    auto = prepare_decoders(target, drafts["random"], "auto", **kwargs)
    assert set(auto.costs) == {"eager", "compiled"} and "auto:" in auto.note

    def target_ms(costs):  # the mean target pass over 1..k+1 tokens
        return sum(costs["t_target_ms"].values()) / len(costs["t_target_ms"])

    # Each model is kept in the mode that measured cheaper for it.
    eager, compiled = auto.costs["eager"], auto.costs["compiled"]
    assert auto.target_compiled == (target_ms(compiled) < target_ms(eager)) == isinstance(auto.target, StaticLM)
    assert auto.draft_compiled == (compiled["t_draft_ms"] < eager["t_draft_ms"]) == isinstance(auto.draft, StaticLM)
    assert auto.mode in auto.note
    # A later checkpoint's draft: the decision stands for this target, nothing is measured again.
    later = prepare_decoders(target, drafts["trained"], "auto", **kwargs)
    assert (later.target_compiled, later.draft_compiled) == (auto.target_compiled, auto.draft_compiled)
    assert later.costs == {} and later.note == auto.note
    assert isinstance(later.draft, StaticLM) == auto.draft_compiled and later.draft_steps == ("compiled" if auto.draft_compiled else "lean")
    with pytest.raises(ValueError, match="compile must be one of"):
        prepare_decoders(target, drafts["random"], "yes", **kwargs)


def test_a_compiled_draft_beside_an_eager_target_is_exact(models):
    """`eval.compile: draft`: the draft's compiled steps with the target eager; greedy output equals vanilla
    decoding of the eager target."""
    target, drafts = models
    kwargs = dict(vocab_size=V, probe_ids=PROMPTS[1], max_length=MAX_LENGTH - 12, k=4)
    decoders = prepare_decoders(target, drafts["trained"], "draft", draft_vocab=None, **kwargs)
    with decoders.running(target, drafts["trained"]):
        for prompt in PROMPTS:
            vanilla = vanilla_decode(decoders.target, prompt, max_new_tokens=30, vocab_size=V)
            out = speculative_decode(decoders.target, decoders.draft, prompt, k=4, max_new_tokens=30, vocab_size=V)
            assert out.output_ids == vanilla.output_ids == vanilla_decode(target, prompt, max_new_tokens=30).output_ids
            assert out.rounds < 30  # the draft was used, not only the target


def test_costs_are_measured_with_one_model_compiled(models, lms):
    """auto keeps each model the way it measured cheaper, so the eval may time a compiled target beside an eager
    draft with a reduced head (as a Xeon with AMX decided for the default pair), or the reverse."""
    from eval.draft_vocab import restricted_head
    from eval.metrics import measure_costs

    target, drafts = models
    target_lm, draft_lms = lms
    ids = list(range(0, V, 2))
    with restricted_head(drafts["trained"], ids):
        mixed = measure_costs(target_lm, drafts["trained"], PROMPTS[1], k_max=3, repeats=1, draft_vocab=torch.tensor(ids))
    reverse = measure_costs(target, draft_lms["trained"], PROMPTS[1], k_max=3, repeats=1)
    for costs in (mixed, reverse):
        assert costs.t_draft > 0 and sorted(costs.t_target) == [1, 2, 3, 4] and min(costs.t_target.values()) > 0


def test_autos_decision_is_remembered_for_later_processes(models, monkeypatch):
    """auto's decision is written to disk under a key of processor, torch and model shapes; a later process (here:
    the per-process decisions cleared) takes it without measuring, and compiles nothing when it was eager."""
    import eval.compiled as compiled

    target, drafts = models
    kwargs = dict(vocab_size=V, draft_vocab=None, probe_ids=PROMPTS[1], max_length=40, k=3)
    target = make_model(V, layers=2, seed=5)  # a target no other test has decided for
    first = prepare_decoders(target, drafts["random"], "auto", **kwargs)
    key = compiled.decision_key(target, drafts["random"], None, 8)
    assert "family" in key or "threads" in key
    saved = json.loads(compiled.decisions_path().read_text())
    assert (saved[key]["target"], saved[key]["draft"]) == (first.target_compiled, first.draft_compiled)
    assert saved[key]["note"] == first.note
    compiled._AUTO.clear()  # a new process
    later = prepare_decoders(target, drafts["trained"], "auto", **kwargs)
    assert (later.target_compiled, later.draft_compiled) == (first.target_compiled, first.draft_compiled)
    assert later.costs == {} and "remembered in" in later.note
    saved[key] |= {"target": False, "draft": True}
    compiled.decisions_path().write_text(json.dumps(saved))
    compiled._AUTO.clear()
    mixed = prepare_decoders(target, drafts["trained"], "auto", **kwargs)
    assert isinstance(mixed.target, LeanLM) and isinstance(mixed.draft, StaticLM) and mixed.costs == {}
    saved[key] |= {"target": False, "draft": False}
    compiled.decisions_path().write_text(json.dumps(saved))
    compiled._AUTO.clear()
    eager = prepare_decoders(target, drafts["trained"], "auto", **kwargs)
    assert not eager.compiled and eager.compile_seconds == 0
    assert (eager.target.model, eager.draft.model) == (target, drafts["trained"]) and eager.draft_steps == "lean"
    # One decision for both models, as auto took before it decided per model: measured again.
    saved[key] = {"compiled": False, "note": "eager", "decided": "earlier"}
    compiled.decisions_path().write_text(json.dumps(saved))
    compiled._AUTO.clear()
    again = prepare_decoders(target, drafts["trained"], "auto", **kwargs)
    assert set(again.costs) == {"eager", "compiled"}
    # Another draft shape is another key: measured afresh.
    compiled._AUTO.clear()
    other = prepare_decoders(target, drafts["self"], "auto", **kwargs)
    assert set(other.costs) == {"eager", "compiled"}
    monkeypatch.setenv("SPECDISTILL_AUTO_DECISIONS", "")
    assert compiled.decisions_path() is None


def test_the_target_stays_compiled_and_an_old_draft_is_released(models):
    """Evaluating checkpoint after checkpoint: the target's StaticLM is reused, and a draft two models back is
    dropped with its cache rather than kept for the whole process."""
    target, _ = models
    sizes = dict(max_length=MAX_LENGTH, max_verify=4)
    target_lm = static_lm(target, V, None, **sizes)
    old = make_model(V, layers=1, hidden=32, seed=11)
    old_lm = weakref.ref(static_lm(old, V, None, **sizes))
    for seed in (12, 13):  # two later checkpoints' drafts, each after the target, as prepare_decoders asks
        assert static_lm(target, V, None, **sizes) is target_lm
        static_lm(make_model(V, layers=1, hidden=32, seed=seed), V, None, **sizes)
    del old
    gc.collect()
    assert old_lm() is None
    assert static_lm(target, V, None, **sizes) is target_lm


def test_forget_compiled_builds_every_model_afresh():
    """A benchmark comparing inductor settings forgets what was compiled: no later mode is served by it."""
    model = make_model(V, layers=1, hidden=32, seed=14)
    sizes = dict(max_length=MAX_LENGTH, max_verify=4)
    lm = static_lm(model, V, None, **sizes)
    assert static_lm(model, V, None, **sizes) is lm
    forget_compiled()
    assert static_lm(model, V, None, **sizes) is not lm


def test_frozen_steps_are_rebuilt_when_the_weights_change():
    """Frozen compiled steps (inductor's freezing, freeze=True) fold the weights in: a model changed in place
    gets new steps, since the old ones would go on computing with the old weights."""
    model = make_model(V, layers=1, hidden=32, seed=21)
    sizes = dict(max_length=MAX_LENGTH, max_verify=4)
    ids = PROMPTS[1]

    @torch.no_grad()  # as decoding runs: inductor freezes inference graphs only
    def last_three(lm):  # the prefix eagerly, then the last three tokens through the compiled verify step
        lm.reset()
        lm.forward(ids[:-3], keep=1)
        return lm.forward(ids[-3:], keep=3)

    lm = static_lm(model, V, None, **sizes, freeze=True)
    assert lm.frozen and static_lm(model, V, None, **sizes, freeze=True) is lm
    last_three(lm)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
        expected = model(torch.tensor([ids])).logits[0, -3:]
    assert not torch.allclose(last_three(lm), expected, atol=1e-3)  # the old steps compute with the old weights
    new = static_lm(model, V, None, **sizes, freeze=True)
    assert new is not lm and new.frozen
    torch.testing.assert_close(last_three(new), expected, atol=1e-4, rtol=1e-4)
    unfrozen = static_lm(model, V, None, **sizes, freeze=False)
    assert not unfrozen.frozen and unfrozen is not new


def test_eval_command_with_compile_on(tmp_path, tiny_target_dir, tiny_draft_dir, capsys):
    from eval.__main__ import main as eval_main

    out = tmp_path / "out"
    eval_main(["--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir), "--num-prompts", "2", "--k", "3",
               "--temperatures", "0,1", "--max-new-tokens", "12", "--out", str(out), "--quiet", "--no-plots", "--compile", "on"])
    assert "decoder: compiled (eval.compile=on, compiling took" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["decoder"]["mode"] == "compiled" and report["decoder"]["compile_seconds"] > 0
    assert report["greedy_identical_to_vanilla"] == 1.0 and set(report["costs"]["t_target_ms"]) >= {"1", "4", "9"}
