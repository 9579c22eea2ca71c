"""Lean decode steps (`eval.eager_steps: lean`): a Llama-family model's forward pass written out over a KV cache of
plain tensors, as gpt-fast writes its model, for the eager decoder on a CPU.

A transformers forward pass does Python and small-tensor work besides the matrix products in every layer (a
cache object's update, masks, rotary tables, keyword plumbing, output dataclasses), and it multiplies by seven
weights a layer, one call each. `LeanLM` runs the same maths and nothing else: q, k and v are one product of
their stacked weights, gate and up another (the same bytes read in fewer, larger calls), every product packed
for oneDNN once (eval/packed.py), the rotary table computed once, the cache a key and a value tensor per layer
that grows by doubling, and a rollback a shorter length (the stale entries are overwritten before any query
can read them). `python scripts/bench_decoder.py --modes packed,lean` times both against each other; docs/eval.md
has the measurements (on the 2-core development CPU a four-layer SmolLM2 draft token and a target token each
took a fifth to a third less).

Only models laid out exactly as transformers' Llama (Llama, Qwen2 with its q/k/v biases) run here, on a CPU:
`lean_unsupported` says why another does not, and that one keeps transformers' forward. On a GPU the eager
decoder stays transformers' too; the compiled steps (eval/compiled.py) are what a GPU runs. Exactness does not
depend on this: vanilla and speculative decoding run the same steps (tests/test_lean.py checks logits against
transformers', the decoder's greedy equality and that decodes count the same with either steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eval.packed import Product, weights_version
from eval.speculative import CachedLM

MODEL_TYPES = ("llama", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")
"""Rotary embeddings whose frequencies do not depend on the sequence length, so one table serves every position."""


def lean_unsupported(model) -> str | None:
    """Why `model` cannot run lean steps (None: it can)."""
    config = model.config
    if config.model_type not in MODEL_TYPES:
        return f"lean steps serve {', '.join(MODEL_TYPES)} models, not {config.model_type}"
    if config.hidden_act != "silu":
        return f"lean steps compute SiLU MLPs, not {config.hidden_act}"
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type not in ROPE_TYPES:
        return f"lean steps precompute rotary tables, which {rope_type} rotary embeddings do not allow"
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "lean steps compute full attention, not sliding windows"
    devices = {p.device for p in model.parameters()}
    if devices != {torch.device("cpu")}:
        return "lean steps serve a model on the CPU"
    return None


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalised in float32, scaled in the input's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, transformers' convention (halves rotated): x (1, heads, n, D), cos/sin (n, D)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


@dataclass
class LayerWeights:
    """One layer's products: q, k and v in one (their weights stacked), o, gate and up in one, down."""

    qkv: Product
    o: Product
    gate_up: Product
    down: Product
    input_norm: torch.nn.Module
    post_norm: torch.nn.Module


def _stacked(*modules) -> Product:
    """One product for several linear layers that read the same input: their weights (and biases) stacked."""
    biases = [m.bias for m in modules]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else m.weight.new_zeros(m.out_features) for m, b in zip(modules, biases)])
    return Product(torch.cat([m.weight for m in modules]), bias)


class LeanLM(CachedLM):
    """`CachedLM` of a Llama-family model on a CPU (`lean_unsupported(model)` is None) with lean steps.

    Its products are its own: the weights of q, k and v stacked into one product, and gate and up into one (fewer,
    larger products read the same bytes in fewer calls), each packed for oneDNN once where the CPU allows. Like
    any packed copy they do not follow the model's weights, so a request (`reset`) after the weights or the head
    changed builds them again."""

    def __init__(self, model, vocab_size: int, token_ids: torch.Tensor | None = None, capacity: int = 256):
        config, attention = model.config, model.model.layers[0].self_attn
        self.head_dim, self.scaling = attention.head_dim, attention.scaling
        self.split = [config.num_attention_heads * self.head_dim] + [config.num_key_value_heads * self.head_dim] * 2
        self.capacity, self.first_capacity = 0, capacity
        super().__init__(model, vocab_size, token_ids)  # allocates the cache (`new_cache`)
        self._build()

    def _state(self):
        return weights_version(self.model), self.model.get_output_embeddings()

    def _build(self) -> None:
        inner = self.model.model
        self.weights = [LayerWeights(_stacked(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                                     Product(layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias),
                                     _stacked(layer.mlp.gate_proj, layer.mlp.up_proj),
                                     Product(layer.mlp.down_proj.weight, layer.mlp.down_proj.bias),
                                     layer.input_layernorm, layer.post_attention_layernorm) for layer in inner.layers]
        head = self.model.get_output_embeddings()
        self.head, self.embed, self.norm = Product(head.weight, head.bias), inner.embed_tokens.weight, inner.norm
        self.built_for = self._state()

    def new_cache(self):
        self.keys, self.values, self.cos, self.sin = [], [], None, None
        self.capacity = 0
        self._grow(self.first_capacity)

    def reset(self) -> None:
        self.length = 0  # the same tensors serve every request
        state = self._state()
        if state[0] != self.built_for[0] or state[1] is not self.built_for[1]:
            self._build()

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def _grow(self, needed: int) -> None:
        """Room for `needed` positions: the cache doubles (its filled part copied over) and the rotary table follows."""
        capacity = max(needed, 2 * self.capacity)
        config, weight = self.model.config, self.model.model.embed_tokens.weight
        shape = (1, config.num_key_value_heads, capacity, self.head_dim)
        for store in (self.keys, self.values):
            for i in range(config.num_hidden_layers):
                new = weight.new_zeros(shape)
                if i < len(store):
                    new[:, :, : self.capacity] = store[i]
                    store[i] = new
                else:
                    store.append(new)
        positions = torch.arange(capacity, device=weight.device)[None]
        cos, sin = self.model.model.rotary_emb(weight[:1], positions)  # (1, capacity, D), in the weights' dtype
        self.cos, self.sin, self.capacity = cos[0], sin[0], capacity

    def run(self, ids: torch.Tensor, keep: int) -> torch.Tensor:
        """One forward pass over `ids` (1, n) after the cached positions: the last `keep` rows of logits, (keep, V)."""
        n = ids.shape[1]
        start, end = self.length, self.length + n
        if end > self.capacity:
            self._grow(end)
        cos, sin = self.cos[start:end], self.sin[start:end]  # (n, D)
        # A single query sees every cached key; n queries see the keys up to their own position.
        mask = None if n == 1 else (torch.arange(end, device=ids.device) <= torch.arange(start, end, device=ids.device)[:, None])
        x = F.embedding(ids, self.embed)  # (1, n, hidden)
        for w, keys, values in zip(self.weights, self.keys, self.values):
            q, k, v = (t.view(1, n, -1, self.head_dim).transpose(1, 2) for t in w.qkv(rms_norm(x, w.input_norm)).split(self.split, -1))
            keys[:, :, start:end] = rotate(k, cos, sin)  # (1, kv_heads, n, D)
            values[:, :, start:end] = v
            o = F.scaled_dot_product_attention(rotate(q, cos, sin), keys[:, :, :end], values[:, :, :end], attn_mask=mask,
                                               scale=self.scaling, enable_gqa=True)  # (1, heads, n, D)
            x = x + w.o(o.transpose(1, 2).reshape(1, n, -1))
            gate, up = w.gate_up(rms_norm(x, w.post_norm)).chunk(2, -1)
            x = x + w.down(F.silu(gate) * up)
        logits = self.head(rms_norm(x[:, -keep:], self.norm))  # (1, keep, V_head)
        return self.place(logits[0])


def eager_lm(model, vocab_size: int, token_ids: torch.Tensor | None, steps: str):
    """`model`'s eager decoder for `eval.eager_steps`: a `LeanLM` where `steps` is lean and the model allows it,
    else the model itself (decoded with transformers' forward, a fresh `CachedLM` a request)."""
    if steps == "lean" and lean_unsupported(model) is None:
        return LeanLM(model, vocab_size, token_ids)
    return model
