"""Linear layers with oneDNN-prepacked weights for bf16/fp16 on CPU.

F.linear in bf16 reorders the weight into oneDNN's blocked layout on every call; packing once
saves that reorder (same kernel, bit-identical results; the figures: docs/figures.md). fp32 stays on
F.linear (MKL), which keeps fp32 results identical to transformers'. Quantized weights (int8,
int4) run by PyTorch's weight-only CPU kernels instead (QuantizedLinear, worker_svc/quant.py);
one kept also as dense values (--quantization auto) runs the quantized kernel for matmuls of up
to `max_rows` rows (decode: bound by reading the weights) and the dense one above (prefill and
large batches: bound by compute, where oneDNN's bf16 kernels are faster).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc.cpu_features import host_features
from worker_svc.quant import Int4Weight, QuantizedWeight, dense_values, is_quantized

PACKED_DTYPES = (torch.bfloat16, torch.float16)
# The rows oneDNN is told to expect when it lays a weight out. Packed for 1 row, it picks a layout
# whose kernels are slower on AMX at every size and that, from 64 rows on, sums in another order
# than F.linear. Packed for 64 rows the results are F.linear's, bit for bit, at every size
# (the figures: docs/figures.md).
PACK_ROWS = 64


def packing_available(dtype: torch.dtype) -> bool:
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


class Linear:
    """y = x @ weight.T + bias; weight: [out, in], bias: [out] or None."""

    __slots__ = ("weight", "bias", "packed")

    def __init__(
        self,
        weight: torch.Tensor,
        pack: bool,
        bias: torch.Tensor | None = None,
        keep_weight: bool = True,
    ) -> None:
        """keep_weight=False: once packed, the plain weight is let go (None), not held twice."""
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self.packed: torch.Tensor | None = None
        if pack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
            if not keep_weight:
                self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in] -> [tokens, out]."""
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class QuantizedLinear:
    """y = x @ dequantized(weight).T + bias, by the int8 / int4 CPU kernels (worker_svc.quant);
    with a dense form (the same values), x of more than max_rows rows goes to that instead."""

    __slots__ = ("weight", "bias", "dense", "max_rows")

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None = None,
        dense: Linear | None = None,
        max_rows: int = 0,
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.dense = dense
        self.max_rows = max_rows

    def uses_dense(self, rows: int) -> bool:
        return self.dense is not None and rows > self.max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in] -> [tokens, out]."""
        if self.dense is not None and x.shape[0] > self.max_rows:
            return self.dense(x)
        y = self.weight.matmul(x.contiguous())
        return y if self.bias is None else y.add_(self.bias)


def dual_linear(
    weight: QuantizedWeight, pack: bool, bias: torch.Tensor | None, max_rows: int
) -> QuantizedLinear:
    """The quantized kernel up to max_rows rows, the dense values (packed for oneDNN where it
    can: the plain copy let go) above."""
    dense = Linear(dense_values(weight), pack, bias, keep_weight=False)
    return QuantizedLinear(weight, bias, dense, max_rows)


def make_linear(
    weight: torch.Tensor | QuantizedWeight,
    pack: bool,
    bias: torch.Tensor | None = None,
    max_rows: int | None = None,
) -> Linear | QuantizedLinear:
    """max_rows: for a weight kept also dense, the rows up to which the quantized kernel runs
    (None: this CPU's figure for the weight's kernel, worker_svc.cpu_features.QUANTIZED_MAX_ROWS,
    BLOCKED_INT4_MAX_ROWS, AMX_INT4_MAX_ROWS or A8_INT4_MAX_ROWS; where that is None,
    the quantized kernel at every size and no dense copy)."""
    if is_quantized(weight):
        if max_rows is None:
            amx = bool(getattr(weight, "amx_from_rows", 0))
            a8 = isinstance(weight, Int4Weight) and weight.a8
            rows = host_features().int4_max_rows(weight.blocked is not None, amx, a8)
        else:
            rows = max_rows
        if not weight.keep_dense or rows is None:
            drop_handover(weight)
            return QuantizedLinear(weight, bias)
        return dual_linear(weight, pack, bias, rows)
    return Linear(weight, pack, bias)


def drop_handover(weight: QuantizedWeight) -> None:
    """The load's dense values, not kept: not held by the weight either."""
    if isinstance(weight, Int4Weight):
        weight.handover.clear()


def give_dense(lin: QuantizedLinear, pack: bool) -> None:
    """A dense form for a quantized linear whose weight allows one (auto), if it lacks it."""
    if lin.dense is None and lin.weight.keep_dense:
        lin.dense = Linear(dense_values(lin.weight), pack, lin.bias, keep_weight=False)


def dense_bytes(linear: object) -> int:
    """Memory a quantized linear's dense form holds (0 for any other)."""
    if not isinstance(linear, QuantizedLinear) or linear.dense is None:
        return 0
    held = linear.dense.packed if linear.dense.packed is not None else linear.dense.weight
    assert held is not None
    return held.nbytes
