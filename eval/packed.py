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
"""

from __future__ import annotations

import contextlib
import types

import torch


def packing_supported(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight, self.bias, "none", [], "")


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, enabled: bool = True):
    """Route the model's CPU `nn.Linear` layers through pre-packed oneDNN weights while the block runs."""
    packed = []
    if enabled:
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if (isinstance(module, torch.nn.Linear) and weight.device.type == "cpu"
                    and packing_supported(weight.dtype) and not hasattr(module, "_packed_weight")):  # not packed by an outer block
                module._packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
                module.forward = types.MethodType(_packed_forward, module)
                packed.append(module)
    try:
        yield model
    finally:
        for module in packed:
            del module.forward, module._packed_weight
