"""The fused bf16 decode kernels: each against its torch formulation, and the model's small-decode
path against its torch path and against fp32."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from tests.model_support import (
    model,
    one_torch_thread,  # noqa: F401  (autouse fixture)
    prompt_ids,
    scattered_table,
)
from worker_svc import cpu_kernels
from worker_svc.rope import RopeTable, apply_rope
from worker_svc.runner import ModelRunner
from worker_svc.work import WorkItem

KERNELS = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler: kernels not built")
BF16 = torch.bfloat16


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of 2^-8 of the larger magnitude: correct rounding to bf16
    (8 significant bits) stays within 1."""
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-3)
    return float(((a.float() - b.float()).abs() / (scale * 2**-8)).max())


@needs_kernels
def test_add_rms_norm_matches_torch() -> None:
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 576, generator=gen).to(BF16)
    delta = torch.randn(5, 576, generator=gen).to(BF16)
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(BF16)
    expect_x = x + delta
    expect_h = F.rms_norm(expect_x, (576,), weight, 1e-5)
    out = torch.empty_like(x)
    KERNELS.add_rms_norm(x, delta, weight, 1e-5, out)
    assert torch.equal(x, expect_x)  # the residual add rounds exactly as torch's
    assert bf16_ulps(out, expect_h) <= 1.0
    KERNELS.add_rms_norm(x, None, weight, 1e-5, out)  # norm only: x unchanged
    assert torch.equal(x, expect_x)
    assert bf16_ulps(out, expect_h) <= 1.0


@needs_kernels
@pytest.mark.parametrize("rows,hidden", [(20, 576), (17, 77), (3, 8)])
def test_add_rms_norm_rounds_as_torch_across_threads_and_ragged_rows(
    rows: int, hidden: int
) -> None:
    """Rows split over threads from 16, a hidden size with a tail beyond 16-value steps (and
    one below a step): the residual add exactly torch's, the norm within bf16's rounding."""
    assert KERNELS is not None
    KERNELS.set_threads(2)
    gen = torch.Generator().manual_seed(4)
    x = (4 * torch.randn(rows, hidden, generator=gen)).to(BF16)
    delta = torch.randn(rows, hidden, generator=gen).to(BF16)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(BF16)
    expect_x = x + delta
    expect_h = F.rms_norm(expect_x.float(), (hidden,), weight.float(), 1e-5)
    out = torch.empty_like(x)
    KERNELS.add_rms_norm(x, delta, weight, 1e-5, out)
    assert torch.equal(x, expect_x)
    assert bf16_ulps(out, expect_h.to(BF16)) <= 1.0
    KERNELS.add_rms_norm(x, None, weight, 1e-5, out)
    assert torch.equal(x, expect_x)
    assert bf16_ulps(out, expect_h.to(BF16)) <= 1.0


@needs_kernels
@pytest.mark.parametrize("rows,hidden", [(1, 576), (20, 576), (17, 77)])
def test_add_rms_norm_keeps_an_fp32_residual_unrounded(rows: int, hidden: int) -> None:
    """The residual stream in fp32 (the model's CPU bf16 path): x += delta exactly as fp32 adds
    it, never rounded to bf16; h the norm of that fp32 x, rounded once to bf16."""
    assert KERNELS is not None
    KERNELS.set_threads(2)
    gen = torch.Generator().manual_seed(9)
    x = 4 * torch.randn(rows, hidden, generator=gen)
    delta = torch.randn(rows, hidden, generator=gen).to(BF16)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(BF16)
    expect_x = x + delta.float()
    out = torch.empty(rows, hidden, dtype=BF16)
    KERNELS.add_rms_norm(x, delta, weight, 1e-5, out)
    try:
        assert x.dtype == torch.float32 and torch.equal(x, expect_x)
        assert not torch.equal(x, x.to(BF16).float())  # kept finer than bf16
        expect_h = F.rms_norm(expect_x, (hidden,), weight.float(), 1e-5)
        assert bf16_ulps(out, expect_h.to(BF16)) <= 1.0
    finally:
        KERNELS.set_threads(torch.get_num_threads())


@needs_kernels
@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 40), (20, 77)])
def test_silu_mul_matches_fp32_rounded_once(rows: int, inter: int) -> None:
    """Each row [gate | up] -> silu(gate) * up: within bf16's rounding of the fp32 result, for
    large positive and negative gates too (no overflow), rows split over threads from 16."""
    assert KERNELS is not None
    KERNELS.set_threads(2)
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(BF16)
    gate_up[0, :4] = torch.tensor([90.0, -90.0, 0.0, -0.0])
    out = torch.empty(rows, inter, dtype=BF16)
    KERNELS.silu_mul(gate_up, out)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expect = F.silu(gate) * up
    assert torch.isfinite(out.float()).all()
    assert bf16_ulps(out, expect.to(BF16)) <= 1.0
    assert (out.float() - expect).abs().max() <= 2**-8 * expect.abs().max()


@needs_kernels
def test_rope_store_matches_apply_rope_and_writes_kv_to_its_slots() -> None:
    assert KERNELS is not None
    heads, kv_heads, dim, n = 9, 3, 64, 4
    gen = torch.Generator().manual_seed(1)
    rope = RopeTable(dim, 100000.0, 512, BF16)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(BF16)
    positions = torch.tensor([0, 7, 300, 511])
    slots = torch.tensor([12, 3, 40, 25])
    k_pool = torch.zeros(64, kv_heads, dim, dtype=BF16)
    v_pool = torch.zeros_like(k_pool)
    q = torch.empty(n, heads, dim, dtype=BF16)
    KERNELS.rope_store(
        qkv, rope.cos, rope.sin, positions, slots, q, k_pool.data_ptr(), v_pool.data_ptr(),
        kv_heads,
    )  # fmt: skip
    # reference: the same bf16 inputs and tables, in fp32; the kernel rounds once, at the end
    cos, sin = (t.float() for t in rope.lookup(positions))
    qk = qkv[:, : (heads + kv_heads) * dim].view(n, heads + kv_heads, dim).float()
    qk = apply_rope(qk, cos, sin)
    assert bf16_ulps(q, qk[:, :heads]) <= 1.0
    assert bf16_ulps(k_pool[slots], qk[:, heads:]) <= 1.0
    assert torch.equal(v_pool[slots], qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not k_pool[untouched].any() and not v_pool[untouched].any()
    # with k_out (a prompt chunk's step): the same pool and q, and the rotated keys in k_out too
    k_pool2, v_pool2 = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    q2, k_out = torch.empty_like(q), torch.empty(n, kv_heads, dim, dtype=BF16)
    KERNELS.rope_store(
        qkv, rope.cos, rope.sin, positions, slots, q2, k_pool2.data_ptr(), v_pool2.data_ptr(),
        kv_heads, k_out=k_out,
    )  # fmt: skip
    assert torch.equal(q2, q) and torch.equal(k_pool2, k_pool) and torch.equal(v_pool2, v_pool)
    assert torch.equal(k_out, k_pool[slots])


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32)])
@pytest.mark.parametrize(
    "lengths",
    [
        [1, 13, 37],
        [1, 16, 17, 33, 40, 31],
        [40, 1, 2, 3, 5, 39, 1, 2],
        [40, 1, 2, 3, 5, 39, 1, 2, 17, 16, 33, 1, 9, 40, 2, 6, 21, 3],
        [38],
    ],
)
def test_decode_attention_matches_fp32_attention(
    heads: int, kv_heads: int, dim: int, threads: int, lengths: list[int]
) -> None:
    """Scattered, out-of-order blocks, different lengths per request (one ends mid-block);
    single-threaded and split over OpenMP threads; three requests (a task per KV head) and six
    (a task per request), lengths on both sides of the 16 positions the kernel reads ahead;
    eight and eighteen of very different lengths (the threads' fixed shares of positions: long
    requests against many short ones); the three tasks of one request are taken one at a time."""
    assert KERNELS is not None
    KERNELS.set_threads(threads)
    block_size = 4
    num_blocks = 10 * len(lengths) + 10
    lengths = torch.tensor(lengths)
    gen = torch.Generator().manual_seed(2)
    k_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(BF16)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(BF16)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(BF16)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.stack([order[i * 10 : (i + 1) * 10] for i in range(len(lengths))])
    out = torch.empty_like(q)
    KERNELS.decode_attention(
        q, k_pool.data_ptr(), v_pool.data_ptr(), tables, lengths, block_size, kv_heads,
        dim**-0.5, out,
    )  # fmt: skip
    for r, length in enumerate(lengths.tolist()):
        slots = tables[r].repeat_interleave(block_size) * block_size
        slots = (slots + torch.arange(block_size).repeat(10))[:length]
        k = k_pool.view(-1, kv_heads, dim)[slots].float().transpose(0, 1)  # [kv, len, dim]
        v = v_pool.view(-1, kv_heads, dim)[slots].float().transpose(0, 1)
        expect = F.scaled_dot_product_attention(
            q[r].float().unsqueeze(1), k, v, enable_gqa=True
        )  # [heads, 1, dim]
        # probabilities may be rounded to bf16 (2^-9 relative) before P @ V, as torch's bf16
        # path rounds them: the error is bounded by the values' size, not the output's
        error = (out[r].float() - expect.squeeze(1)).abs().max()
        assert error <= 2**-7 * v.abs().max(), (r, error)


def decode_logits(runner: ModelRunner, prompts: list[list[int]], table_seed: int) -> torch.Tensor:
    """Prefill each prompt but its last token alone, then decode all last tokens in one step."""
    tables = []
    for i, ids in enumerate(prompts):
        table = scattered_table(64, 4, 16, seed=table_seed + i)
        table = [b + 16 * i for b in table]  # disjoint blocks per request
        tables.append(table)
        runner.compute_logits([WorkItem(str(i), ids[:-1], 0, table, sample=False)])
    items = [WorkItem(str(i), [ids[-1]], len(ids) - 1, tables[i]) for i, ids in enumerate(prompts)]
    return runner.compute_logits(items)


def check_small_decode_path(source: str, prompts: list[list[int]]) -> None:
    config, weights = model(source, BF16)
    fast = ModelRunner(config, weights, num_blocks=16 * len(prompts), block_size=4, dtype=BF16)
    plain = ModelRunner(
        config, weights, 16 * len(prompts), 4, dtype=BF16, use_kernels=False
    )  # fmt: skip
    assert fast.model.kernels is not None and plain.model.kernels is None
    config32, weights32 = model(source, torch.float32)
    exact = ModelRunner(config32, weights32, 16 * len(prompts), 4, dtype=torch.float32)
    ours, theirs = decode_logits(fast, prompts, 3), decode_logits(plain, prompts, 3)
    reference = decode_logits(exact, prompts, 3)
    scale = reference.abs().max()
    # no worse than the torch bf16 path (both round the same weights), and close to it
    assert (ours - reference).abs().max() <= 1.5 * (theirs - reference).abs().max() + 1e-3 * scale
    assert (ours - theirs).abs().max() < 0.05 * scale
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def mixed_logits(runner: ModelRunner, prompts: list[list[int]], chunk: list[int]) -> torch.Tensor:
    """Prefill each prompt but its last token alone, then one step of all last tokens beside a
    fresh prompt's whole chunk (a mixed step: decodes first, then the chunk)."""
    tables = []
    for i, ids in enumerate(prompts + [chunk]):
        table = [b + 16 * i for b in scattered_table(64, 4, 16, seed=7 + i)]
        tables.append(table)
        if i < len(prompts):
            runner.compute_logits([WorkItem(str(i), ids[:-1], 0, table, sample=False)])
    items = [WorkItem(str(i), [ids[-1]], len(ids) - 1, tables[i]) for i, ids in enumerate(prompts)]
    items.append(WorkItem("chunk", chunk, 0, tables[-1]))
    return runner.compute_logits(items)


@needs_kernels
@pytest.mark.parametrize("decodes", [1, 5])
def test_mixed_step_decodes_take_the_fused_kernel_and_match_torch_path_and_fp32(
    decodes: int,
) -> None:
    """A step with decodes and a prompt chunk: its decodes' attention runs in the fused kernel
    (one task per KV head below 4 decodes, one per request from 4), the logits as close to fp32
    as the torch path's, every row's argmax fp32's."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (3, 20, 41, 9, 30)]
    prompts, chunk = prompts[:decodes], torch.randint(0, 49152, (23,), generator=gen).tolist()
    n = len(prompts) + 1
    config, weights = model("tiny", BF16)
    fast = ModelRunner(config, weights, num_blocks=16 * n, block_size=4, dtype=BF16)
    plain = ModelRunner(config, weights, 16 * n, 4, dtype=BF16, use_kernels=False)
    calls = []
    fused = fast.model.fused_decode_attention
    fast.model.fused_decode_attention = lambda *a: calls.append(a[1].shape[0]) or fused(*a)
    config32, weights32 = model("tiny", torch.float32)
    exact = ModelRunner(config32, weights32, 16 * n, 4, dtype=torch.float32)
    ours, theirs = mixed_logits(fast, prompts, chunk), mixed_logits(plain, prompts, chunk)
    reference = mixed_logits(exact, prompts, chunk)
    assert calls and set(calls) == {decodes}  # every layer's decodes went through the kernel
    scale = reference.abs().max()
    assert (ours - reference).abs().max() <= 1.5 * (theirs - reference).abs().max() + 1e-3 * scale
    assert (ours - theirs).abs().max() < 0.05 * scale
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


@needs_kernels
def test_tiny_small_decode_path_matches_torch_path_and_fp32() -> None:
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (2, 9, 30)]
    check_small_decode_path("tiny", prompts)


@needs_kernels
@pytest.mark.slow
def test_smollm2_small_decode_path_matches_torch_path_and_fp32() -> None:
    prompts = [prompt_ids(p) for p in ("The capital of France is", "def fibonacci(n):")]
    check_small_decode_path("smollm2", prompts)


def test_kernels_can_be_switched_off(monkeypatch) -> None:
    monkeypatch.setenv("LLMSERVE_CPU_KERNELS", "0")
    assert cpu_kernels.load() is None
    config, weights = model("tiny", BF16)
    assert ModelRunner(config, weights, 8, 4, dtype=BF16).model.kernels is None


def test_kernels_are_not_used_for_fp32() -> None:
    config, weights = model("tiny", torch.float32)
    runner = ModelRunner(config, weights, 8, 4, dtype=torch.float32)
    assert runner.model.kernels is None


@needs_kernels
def test_source_builds_for_this_cpu_without_the_fallback(tmp_path) -> None:
    """The build falls back to generic flags if the preferred ones fail; a compile error in the
    CPU-specific code would otherwise go unnoticed (and slow)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    done = cpu_kernels.compile_source(compiler, cpu_kernels.ARCH_FLAGS[0], str(tmp_path / "k.so"))
    assert done.returncode == 0, done.stderr


def test_a_library_built_for_a_newer_cpu_is_not_loaded() -> None:
    """An image's kernels are built for x86-64-v3; a CPU without AVX2 must fall back to torch
    rather than crash on the first illegal instruction."""
    old_cpu = {"sse4_2", "popcnt", "avx", "sse2"}
    assert cpu_kernels.missing_cpu_features("x86-64-v3", old_cpu) == ["avx2", "fma", "bmi2"]
    assert cpu_kernels.missing_cpu_features("x86-64-v3", old_cpu | {"avx2", "fma", "bmi2"}) == []
    assert cpu_kernels.missing_cpu_features("native", old_cpu) == []
    assert cpu_kernels.missing_cpu_features("x86-64-v3", None) == []  # not Linux: cannot tell
    flags = cpu_kernels.cpu_flags()
    assert flags is None or "sse2" in flags  # read from this machine's /proc/cpuinfo
