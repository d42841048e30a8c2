"""--quantization auto keeps a GGUF's 4-bit matrices in both forms and picks one per matmul by
its rows: the int4 kernel for few (decode: bound by reading the weights), the dense bf16 values
for many (prefill, large batches: bound by compute). Both forms compute the same function."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from worker_svc.linear import Linear, QuantizedLinear, dense_bytes, make_linear
from worker_svc.loader import load_model
from worker_svc.memory_profile import weights_bytes
from worker_svc.quant import (
    Int4Weight,
    dense_values,
    fuse_matrices,
    int4_codes,
    pack_int4,
    quantize_int8,
)
from worker_svc.weights import Weights


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture
def auto_weight() -> Int4Weight:
    gen = torch.Generator().manual_seed(11)
    codes = int4_codes(torch.randn(96, 128, generator=gen))
    weight = fuse_matrices([codes, codes], "auto", torch.bfloat16)
    assert isinstance(weight, Int4Weight) and weight.keep_dense
    return weight


def test_explicit_int4_and_int8_keep_only_the_quantized_form():
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(64, 64, generator=gen)
    for weight in (fuse_matrices([w], "int4", torch.bfloat16), quantize_int8(w, torch.bfloat16)):
        lin = make_linear(weight, pack=True)
        assert isinstance(lin, QuantizedLinear) and lin.dense is None
        assert not lin.uses_dense(256) and dense_bytes(lin) == 0


def test_dense_values_are_the_kernels_own():
    gen = torch.Generator().manual_seed(13)
    codes = int4_codes(torch.randn(64, 96, generator=gen))
    weight = pack_int4(codes, torch.bfloat16)
    x = torch.randn(5, 96, generator=gen).bfloat16()
    values = dense_values(weight)
    assert values.shape == (64, 96) and values.dtype == torch.bfloat16
    assert relative_error(values, codes.dequantize()) < 5e-3  # bf16 rounding of the values
    assert relative_error(x @ values.t(), weight.matmul(x)) < 1e-2


@pytest.mark.parametrize("pack", [False, True])
def test_one_row_runs_the_int4_kernel_and_256_the_dense_form(auto_weight, pack):
    gen = torch.Generator().manual_seed(14)
    bias = torch.randn(192, generator=gen).bfloat16()
    lin = make_linear(auto_weight, pack, bias, max_rows=8)
    assert isinstance(lin, QuantizedLinear) and isinstance(lin.dense, Linear)
    one, many = (torch.randn(n, 128, generator=gen).bfloat16() for n in (1, 256))
    assert not lin.uses_dense(1) and lin.uses_dense(256)
    # each call is bit for bit the path it names
    assert torch.equal(lin(one), auto_weight.matmul(one) + bias)
    assert torch.equal(lin(many), lin.dense(many))
    # and both paths are the same function within bf16 rounding
    assert relative_error(lin(one), lin.dense(one)) < 1e-2
    assert relative_error(lin(many), auto_weight.matmul(many) + bias) < 1e-2


def test_the_threshold_is_inclusive_and_the_dense_copy_is_counted(auto_weight):
    lin = make_linear(auto_weight, pack=False, max_rows=16)
    assert [lin.uses_dense(r) for r in (1, 16, 17)] == [False, False, True]
    assert dense_bytes(lin) == 192 * 128 * 2  # one bf16 copy, not two


def test_kv_sizing_counts_the_dense_copy_of_auto():
    config, plain = load_model("tiny", torch.bfloat16)
    layer = plain.layers[0]
    parts = [int4_codes(m) for m in layer.qkv.float().split(
        [config.q_size, config.kv_size, config.kv_size])]  # fmt: skip

    def with_qkv(mode: str) -> Weights:
        qkv = fuse_matrices(parts, mode, torch.bfloat16)
        return replace(plain, layers=[replace(layer, qkv=qkv), *plain.layers[1:]])

    extra = weights_bytes(with_qkv("auto")) - weights_bytes(with_qkv("int4"))
    assert extra == layer.qkv.nbytes  # the same matrix in bf16, once


def test_auto_hands_its_load_time_values_over_once_and_they_are_the_kernels():
    gen = torch.Generator().manual_seed(15)
    weight = fuse_matrices([int4_codes(torch.randn(64, 96, generator=gen))], "auto", torch.bfloat16)
    handed = dense_values(weight)  # computed at load from the codes
    assert weight.handover == []  # the weight holds them no longer
    assert torch.equal(handed, dense_values(weight))  # read back through the kernel
