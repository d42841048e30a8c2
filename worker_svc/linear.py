"""Linear layers with oneDNN-prepacked weights for bf16/fp16 on CPU.

F.linear in bf16 reorders the weight into oneDNN's blocked layout on every call; packing once
makes batch-1 decode matmuls about 2x faster (same kernel, bit-identical results). fp32 stays on
F.linear (MKL), which keeps fp32 results identical to transformers'. Quantized weights (int8,
int4) run by PyTorch's weight-only CPU kernels instead (QuantizedLinear, worker_svc/quant.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc.quant import QuantizedWeight, is_quantized

PACKED_DTYPES = (torch.bfloat16, torch.float16)


def packing_available(dtype: torch.dtype) -> bool:
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


class Linear:
    """y = x @ weight.T + bias; weight: [out, in], bias: [out] or None."""

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, pack: bool, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.packed: torch.Tensor | None = None
        if pack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in] -> [tokens, out]."""
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class QuantizedLinear:
    """y = x @ dequantized(weight).T + bias, by the int8 / int4 CPU kernels (worker_svc.quant)."""

    __slots__ = ("weight", "bias")

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in] -> [tokens, out]."""
        y = self.weight.matmul(x.contiguous())
        return y if self.bias is None else y.add_(self.bias)


def make_linear(
    weight: torch.Tensor | QuantizedWeight, pack: bool, bias: torch.Tensor | None = None
) -> Linear | QuantizedLinear:
    if is_quantized(weight):
        return QuantizedLinear(weight, bias)
    return Linear(weight, pack, bias)
