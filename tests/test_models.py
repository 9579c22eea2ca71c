"""Model loading and draft initialisation on tiny models; the embedded default target when it is cached."""

from __future__ import annotations

import json

import pytest
import torch

import eval.models as loading
import train.models as models
from conftest import make_model, make_tokenizer
from eval.errors import UserError
from eval.models import check_same_tokenizer, load_model, load_tokenizer, resolve_model_path
from train.models import draft_from_config, draft_from_layers
from train.recipe import DEFAULT_TARGET, parse_recipe


def test_load_local_directory(tiny_target_dir):
    model = load_model(str(tiny_target_dir), device="cpu")
    tok = load_tokenizer(str(tiny_target_dir))
    assert model.config.num_hidden_layers == 2 and not model.training
    assert len(tok) == model.config.vocab_size


def test_hub_id_passes_through_and_paths_are_checked(tmp_path):
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    with pytest.raises(UserError, match="not found"):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(UserError, match="not found"):
        resolve_model_path("./relative/missing")
    with pytest.raises(UserError, match="model file .* not found"):
        resolve_model_path(str(tmp_path / "x.gguf"))


def test_unreachable_hub_id_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="cannot load model 'some-org/some-model'"):
        load_tokenizer("some-org/some-model")


def test_pickle_weights_are_refused(tmp_path, tiny_tokenizer):
    model = make_model(len(tiny_tokenizer))
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    model.config.save_pretrained(tmp_path)
    with pytest.raises(UserError, match="cannot load model"):
        load_model(str(tmp_path), device="cpu")


def test_remote_code_is_refused_unless_enabled(tmp_path):
    config = {"model_type": "specdistill-custom-arch", "auto_map": {"AutoConfig": "custom.CustomConfig",
              "AutoModelForCausalLM": "custom.CustomModel"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "custom.py").write_text("raise RuntimeError('remote code must not run')\n")
    with pytest.raises(UserError, match="trust_remote_code: true"):
        load_model(str(tmp_path), device="cpu")


def test_layers_draft_copies_the_chosen_layers(tiny_target_dir):
    target = load_model(str(tiny_target_dir), device="cpu")
    same = draft_from_layers(target, [0, 1])
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    torch.testing.assert_close(same(ids).logits, target(ids).logits)
    last = draft_from_layers(target, [-1])
    assert last.config.num_hidden_layers == 1
    for (name, p), (tname, tp) in zip(last.model.layers[0].named_parameters(), target.model.layers[1].named_parameters()):
        assert torch.equal(p, tp), name
    assert torch.equal(last.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(last.model.norm.weight, target.model.norm.weight)
    with pytest.raises(UserError, match="index 5 is out of range for a target with 2 layers"):
        draft_from_layers(target, [5])


def test_layers_draft_saves_as_a_normal_model(tiny_target_dir, tmp_path):
    target = load_model(str(tiny_target_dir), device="cpu")
    draft = draft_from_layers(target, [1])
    draft.save_pretrained(tmp_path)
    again = load_model(str(tmp_path), device="cpu")
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(again(ids).logits, draft(ids).logits)


def test_config_draft_has_fresh_weights_of_the_given_size(tiny_target_dir):
    target = load_model(str(tiny_target_dir), device="cpu")
    draft = draft_from_config(target, {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}, seed=0)
    assert draft.config.hidden_size == 32 and draft.config.num_hidden_layers == 1
    assert draft.config.vocab_size == target.config.vocab_size
    draft(torch.tensor([[1, 2, 3]]))
    with pytest.raises(UserError, match="draft.config.not_a_field"):
        draft_from_config(target, {"not_a_field": 1}, seed=0)


def test_tokenizer_mismatch_is_refused_naming_both(tiny_tokenizer):
    other = make_tokenizer(vocab_size=280)
    with pytest.raises(UserError, match="draft 'D' has a .*-token vocabulary but target 'T' has"):
        check_same_tokenizer(tiny_tokenizer, other, "T", "D")
    shuffled = make_tokenizer(vocab_size=len(tiny_tokenizer), extra="zzzz qqqq zzzz qqqq xyxyxy")
    if len(shuffled) == len(tiny_tokenizer):
        with pytest.raises(UserError, match="map token .* to different ids"):
            check_same_tokenizer(tiny_tokenizer, shuffled, "T", "D")
    check_same_tokenizer(tiny_tokenizer, tiny_tokenizer, "T", "D")


def test_pretrained_draft_with_other_tokenizer_is_refused(tmp_path, tiny_target_dir):
    other = make_tokenizer(vocab_size=280)
    make_model(len(other), layers=1).save_pretrained(tmp_path)
    other.save_pretrained(tmp_path)
    recipe = parse_recipe({"name": "x", "target": {"model": str(tiny_target_dir)},
                           "draft": {"init": "pretrained", "model": str(tmp_path)}})
    target = load_model(str(tiny_target_dir), device="cpu")
    with pytest.raises(UserError, match=f"draft '{tmp_path}' has a 280-token vocabulary but target '{tiny_target_dir}'"):
        models.build_draft(recipe, target, load_tokenizer(str(tiny_target_dir)))


# ---------------------------------------------------------------------------- the embedded default target

needs_default = pytest.mark.skipif(not loading._is_converted(loading.cache_dir() / "models" / DEFAULT_TARGET),
                                   reason="default target not fetched (scripts/setup.sh fetches it)")


@pytest.mark.default_target
@needs_default
def test_default_target_loads_from_cache_without_fetching(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the default target was fetched again")

    monkeypatch.setattr(loading.subprocess, "run", no_network)
    monkeypatch.setattr(loading, "convert_gguf", no_network)
    tok = load_tokenizer(DEFAULT_TARGET)
    model = load_model(DEFAULT_TARGET, device="cpu")
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152 == len(tok)
    assert model.dtype == torch.float32
    assert not hasattr(model.config, "quantization_config")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    assert "4" in tok.decode(out[0, ids["input_ids"].shape[1]:])


@pytest.mark.default_target
@needs_default
def test_default_target_layers_draft():
    target = load_model(DEFAULT_TARGET, device="cpu")
    recipe = parse_recipe({"name": "x", "draft": {"init": "layers", "layers": [0, 1, -1]}})
    draft, name = models.build_draft(recipe, target, load_tokenizer(DEFAULT_TARGET))
    assert draft.config.num_hidden_layers == 3 and "layers 0,1,-1" in name


def test_cast_weights_keeps_the_rotary_frequencies_as_from_pretrained_does(tmp_path):
    from conftest import make_model
    from transformers import AutoModelForCausalLM

    from train.models import cast_weights

    model = make_model(64, layers=1)
    model.save_pretrained(tmp_path)
    cast = cast_weights(make_model(64, layers=1), torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in cast.parameters())
    assert cast.model.rotary_emb.inv_freq.dtype == torch.float32
    x = torch.tensor([[1, 5, 9, 30, 31, 40, 41, 50]])
    with torch.no_grad():
        torch.testing.assert_close(cast(x).logits, loaded(x).logits, atol=0, rtol=0)
