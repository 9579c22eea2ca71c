"""Draft initialisation (layers of the target, a config, or a pretrained model) and the dtypes drafts train and
are served in. Loading models and tokenizers is eval/models.py's."""

from __future__ import annotations

import copy
import re

import torch

from eval.errors import UserError
from eval.models import check_model_vocab, check_same_tokenizer, cpu_flags, load_model, load_tokenizer, resolve_dtype


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (avx512_bf16 or AMX). Without it oneDNN emulates bf16, and a
    training matmul of 512 rows measured 3.5x slower in bf16 than in float32 (2-core Intel Xeon, AVX-512)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def native_bf16(device: torch.device) -> bool:
    """True when `device` multiplies bf16 natively: a GPU that supports it, or such a CPU."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return cpu_has_native_bf16()



# ---------------------------------------------------------------------------- drafts


def draft_from_layers(target, layers: list[int]):
    """A draft of the same architecture made of `layers` of the target plus its embeddings, final norm and head."""
    from transformers import AutoModelForCausalLM

    n = target.config.num_hidden_layers
    for index in layers:
        if not -n <= index < n:
            raise UserError(f"recipe key 'draft.layers': index {index} is out of range for a target with {n} layers")
    keep = [index % n for index in layers]
    if len(set(keep)) != len(keep):
        raise UserError("recipe key 'draft.layers': the same layer is named twice")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(keep)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in keep]
    draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    layer_key = re.compile(r"^(.*\.layers\.)(\d+)(\..*)$")
    state = {}
    for key, tensor in target.state_dict().items():
        match = layer_key.match(key)
        if match is None:
            state[key] = tensor
        elif int(match.group(2)) in keep:
            state[f"{match.group(1)}{keep.index(int(match.group(2)))}{match.group(3)}"] = tensor
    draft.load_state_dict(state, strict=True)
    return draft


def draft_from_config(target, overrides: dict, seed: int):
    """Fresh weights in the target's architecture with `overrides` applied to its config."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise UserError(f"recipe key 'draft.config.{key}': {type(config).__name__} has no such field")
        if key in ("vocab_size",) and value != config.vocab_size:
            raise UserError("recipe key 'draft.config.vocab_size': the draft must keep the target's vocabulary")
        setattr(config, key, value)
    if "hidden_size" in overrides or "num_attention_heads" in overrides:
        if "head_dim" in vars(config) and "head_dim" not in overrides:
            config.head_dim = config.hidden_size // config.num_attention_heads
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[0]] * config.num_hidden_layers
    torch.manual_seed(seed)
    try:
        return AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    except (ValueError, RuntimeError) as err:
        raise UserError(f"recipe key 'draft.config': {str(err).splitlines()[0]}") from None


def build_draft(recipe, target, target_tokenizer, device=None):
    """The draft named by `recipe.draft`, on the target's device; returns (draft, draft_name)."""
    spec = recipe.draft
    if spec.init == "pretrained":
        draft_tok = load_tokenizer(spec.model, trust_remote_code=spec.trust_remote_code, revision=spec.revision)
        check_same_tokenizer(target_tokenizer, draft_tok, recipe.target.model, spec.model)
        draft = load_model(
            spec.model,
            dtype=spec.dtype,
            device=device or target.device,
            trust_remote_code=spec.trust_remote_code,
            revision=spec.revision,
        )
        check_model_vocab(draft, target_tokenizer, spec.model)
        return draft, spec.model
    if spec.init == "layers":
        draft = draft_from_layers(target, spec.layers)
        name = f"{recipe.target.model}[layers {','.join(str(i) for i in spec.layers)}]"
    else:
        draft = draft_from_config(target, spec.config, recipe.train_seed)
        name = f"{recipe.target.model}[config]"
    return cast_weights(draft.to(device or target.device), serving_dtype(recipe, target)).eval(), name


def cast_weights(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model.to(dtype)` for the parameters only, in place: buffers keep their dtype.

    `from_pretrained(dtype=...)` keeps the rotary `inv_freq` in float32; a plain `.to(bfloat16)` would
    round the frequencies too, and the model served in the run would differ from the exported one
    loaded elsewhere (logits by up to 0.25 for four SmolLM2 layers).
    """
    buffers = [(module, name, buf) for module in model.modules() for name, buf in module._buffers.items() if buf is not None]
    model.to(dtype)
    for module, name, buf in buffers:
        module._buffers[name] = buf
    return model


def served_copy(draft: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of the draft being trained, as it will be served: weights in `dtype`, in eval mode, and without
    accelerate's mixed-precision wrapper (autocast around `forward`), which `unwrap_model` keeps and a copy
    inherits. With the wrapper a float32 draft would be measured in bf16, and oneDNN's packed float32
    linears refuse bf16 inputs."""
    from accelerate.utils import extract_model_from_parallel

    served = extract_model_from_parallel(copy.deepcopy(draft), keep_fp32_wrapper=False)
    return cast_weights(served, dtype).eval()


def generation_dtype(setting: str, target) -> torch.dtype:
    """The dtype the target generates training data in (`generate.dtype`)."""
    if setting == "target" or (setting == "auto" and not native_bf16(target.device)):
        return target.dtype
    if setting == "auto":
        return torch.bfloat16
    return resolve_dtype(setting, target.device)


def serving_dtype(recipe, target) -> torch.dtype:
    """The dtype the draft is measured and exported in: `draft.dtype`, or the target's when `auto`."""
    if recipe.draft.dtype == "auto":
        return target.dtype
    return resolve_dtype(recipe.draft.dtype, target.device)
