"""int4 matmuls on int8 activations (--int4-activations int8; vnni_matmul.c int4_matmul_a8): each
row rounded per group of 32 inputs, the products summed in int32 by VNNI. Against fp64 over the
rounded activations and the values the codes stand for, at every row tiling; each row the same
whatever rows share the call (a draft's rows equal a plain decode's); the switch and where it
cannot run; builds without VNNI and without AVX-512; the worker's flag, its plan (every size on
the int4 kernel, no dense copy, where the CPU table says so) and its Describe."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.kernel_builds import build_kernels
from worker_svc import blocked_matmul, cpu_kernels
from worker_svc.cpu_features import A8_INT4_MAX_ROWS, host_features
from worker_svc.quant import Int4Codes, int4_codes, pack_int4

kernels = cpu_kernels.load()
needs_vnni = pytest.mark.skipif(
    kernels is None or not kernels.vnni, reason="no AVX-512 VNNI and BF16 build of the kernels"
)


@pytest.fixture(autouse=True)
def bf16_after():
    """Every test leaves the process's int4 matmuls on bf16 activations, as it found them."""
    yield
    blocked_matmul.set_activations("bf16")


def codes_of(out: int, inputs: int, seed: int = 0) -> Int4Codes:
    g = torch.Generator().manual_seed(seed)
    return int4_codes(torch.randn(out, inputs, generator=g) * 0.05)


def rounded(x: torch.Tensor, ratio: float = 3.0) -> torch.Tensor:
    """x [rows, in] bf16 as the kernel rounds it: per group of 32, a largest |x| above `ratio`
    times the second largest kept apart, exactly; the rest with scale = max |x| / 127 and code =
    x * (127 / max |x|) to nearest even. fp64 codes x scale, plus the values kept apart."""
    rows, inputs = x.shape
    g = x.float().view(rows, inputs // 32, 32)
    top = g.abs().topk(2, dim=-1).values
    apart = top[..., :1] > ratio * top[..., 1:]  # fp32 products, as the kernel's
    first = g.abs().argmax(-1, keepdim=True)
    lane = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, first, True)
    kept = torch.where(lane & apart, g, torch.zeros_like(g))
    rest = g - kept
    amax = rest.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(rest * inv)  # fp32 products, half to even, as cvtps2dq
    assert codes.abs().max() <= 127
    out = codes.double() * (amax / 127).double() + kept.double()
    return out.view(rows, inputs)


def values(codes: Int4Codes) -> torch.Tensor:
    """fp64 [out, in]: the values the layout holds (scales and zeros in bf16)."""
    bf = Int4Codes(codes.codes, codes.scale.bfloat16().float(), codes.zero.bfloat16().float())
    return bf.dequantize().double()


def a8(weight):
    """The weight held off the AMX tiles, its matmuls on int8 activations."""
    assert blocked_matmul.set_activations("int8") == "int8"
    return replace(weight, amx_from_rows=0)


@needs_vnni
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 21])
def test_matches_fp64_over_the_rounded_activations(rows):
    codes = codes_of(48, 96, seed=rows)
    weight = a8(pack_int4(codes, torch.bfloat16, blocked=True))
    assert weight.kernel == "blocked int4 (int8 activations)"
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(7)).bfloat16()
    got, want = weight.matmul(x), rounded(x) @ values(codes).T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    # exact int32 sums, fp32 scaling, rounded once to bf16: within bf16's half ulp, plus fp32 noise
    assert torch.allclose(got.double(), want, rtol=2**-8, atol=1e-5)
    # and near the bf16 activations' result: the rounding of x is all that differs
    exact = x.double() @ values(codes).T
    assert (got.double() - exact).abs().max() <= 0.02 * exact.abs().max()
    blocked_matmul.set_activations("bf16")
    assert weight.kernel == "blocked int4"
    assert not torch.equal(weight.matmul(x), got)  # the switch changed the kernel


@needs_vnni
def test_a_row_is_the_same_whatever_rows_share_the_call():
    codes = codes_of(64, 576, seed=3)
    weight = a8(pack_int4(codes, torch.bfloat16, blocked=True))
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    together = weight.matmul(x)
    for start, stop in [(0, 1), (0, 6), (3, 9), (8, 19), (18, 19)]:
        assert torch.equal(weight.matmul(x[start:stop]), together[start:stop]), (start, stop)


@needs_vnni
def test_threads_change_nothing_and_zero_rows_give_zero():
    weight = a8(pack_int4(codes_of(256, 128, seed=4), torch.bfloat16, blocked=True))
    x = torch.randn(7, 128).bfloat16()
    x[3] = 0  # a group's scale of 0: its codes 0, its products 0
    assert kernels is not None
    kernels.set_threads(1)
    one = weight.matmul(x)
    kernels.set_threads(2)
    try:
        assert torch.equal(weight.matmul(x), one)
    finally:
        kernels.set_threads(torch.get_num_threads())
    assert torch.equal(one[3], torch.zeros(256, dtype=torch.bfloat16))


@needs_vnni
def test_large_and_small_values_keep_their_relative_precision():
    """A group's scale follows its own largest value: rows of 1e-3 and 1e3 are as exact."""
    codes = codes_of(32, 64, seed=6)
    weight = a8(pack_int4(codes, torch.bfloat16, blocked=True))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    x[0] *= 1e-3
    x[1] *= 1e3
    x = x.bfloat16()
    got, want = weight.matmul(x).double(), rounded(x) @ values(codes).T
    for r in range(2):
        assert torch.allclose(got[r], want[r], rtol=2**-8, atol=want[r].abs().max() * 1e-5)


@needs_vnni
@pytest.mark.parametrize("ratio", [3.0, float("inf"), 1.0])
def test_a_value_far_above_its_group_is_kept_apart(ratio):
    """Each group of row 0 holds one value 100x the others: kept apart (the rule at 3), the rest
    keeps its precision; with the rule off (inf) the rest rounds on the large value's scale;
    at 1 every group's largest is kept apart. Each as the reference rounds it."""
    codes = codes_of(32, 128, seed=8)
    weight = a8(pack_int4(codes, torch.bfloat16, blocked=True))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    x[0, [5, 40, 77, 127]] = torch.tensor([300.0, -250.0, 180.0, 400.0])
    x = x.bfloat16()
    assert kernels is not None
    kernels.set_a8_outlier_ratio(ratio)
    try:
        got = weight.matmul(x).double()
    finally:
        kernels.set_a8_outlier_ratio(3.0)
    want = rounded(x, ratio) @ values(codes).T
    assert torch.allclose(got, want, rtol=2**-8, atol=want.abs().max() * 1e-5)
    exact = x.double() @ values(codes).T
    error = (got[0] - exact[0]).abs().max() / exact[0].abs().max()
    if ratio == float("inf"):
        assert error > 1e-3  # the rest rounded to ~2.4 per step: the kernel did run so
    else:
        assert error < 2**-7  # kept apart: about bf16's rounding


@needs_vnni
def test_shapes_it_does_not_take():
    weight = pack_int4(codes_of(32, 64), torch.bfloat16, blocked=True)
    assert kernels is not None
    with pytest.raises(ValueError, match="unsupported shape"):
        x = torch.zeros(1, 48, dtype=torch.bfloat16)
        kernels.blocked_matmul("int4a8", x, weight.blocked, 32)
    blocked_matmul.set_activations("int8")
    assert weight.matmul(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 32)


def test_the_switch_refuses_other_values_and_falls_back_where_it_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match="not one of"):
        blocked_matmul.set_activations("fp8")
    monkeypatch.setenv("LLMSERVE_BLOCKED_KERNELS", "0")  # torch's kernels: no blocked int4 at all
    assert blocked_matmul.set_activations("int8") == "bf16"
    assert blocked_matmul.activations() == "bf16"
    monkeypatch.delenv("LLMSERVE_BLOCKED_KERNELS")
    runs = blocked_matmul.set_activations("int8")
    assert runs == ("int8" if kernels is not None and kernels.vnni else "bf16")
    assert blocked_matmul.activations() == runs


@pytest.mark.skipif(kernels is None, reason="no C compiler")
@pytest.mark.parametrize("flags", [["-march=native", "-mno-avx512vnni"], []])
def test_builds_without_vnni_have_no_a8_kernel(flags, tmp_path):
    """Without VNNI (or AVX-512) in -march the kernel says so and refuses; bf16 runs."""
    built = build_kernels(flags, tmp_path)
    assert not built.vnni
    if built.blocked:  # AVX-512 BF16 without VNNI: the bf16 int4 kernel still runs
        weight = pack_int4(codes_of(32, 64), torch.bfloat16, blocked=True)
        x = torch.randn(3, 64).bfloat16()
        with pytest.raises(ValueError):
            built.blocked_matmul("int4a8", x, weight.blocked, 32)
        assert built.blocked_matmul("int4", x, weight.blocked, 32).shape == (3, 32)


@needs_vnni
def test_the_worker_runs_every_size_on_int8_activations_where_its_table_says():
    """--int4-activations int8 through the worker's own start (make_runner): the int4 kernel at
    the sizes this CPU's table gives it (every size on avx512_bf16: no dense copy kept), and
    Describe's kernels line says which activations."""
    from worker_svc.__main__ import make_runner
    from worker_svc.kernel_plan import dual_linears, quantized_linears
    from worker_svc.service import WorkerService
    from worker_svc.settings import WorkerSettings

    settings = WorkerSettings(
        kv_capacity=256, model="smollm2", quantization="auto", int4_activations="int8"
    )
    runner = make_runner(settings)
    info = WorkerService(settings, runner, settings.model).describe()
    assert blocked_matmul.activations() == "int8"
    quantized = quantized_linears(runner.model.linears)
    assert quantized[0].weight.kernel == "blocked int4 (int8 activations)"
    assert "blocked int4 (int8 activations) kernel" in info.kernels
    tier = host_features().tier
    if tier in A8_INT4_MAX_ROWS and A8_INT4_MAX_ROWS[tier] is None:
        assert not dual_linears(runner.model.linears) and info.quantized_max_rows == 0
        assert "(int8 activations) kernel at every size" in info.kernels
    # the default puts it back: a worker started without the flag runs bf16
    make_runner(replace(settings, int4_activations="bf16"))
    assert blocked_matmul.activations() == "bf16"
