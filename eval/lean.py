"""Lean decode steps (`eval.eager_steps: lean`, `generate.steps: lean`): a Llama-family model's forward pass written
out over a KV cache of plain tensors, as gpt-fast writes its model, for the eager decoder on a CPU (`LeanLM`, one
request) and for the generate stage's batches (`LeanBatch`, left-padded rows written together).

A transformers forward pass does Python and small-tensor work besides the matrix products in every layer (a
cache object's update, masks, rotary tables, keyword plumbing, output dataclasses), and it multiplies by seven
weights a layer, one call each. `LeanLM` runs the same maths and nothing else: q, k and v are one product of
their stacked weights, gate and up another (the same bytes read in fewer, larger calls), every product packed
for oneDNN once (eval/packed.py), the rotary table computed once, the cache a key and a value tensor per layer
that grows by doubling, and a rollback a shorter length (the stale entries are overwritten before any query
can read them). `python scripts/bench_decoder.py --modes packed,lean` times both against each other; docs/eval.md
has the measurements (on the 2-core development CPU a four-layer SmolLM2 draft token and a target token each
took a fifth to a third less). `python scripts/bench_generate.py --steps lean,transformers` times the batched
steps (docs/data.md: greedy answering 0.97-1.17 times as fast, writing requests no faster).

Only models laid out exactly as transformers' Llama (Llama, Qwen2 with its q/k/v biases) run here, on a CPU:
`lean_unsupported` says why another does not, and that one keeps transformers' forward. On a GPU the eager
decoder stays transformers' too; the compiled steps (eval/compiled.py) are what a GPU runs. Exactness does not
depend on this: vanilla and speculative decoding run the same steps (tests/test_lean.py checks logits against
transformers', the decoder's greedy equality and that decodes count the same with either steps).
"""

from __future__ import annotations

import weakref
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


def runs_lean(model, steps: str) -> bool:
    """Whether `model` runs lean steps under a steps setting (`eval.eager_steps`, `generate.steps`): asked for and served."""
    return steps == "lean" and lean_unsupported(model) is None


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


class LeanWeights:
    """A model's lean forward pass: its products, built once (`lean_weights`), and the maths that uses them.

    The weights of q, k and v are stacked into one product and gate and up into one (fewer, larger products read
    the same bytes in fewer calls), each packed for oneDNN once where the CPU allows. Like any packed copy they do
    not follow the model's weights: `lean_weights` builds them again after the weights or the head changed."""

    def __init__(self, model):
        config, attention = model.config, model.model.layers[0].self_attn
        self.head_dim, self.scaling = attention.head_dim, attention.scaling
        self.split = [config.num_attention_heads * self.head_dim] + [config.num_key_value_heads * self.head_dim] * 2
        self.kv_heads, self.rotary_emb = config.num_key_value_heads, model.model.rotary_emb
        inner = model.model
        self.layers = [LayerWeights(_stacked(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                                    Product(layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias),
                                    _stacked(layer.mlp.gate_proj, layer.mlp.up_proj),
                                    Product(layer.mlp.down_proj.weight, layer.mlp.down_proj.bias),
                                    layer.input_layernorm, layer.post_attention_layernorm) for layer in inner.layers]
        head = model.get_output_embeddings()
        self.head, self.embed, self.norm = Product(head.weight, head.bias), inner.embed_tokens.weight, inner.norm
        self.built_for = _state(model)

    def new_cache(self, rows: int, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zeroed keys and values, one (rows, kv_heads, capacity, D) tensor of each a layer."""
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        return ([self.embed.new_zeros(shape) for _ in self.layers], [self.embed.new_zeros(shape) for _ in self.layers])

    def rotary(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary table (cos, sin) of positions 0 .. capacity - 1, each (capacity, D) in the weights' dtype."""
        positions = torch.arange(capacity, device=self.embed.device)[None]
        cos, sin = self.rotary_emb(self.embed[:1], positions)
        return cos[0], sin[0]

    def forward(self, ids: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], start: int,
                cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, keep: int) -> torch.Tensor:
        """`ids` (rows, n) written at cache positions start .. start + n - 1 of `keys` and `values` and attended
        under `mask` (None: every cached key; else broadcastable to (rows, heads, n, start + n)), rotated by `cos`
        and `sin` (broadcastable to (rows, heads, n, D)): the head's logits of the last `keep` positions, (rows, keep, V)."""
        rows, n = ids.shape
        end = start + n
        x = F.embedding(ids, self.embed)  # (rows, n, hidden)
        for w, layer_keys, layer_values in zip(self.layers, keys, values):
            q, k, v = (t.view(rows, n, -1, self.head_dim).transpose(1, 2)
                       for t in w.qkv(rms_norm(x, w.input_norm)).split(self.split, -1))
            layer_keys[:, :, start:end] = rotate(k, cos, sin)  # (rows, kv_heads, n, D)
            layer_values[:, :, start:end] = v
            q, keys_seen, values_seen = rotate(q, cos, sin), layer_keys[:, :, :end], layer_values[:, :, :end]
            if n == 1:  # the heads that share a key-value head are its query rows, as transformers does: no repeated keys
                o = F.scaled_dot_product_attention(q.reshape(rows, self.kv_heads, -1, self.head_dim), keys_seen, values_seen,
                                                   attn_mask=mask, scale=self.scaling).view(rows, -1, 1, self.head_dim)
            else:
                o = F.scaled_dot_product_attention(q, keys_seen, values_seen, attn_mask=mask, scale=self.scaling,
                                                   enable_gqa=True)  # (rows, heads, n, D)
            x = x + w.o(o.transpose(1, 2).reshape(rows, n, -1))
            gate, up = w.gate_up(rms_norm(x, w.post_norm)).chunk(2, -1)
            x = x + w.down(F.silu(gate) * up)
        return self.head(rms_norm(x[:, -keep:], self.norm))


def _state(model):
    return weights_version(model), model.get_output_embeddings()


_built: "weakref.WeakKeyDictionary[torch.nn.Module, LeanWeights]" = weakref.WeakKeyDictionary()


def lean_weights(model) -> LeanWeights:
    """`model`'s `LeanWeights`, built on first use and again whenever its weights or its head changed since."""
    built = _built.get(model)
    state = _state(model)
    if built is None or built.built_for[0] != state[0] or built.built_for[1] is not state[1]:
        built = _built[model] = LeanWeights(model)
    return built


class LeanLM(CachedLM):
    """`CachedLM` of a Llama-family model on a CPU (`lean_unsupported(model)` is None) with lean steps: one
    request's cache, a key and a value tensor a layer that grow by doubling, over the model's `lean_weights`
    (taken again at every request, `reset`, so a request after the weights or the head changed uses new ones)."""

    def __init__(self, model, vocab_size: int, token_ids: torch.Tensor | None = None, capacity: int = 256):
        self.lean = lean_weights(model)
        self.capacity, self.first_capacity = 0, capacity
        super().__init__(model, vocab_size, token_ids)  # allocates the cache (`new_cache`)

    def new_cache(self):
        self.keys, self.values, self.cos, self.sin = [], [], None, None
        self.capacity = 0
        self._grow(self.first_capacity)

    def reset(self) -> None:
        self.length = 0  # the same tensors serve every request
        self.lean = lean_weights(self.model)

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def _grow(self, needed: int) -> None:
        """Room for `needed` positions: the cache doubles (its filled part copied over) and the rotary table follows."""
        capacity = max(needed, 2 * self.capacity)
        keys, values = self.lean.new_cache(1, capacity)
        for old, new in zip((self.keys, self.values), (keys, values)):
            for i, tensor in enumerate(old):
                new[i][:, :, : self.capacity] = tensor
        self.keys, self.values = keys, values
        (self.cos, self.sin), self.capacity = self.lean.rotary(capacity), capacity

    def run(self, ids: torch.Tensor, keep: int) -> torch.Tensor:
        """One forward pass over `ids` (1, n) after the cached positions: the last `keep` rows of logits, (keep, V)."""
        n = ids.shape[1]
        start, end = self.length, self.length + n
        if end > self.capacity:
            self._grow(end)
        # A single query sees every cached key; n queries see the keys up to their own position.
        mask = None if n == 1 else (torch.arange(end, device=ids.device) <= torch.arange(start, end, device=ids.device)[:, None])
        logits = self.lean.forward(ids, self.keys, self.values, start, self.cos[start:end], self.sin[start:end], mask, keep)
        return self.place(logits[0])


class LeanBatch:
    """Rows of one left-padded batch decoded together with lean steps: how the generate stage's target writes
    (train/completions.py, `generate.steps: lean`). Each call feeds every row's next tokens and returns the logits
    of their last position; `select` keeps only some rows (the others wrote EOS), and their cache with them.

    `attention` (rows, width): 1 for a prompt token, 0 for left padding; `positions` (rows, width): each token's
    position in its own row. The cache holds width + `max_new_tokens` positions, allocated once."""

    def __init__(self, model, attention: torch.Tensor, positions: torch.Tensor, max_new_tokens: int):
        self.lean = lean_weights(model)
        rows, width = attention.shape
        capacity = width + max_new_tokens
        self.keys, self.values = self.lean.new_cache(rows, capacity)
        self.cos, self.sin = self.lean.rotary(capacity)
        # Which cache positions each row may attend to: its prompt tokens, then every token it writes.
        self.visible = torch.cat([attention.bool(), attention.new_ones((rows, max_new_tokens), dtype=torch.bool)], -1)
        self.positions, self.length = positions, 0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed `ids` (rows, n) at `positions`: the logits of each row's last position, (rows, V)."""
        n = ids.shape[1]
        start, end = self.length, self.length + n
        mask = self.visible[:, None, None, :end]  # (rows, 1, 1, end)
        if n > 1:  # causal, and every query sees itself, so a padding query never attends to nothing
            columns, queries = torch.arange(end, device=ids.device), torch.arange(start, end, device=ids.device)[:, None]
            mask = (mask & (columns <= queries)) | (columns == queries)
        cos, sin = self.cos[self.positions][:, None], self.sin[self.positions][:, None]  # (rows, 1, n, D)
        logits = self.lean.forward(ids, self.keys, self.values, start, cos, sin, mask, keep=1)
        self.length, self.positions = end, self.positions[:, -1:] + 1
        return logits[:, -1]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the current rows, in order)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.visible, self.positions = self.visible[rows], self.positions[rows]


def eager_lm(model, vocab_size: int, token_ids: torch.Tensor | None, steps: str):
    """`model`'s eager decoder for `eval.eager_steps`: a `LeanLM` where `steps` is lean and the model allows it,
    else the model itself (decoded with transformers' forward, a fresh `CachedLM` a request)."""
    if runs_lean(model, steps):
        return LeanLM(model, vocab_size, token_ids)
    return model
