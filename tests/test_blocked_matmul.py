"""This project's own quantized kernels (worker_svc/blocked_matmul.py, cpu_kernels.c
int4_matmul_bf16 and int8_matmul_bf16) against a matmul over the values the codes stand for, at
every row tiling (1..8 rows per tile, whole and partial tiles); each row's result the same
whatever rows share the call (a draft's rows equal a plain decode's); shapes they do not take
refused; the layouts; and the dispatch: where they run, torch's kernels where asked
(LLMSERVE_BLOCKED_KERNELS=0) or where they cannot. The AMX int4 kernel (amx_matmul.c, from 9 rows
on an amx-tier CPU): tests/test_amx_matmul.py; here int4 weights are held off it (blocked_only)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from worker_svc import blocked_matmul, cpu_kernels
from worker_svc.quant import (
    Int4Codes,
    Int4Weight,
    int4_codes,
    int8_weight,
    pack_int4,
    quantize_int8,
)

kernels = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(
    kernels is None or not kernels.blocked, reason="no AVX-512 BF16 build of the kernels"
)


def blocked_only(weight: Int4Weight) -> Int4Weight:
    """The weight with its matmuls on the blocked AVX-512 kernel at every row count."""
    return replace(weight, amx_from_rows=0)


def codes_of(out: int, inputs: int, seed: int = 0) -> Int4Codes:
    g = torch.Generator().manual_seed(seed)
    return int4_codes(torch.randn(out, inputs, generator=g) * 0.05)


def reference(x: torch.Tensor, codes: Int4Codes) -> torch.Tensor:
    """fp32 over the values the kernel holds (scales and zeros in bf16, as torch's keeps them)."""
    bf = Int4Codes(codes.codes, codes.scale.bfloat16().float(), codes.zero.bfloat16().float())
    return x.float() @ bf.dequantize().T


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 21])
def test_matches_the_values_the_codes_stand_for(rows):
    codes = codes_of(48, 96, seed=rows)
    weight = blocked_only(pack_int4(codes, torch.bfloat16, blocked=True))
    assert weight.kernel == "blocked int4" and weight.blocked is not None
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(7)).bfloat16()
    got, want = weight.matmul(x), reference(x, codes)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    # fp32 sums rounded once to bf16: within bf16's half ulp of the exact value, plus fp32 noise
    assert torch.allclose(got.float(), want, rtol=2**-8, atol=1e-5)
    torch_kernel = pack_int4(codes, torch.bfloat16, blocked=False)
    assert torch_kernel.kernel == "int4"
    assert (got.float() - torch_kernel.matmul(x).float()).abs().max() <= 2**-7 * want.abs().max()


@needs_kernel
def test_a_row_is_the_same_whatever_rows_share_the_call():
    codes = codes_of(64, 576, seed=3)
    weight = blocked_only(pack_int4(codes, torch.bfloat16, blocked=True))
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    together = weight.matmul(x)
    for start, stop in [(0, 1), (0, 6), (3, 9), (8, 19), (18, 19)]:
        assert torch.equal(weight.matmul(x[start:stop]), together[start:stop]), (start, stop)


@needs_kernel
def test_threads_change_nothing():
    codes = codes_of(256, 128, seed=4)
    weight = pack_int4(codes, torch.bfloat16, blocked=True)
    x = torch.randn(7, 128).bfloat16()
    assert kernels is not None
    kernels.set_threads(1)
    one = weight.matmul(x)
    kernels.set_threads(2)
    try:
        assert torch.equal(weight.matmul(x), one)
    finally:
        kernels.set_threads(torch.get_num_threads())


@needs_kernel
def test_no_rows_and_shapes_it_does_not_take():
    weight = pack_int4(codes_of(32, 64), torch.bfloat16, blocked=True)
    assert weight.matmul(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 32)
    assert kernels is not None
    with pytest.raises(ValueError, match="unsupported shape"):
        kernels.blocked_matmul("int4", torch.zeros(1, 48, dtype=torch.bfloat16), weight.blocked, 32)
    assert not blocked_matmul.usable(torch.bfloat16, 40, 64)  # outputs not a multiple of 16
    assert not blocked_matmul.usable(torch.float32, 32, 64)  # the kernel is bf16 only
    assert not blocked_matmul.usable(torch.bfloat16, 32, 48, group=32)  # int4: whole groups


def test_the_layout_puts_each_code_where_the_kernel_reads_it():
    codes = codes_of(32, 64, seed=9)
    layout = blocked_matmul.int4_layout(codes.codes, codes.scale, codes.zero)
    assert layout.shape == (2, 2, 320) and layout.dtype == torch.uint8
    for o, k in [(0, 0), (5, 1), (17, 34), (31, 63), (16, 2), (3, 31)]:
        block, lane, group, kk = o // 16, o % 16, k // 32, k % 32
        c, h, e = kk // 4, (kk % 4) // 2, kk % 2
        byte = int(layout[block, group, 32 * c + 2 * lane + e])
        assert (byte >> (4 * h)) & 15 == int(codes.codes[o, k]), (o, k)
    scale = layout[1, 1, 256:288].view(torch.bfloat16)
    assert torch.equal(scale, codes.scale[16:32, 1].bfloat16())


def test_torch_kernels_where_asked(monkeypatch):
    monkeypatch.setenv("LLMSERVE_BLOCKED_KERNELS", "0")
    assert not blocked_matmul.usable(torch.bfloat16, 32, 64)
    weight = pack_int4(codes_of(32, 64), torch.bfloat16)
    assert weight.kernel == "int4" and weight.blocked is None
    assert quantize_int8(torch.randn(32, 64), torch.bfloat16).kernel == "int8"


def int8_of(out: int, inputs: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return quantize_int8(torch.randn(out, inputs, generator=g), torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 6, 8, 11, 16])
def test_int8_matches_the_values_the_codes_stand_for(rows):
    torch_kernel = int8_of(48, 96, seed=rows)
    codes = torch_kernel.int_codes()
    weight = int8_weight(codes, torch_kernel.scales, blocked=True)
    assert weight.kernel == "blocked int8" and weight.codes.numel() == 0
    assert torch.equal(weight.int_codes(), codes) and weight.shape == (48, 96)
    torch_only = int8_weight(codes, torch_kernel.scales, blocked=False)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(8)).bfloat16()
    values = weight.int_codes().float() * weight.scales.float()[:, None]
    got, want = weight.matmul(x), x.float() @ values.T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    assert torch.allclose(got.float(), want, rtol=2**-8, atol=1e-4)
    theirs = torch_only.matmul(x).float()
    assert (got.float() - theirs).abs().max() <= 2**-7 * want.abs().max()


@needs_kernel
def test_int8_a_row_is_the_same_whatever_rows_share_the_call():
    weight = int8_of(80, 576, seed=2)
    x = torch.randn(13, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    together = weight.matmul(x)
    for start, stop in [(0, 1), (2, 8), (7, 13), (12, 13)]:
        assert torch.equal(weight.matmul(x[start:stop]), together[start:stop]), (start, stop)


def test_the_int8_layout_puts_each_code_where_the_kernel_reads_it():
    weight = int8_of(32, 8, seed=6)
    layout = blocked_matmul.int8_layout(weight.int_codes(), weight.scales)
    assert layout.shape == (2, 16 * 8 + 32) and layout.dtype == torch.uint8
    for o, k in [(0, 0), (3, 5), (17, 7), (31, 2)]:
        block, lane, pair, e = o // 16, o % 16, k // 2, k % 2
        assert int(layout[block, 32 * pair + 2 * lane + e]) == int(weight.int_codes()[o, k]) + 128
    assert torch.equal(layout[1, 128:].view(torch.bfloat16), weight.scales[16:32])
