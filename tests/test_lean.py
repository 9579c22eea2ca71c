"""Lean decode steps (eval/lean.py) on tiny Llama and Qwen2 models: the same logits as transformers' forward
after appends, rollbacks and growth, the same decodes, and a clear refusal of what they do not serve."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model, trained_draft
from eval.draft_vocab import restricted_head
from eval.lean import LeanBatch, LeanLM, eager_lm, lean_unsupported, lean_weights
from eval.packed import packed_linears, packing_supported
from eval.settings import EvalSettings, FieldError
from eval.speculative import CachedLM, Sampling, speculative_decode, vanilla_decode

V = 64
IDS = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 40, 41, 12]
PROMPTS = [[5, 9, 17, 3], [40, 41, 12, 7, 7, 30, 22], [11]]


def make_qwen2(seed: int = 0):
    """A tiny Qwen2: biases on q, k and v, which the lean steps must add."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=2)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(8.0) if p.dim() == 2 else p.normal_(0, 0.5) if name.endswith("bias") else None
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return make_model(V, layers=2, seed=0) if request.param == "llama" else make_qwen2()


@torch.no_grad()
def test_lean_logits_equal_a_full_pass_after_rollbacks_and_growth(model):
    full = model(torch.tensor([IDS])).logits[0]  # (T, V)
    lm = LeanLM(model, V, capacity=4)  # grows (twice) while the pieces arrive
    assert (lm.lean.head.packed is not None) == packing_supported(torch.float32)  # its own products, packed where they can be
    pieces = [lm.forward(IDS[:5], keep=5), lm.forward(IDS[5:6], keep=1), lm.forward(IDS[6:], keep=7)]
    torch.testing.assert_close(torch.cat(pieces), full, atol=1e-4, rtol=1e-4)
    assert lm.capacity >= len(IDS)
    lm.crop(7)  # roll back and recompute the same positions over the stale entries
    torch.testing.assert_close(lm.forward(IDS[7:], keep=2), full[-2:], atol=1e-4, rtol=1e-4)
    lm.crop(2)
    torch.testing.assert_close(lm.forward(IDS[2:4], keep=1), full[3:4], atol=1e-4, rtol=1e-4)
    lm.reset()
    assert lm.length == 0
    torch.testing.assert_close(lm.forward(IDS[:3], keep=3), full[:3], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_lean_products_follow_changed_weights_at_the_next_request():
    model = make_model(V, layers=1, seed=4)
    lm = LeanLM(model, V)
    before = lm.forward(IDS[:4], keep=1)
    model.model.layers[0].mlp.up_proj.weight.mul_(0.5)  # e.g. a training step between two measurements
    lm.reset()
    after = lm.forward(IDS[:4], keep=1)
    torch.testing.assert_close(after, model(torch.tensor([IDS[:4]])).logits[0, -1:], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(before, after)


@pytest.fixture(scope="module")
def draft():
    return trained_draft(make_model(V, layers=2, seed=0))


@torch.no_grad()
def test_lean_steps_decode_as_transformers_steps_do(model, draft):
    """Vanilla and speculative decodes, greedy and sampled, count the same with lean steps as with transformers'
    (the same numerics in the same order), and greedy speculative output equals vanilla output."""
    for sampling in (Sampling(0.0), Sampling(1.0)):
        for prompt in PROMPTS:
            runs = []
            for wrap in (lambda m: m, lambda m: LeanLM(m, V)):
                g = torch.Generator().manual_seed(7)
                vanilla = vanilla_decode(wrap(model), prompt, max_new_tokens=24, sampling=sampling, generator=g, vocab_size=V)
                g = torch.Generator().manual_seed(7)
                spec = speculative_decode(wrap(model), wrap(draft), prompt, k=3, max_new_tokens=24, sampling=sampling,
                                          generator=g, vocab_size=V, confidence=0.3)
                runs.append((vanilla.output_ids, spec.output_ids, spec.rounds, spec.total_accepted, spec.beta_sum))
                if sampling.greedy:
                    assert spec.output_ids == vanilla.output_ids
            assert runs[0][:4] == runs[1][:4]
            assert runs[0][4] == pytest.approx(runs[1][4], abs=1e-5)


@torch.no_grad()
def test_lean_draft_with_a_reduced_head_is_exact(draft):
    """A lean draft behind `restricted_head` (its head swapped for the chosen rows) and a lean target: greedy
    speculative output equals vanilla output, and the draft proposes only the chosen tokens."""
    target = make_model(V, layers=2, seed=0)
    written = {t for prompt in PROMPTS for t in vanilla_decode(target, prompt, max_new_tokens=30).output_ids}
    ids = sorted(written | set(range(0, V, 4)))  # the tokens the target writes, and some others
    sub = torch.tensor(ids)
    outside = torch.tensor([t for t in range(V) if t not in ids])
    with restricted_head(draft, ids), packed_linears(draft), packed_linears(target):
        target_lm, draft_lm = LeanLM(target, V), LeanLM(draft, V, sub)
        q = draft_lm.forward(PROMPTS[1], keep=1)[0]
        assert len(outside) and torch.isinf(q[outside]).all() and torch.isfinite(q[sub]).all()
        accepted = 0
        for prompt in PROMPTS:
            out = speculative_decode(target_lm, draft_lm, prompt, k=4, max_new_tokens=30, vocab_size=V, draft_vocab=sub)
            assert out.output_ids == vanilla_decode(target_lm, prompt, max_new_tokens=30, vocab_size=V).output_ids
            accepted += out.total_accepted
        assert accepted > 0  # the draft was used, not only the target


@torch.no_grad()
def test_lean_batch_equals_transformers_with_left_padding_and_rows_leaving(model):
    """The generate stage's batched lean steps (`LeanBatch`): each row's logits are its own unpadded pass's, and
    equal the transformers steps' (`TransformersBatch`) at every step, also after rows leave the batch."""
    from train.completions import TransformersBatch, batch_steps, left_padded

    prompts = PROMPTS + [[8, 8]]
    ids, attention = left_padded(prompts, pad=0)
    positions = (attention.cumsum(-1) - 1).clamp_min(0)
    lean, ours = batch_steps(model, attention, positions, 6, "lean"), TransformersBatch(model, attention, positions)
    assert isinstance(lean, LeanBatch) and isinstance(batch_steps(model, attention, positions, 6, "transformers"),
                                                      TransformersBatch)
    rows, feed, written = torch.arange(len(prompts)), ids, [list(p) for p in prompts]
    for step in range(6):
        logits, reference = lean(feed), ours(feed)
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
        alone = torch.stack([model(torch.tensor([written[r]])).logits[0, -1] for r in rows.tolist()])
        torch.testing.assert_close(logits, alone, atol=1e-4, rtol=1e-4)
        chosen = reference.argmax(-1)
        if step in (1, 3):  # a row leaves (as at EOS): the others go on with their own cache rows
            kept = torch.tensor([i for i in range(len(rows)) if i != step % len(rows)])
            lean.select(kept), ours.select(kept)
            rows, chosen = rows[kept], chosen[kept]
        for r, token in zip(rows.tolist(), chosen.tolist()):
            written[r].append(token)
        feed = chosen[:, None]


@torch.no_grad()
def test_lean_weights_are_built_once_per_model_and_weights():
    model = make_model(V, layers=1, seed=5)
    first = lean_weights(model)
    assert lean_weights(model) is first and LeanLM(model, V).lean is first  # shared by every batch and request
    model.model.layers[0].self_attn.o_proj.weight.mul_(2.0)
    assert lean_weights(model) is not first


def test_what_lean_steps_do_not_serve_keeps_transformers_forward():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert "not gpt2" in lean_unsupported(gpt2)
    assert eager_lm(gpt2, V, None, "lean") is gpt2
    gelu = make_model(V, layers=1, hidden_act="gelu")
    assert "SiLU" in lean_unsupported(gelu)
    dynamic = make_model(V, layers=1, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert "dynamic" in lean_unsupported(dynamic)
    llama = make_model(V, layers=1)
    assert lean_unsupported(llama) is None and isinstance(eager_lm(llama, V, None, "lean"), LeanLM)
    assert eager_lm(llama, V, None, "transformers") is llama
    assert type(CachedLM(llama, V)) is CachedLM


def test_eager_steps_setting_is_checked():
    assert EvalSettings().eager_steps == "lean"
    assert EvalSettings(eager_steps="transformers").to_dict()["eager_steps"] == "transformers"
    with pytest.raises(FieldError, match="eager_steps"):
        EvalSettings(eager_steps="fast")
