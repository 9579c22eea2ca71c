"""Linear layers through oneDNN with weights packed once, for decoding on a CPU: `with packed_linears(model): ...`

On a CPU, PyTorch's float32 `F.linear` calls MKL's sgemm, which lays the weight out again on every call.
A decode step multiplies only a few rows, so that re-layout is most of the work, and it grows with
the row count: SmolLM2-135M takes 40 ms for one token and 55-80 ms to verify 2-9 tokens at once, which
is most of what speculative decoding hopes to save. oneDNN's inner product with the weight packed
ahead of time reads each weight once per pass: 24 ms for one token and 25-30 ms for 2-9
(`python scripts/bench_decoder.py` prints both). The result is the same product in float32 (bf16 for a
bf16 model), summed in another order.

Inside the context every `nn.Linear` of the model on the CPU calls the packed weight; the parameters,
state dict and tied weights are untouched, and leaving the context restores the plain forward. Only for
inference: the packed copy does not follow later changes to the weights, and it has no gradient.
`Product` is the same packed product without a module, for the lean decode steps (eval/lean.py).
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F


def packing_supported(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def weights_version(model) -> int:
    """Changes whenever a parameter or buffer of `model` is modified in place (its tensors' version counters): a
    packed copy made at another version is stale. Tensors made under `torch.inference_mode` keep no counter and count 0."""
    return sum(0 if t.is_inference() else t._version for t in (*model.parameters(), *model.buffers()))


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` (out, in) laid out once for oneDNN's inner product; None where oneDNN cannot take it here."""
    if weight.device.type != "cpu" or not packing_supported(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


class Product:
    """x @ weight.T + bias with the weight packed once where it can be (`pack`), else `F.linear`: a linear layer's
    product without the module, for decode steps written out (eval/lean.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()
        self.packed = pack(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return _packed_product(x, self.packed, self.bias)


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    return _packed_product(x, self._packed_weight, self.bias)


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, enabled: bool = True):
    """Route the model's CPU `nn.Linear` layers through pre-packed oneDNN weights while the block runs."""
    packed = []
    if enabled:
        for module in model.modules():
            if not isinstance(module, torch.nn.Linear) or hasattr(module, "_packed_weight"):  # not packed by an outer block
                continue
            weight = pack(module.weight)
            if weight is not None:  # on the CPU, in a dtype oneDNN packs
                module._packed_weight = weight
                module.forward = types.MethodType(_packed_forward, module)
                packed.append(module)
    try:
        yield model
    finally:
        for module in packed:
            del module.forward, module._packed_weight
