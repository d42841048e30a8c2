"""The AMX int4 kernel (worker_svc/amx_matmul.c, int4_matmul_amx): against a matmul over the bf16
values the codes stand for (the values --quantization auto's dense copy holds) at row counts
that fill whole and partial tiles and pairs of tiles, and output counts of whole and half pairs
of blocks; each row the same whatever rows share the call and whatever the threads; and the
dispatch: from AMX_INT4_FROM_ROWS rows on an amx-tier CPU, the blocked kernel below, neither
where turned off (LLMSERVE_AMX_KERNELS=0). The kernel tests skip on a host without AMX; the
dispatch's logic is checked everywhere."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from worker_svc import blocked_matmul, cpu_kernels
from worker_svc.cpu_features import AMX_INT4_FROM_ROWS, AMX_INT4_MAX_ROWS, parse_cpuinfo
from worker_svc.quant import Int4Codes, int4_codes, kernel_values, pack_int4

kernels = cpu_kernels.load()
needs_amx = pytest.mark.skipif(
    not blocked_matmul.amx_usable(), reason="no AMX here (or the kernels' build lacks it)"
)


def codes_of(out: int, inputs: int, seed: int = 0) -> Int4Codes:
    g = torch.Generator().manual_seed(seed)
    return int4_codes(torch.randn(out, inputs, generator=g) * 0.05)


def rows_of(rows: int, inputs: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(rows, inputs, generator=torch.Generator().manual_seed(seed)).bfloat16()


@needs_amx
@pytest.mark.parametrize("rows", [1, 9, 16, 17, 31, 32, 33, 64, 100, 128, 130])
@pytest.mark.parametrize("shape", [(48, 96), (80, 576), (32, 1536)])  # odd and even block pairs
def test_matches_the_bf16_values_the_codes_stand_for(rows, shape):
    out, inputs = shape
    codes = codes_of(out, inputs, seed=rows)
    weight = pack_int4(codes, torch.bfloat16, blocked=True)
    assert kernels is not None and weight.blocked is not None
    x = rows_of(rows, inputs)
    got = kernels.int4_matmul_amx(x, weight.blocked, out)
    values = kernel_values(codes, torch.bfloat16).float()  # the dense copy's values
    want = x.float() @ values.T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    # exact products, fp32 sums, rounded once to bf16: within bf16's half ulp plus fp32 noise
    assert torch.allclose(got.float(), want, rtol=2**-8, atol=1e-5)


@needs_amx
def test_the_same_as_the_dense_copy_within_a_rounding():
    codes = codes_of(960, 576, seed=1)
    weight = pack_int4(codes, torch.bfloat16, blocked=True)
    assert kernels is not None and weight.blocked is not None
    x = rows_of(64, 576)
    dense = torch.nn.functional.linear(x, kernel_values(codes, torch.bfloat16)).float()
    got = kernels.int4_matmul_amx(x, weight.blocked, 960).float()
    assert (got - dense).abs().max() <= 2**-7 * dense.abs().max()


@needs_amx
def test_a_row_is_the_same_whatever_rows_share_the_call():
    codes = codes_of(96, 576, seed=3)
    weight = pack_int4(codes, torch.bfloat16, blocked=True)
    assert kernels is not None and weight.blocked is not None
    x = rows_of(70, 576, seed=5)
    together = kernels.int4_matmul_amx(x, weight.blocked, 96)
    for start, stop in [(0, 9), (3, 20), (16, 48), (40, 70), (69, 70)]:
        part = kernels.int4_matmul_amx(x[start:stop], weight.blocked, 96)
        assert torch.equal(part, together[start:stop]), (start, stop)


@needs_amx
def test_threads_change_nothing():
    codes = codes_of(256, 128, seed=4)
    weight = pack_int4(codes, torch.bfloat16, blocked=True)
    assert kernels is not None and weight.blocked is not None
    x = rows_of(40, 128)
    kernels.set_threads(1)
    one = kernels.int4_matmul_amx(x, weight.blocked, 256)
    kernels.set_threads(2)
    try:
        assert torch.equal(kernels.int4_matmul_amx(x, weight.blocked, 256), one)
    finally:
        kernels.set_threads(torch.get_num_threads())


@needs_amx
def test_shapes_it_does_not_take_and_no_rows():
    weight = pack_int4(codes_of(32, 64), torch.bfloat16, blocked=True)
    assert kernels is not None and weight.blocked is not None
    with pytest.raises(ValueError, match="unsupported shape"):
        kernels.int4_matmul_amx(torch.zeros(12, 48, dtype=torch.bfloat16), weight.blocked, 32)
    empty = kernels.int4_matmul_amx(torch.empty(0, 64, dtype=torch.bfloat16), weight.blocked, 32)
    assert empty.shape == (0, 32)


@needs_amx
def test_the_weight_runs_the_tiles_from_their_row_count_and_the_blocked_kernel_below():
    codes = codes_of(64, 576, seed=2)
    weight = pack_int4(codes, torch.bfloat16, blocked=True)
    assert weight.amx_from_rows == AMX_INT4_FROM_ROWS
    assert kernels is not None and weight.blocked is not None
    x = rows_of(AMX_INT4_FROM_ROWS, 576)
    below = x[: AMX_INT4_FROM_ROWS - 1]
    assert torch.equal(
        weight.matmul(below), kernels.blocked_matmul("int4", below, weight.blocked, 64)
    )
    assert torch.equal(weight.matmul(x), kernels.int4_matmul_amx(x, weight.blocked, 64))


def test_turned_off_no_weight_runs_the_tiles(monkeypatch):
    monkeypatch.setenv("LLMSERVE_AMX_KERNELS", "0")
    assert not blocked_matmul.amx_usable() and blocked_matmul.amx_rows() == 0
    weight = pack_int4(codes_of(32, 64), torch.bfloat16)
    assert weight.amx_from_rows == 0
    x = rows_of(20, 64)
    if weight.blocked is not None:  # a host with the blocked kernel: it serves every row count
        assert kernels is not None
        assert torch.equal(weight.matmul(x), kernels.blocked_matmul("int4", x, weight.blocked, 32))


def test_only_an_amx_tier_splits_at_the_amx_rows():
    amx = parse_cpuinfo("processor\t: 0\nflags\t\t: avx512f avx512_bf16 amx_tile amx_bf16\n\n")
    zen4 = parse_cpuinfo("processor\t: 0\nflags\t\t: avx512f avx512_vnni avx512_bf16\n\n")
    assert amx.int4_max_rows(True, amx=True) == AMX_INT4_MAX_ROWS
    assert amx.int4_max_rows(True, amx=False) == amx.int4_max_rows(True)  # the blocked kernel's
    assert zen4.int4_max_rows(True, amx=True) == zen4.int4_max_rows(True)
    assert amx.int4_max_rows(False, amx=True) == amx.quantized_max_rows  # torch's kernel


def test_a_weight_off_the_tiles_never_calls_them():
    weight = replace(pack_int4(codes_of(32, 64), torch.bfloat16), amx_from_rows=0)
    if weight.blocked is None:
        pytest.skip("no blocked kernel here")
    assert kernels is not None
    x = rows_of(AMX_INT4_FROM_ROWS + 20, 64)
    assert torch.equal(weight.matmul(x), kernels.blocked_matmul("int4", x, weight.blocked, 32))
