"""The int8 KV pool (--kv-cache-dtype int8): the quantization, the C store and attention against
their torch formulations on the dequantized values, the model's every attention path over it, and
the pool's size in memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernel_builds import build_kernels
from tests.model_support import (
    model,
    one_torch_thread,  # noqa: F401  (autouse fixture)
    scattered_table,
)
from worker_svc import cpu_kernels
from worker_svc.kv_pool import KvPool, as_stored, position_bytes, quantize_kv
from worker_svc.memory_profile import bytes_per_position
from worker_svc.rope import RopeTable
from worker_svc.runner import ModelRunner
from worker_svc.work import WorkItem

KERNELS = cpu_kernels.load()
# (lengths per request, block size): whole and part blocks, many short requests beside long
# ones, an odd length, and a context whose value rows are read ahead rather than all at once
SHAPES = [
    ([1, 13, 37], 4),
    ([1, 16, 17, 33, 40, 31], 4),
    ([40, 1, 2, 3, 5, 39, 1, 2, 17, 16, 33, 1, 9, 40, 2, 6, 21, 3], 4),
    ([38], 4),
    ([3001, 5], 16),
]
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler: kernels not built")
BF16 = torch.bfloat16


def dequantized(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales.unsqueeze(-1)


def test_quantize_kv_keeps_each_value_within_half_a_step_of_its_row() -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(50, 3, 64, generator=gen) * torch.rand(50, 3, 1, generator=gen) * 8).to(BF16)
    x[7, 1] = 0  # an all-zero row: scale 0, codes 0, values 0
    codes, scales = quantize_kv(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert codes.shape == x.shape and scales.shape == x.shape[:-1]
    assert int(codes.abs().max()) == 127 and int(codes.min()) >= -127
    # each row's largest magnitude is its scale's 127 exactly
    assert torch.equal(
        codes.abs().amax(-1)[scales > 0], torch.full_like(scales[scales > 0], 127).to(torch.int8)
    )
    error = (dequantized(codes, scales) - x.float()).abs()
    assert bool((error <= scales.unsqueeze(-1) * 0.5 * (1 + 1e-5)).all())
    assert not codes[7, 1].any() and float(scales[7, 1]) == 0.0


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_a_position_takes_its_codes_and_scale_bytes(cache_dtype: str) -> None:
    """int8: a code per value and a 4-byte scale per (layer, K or V, KV head); what the pool's
    tensors hold is what it reports (and what sizing from memory counts)."""
    config, _ = model("tiny", BF16)
    pool = KvPool(config, num_blocks=4, block_size=16, dtype=BF16, cache_dtype=cache_dtype)
    row = config.head_dim + 4 if cache_dtype == "int8" else config.head_dim * 2
    per_position = config.num_layers * 2 * config.num_kv_heads * row
    assert pool.bytes_per_position == per_position
    assert bytes_per_position(config, BF16, cache_dtype) == per_position
    assert position_bytes(config, BF16, cache_dtype) == per_position
    assert pool.pool_bytes == 64 * per_position
    tensors = (pool.k, pool.v, pool.k_scale, pool.v_scale)
    assert sum(t.numel() * t.element_size() for t in tensors if t is not None) == pool.pool_bytes


def test_an_unknown_cache_dtype_is_refused() -> None:
    config, _ = model("tiny", BF16)
    with pytest.raises(ValueError, match="KV cache dtype 'fp8'"):
        KvPool(config, 4, 16, BF16, cache_dtype="fp8")


def test_the_torch_store_and_gathers_round_trip_through_the_codes() -> None:
    config, _ = model("tiny", BF16)
    pool = KvPool(config, num_blocks=6, block_size=4, dtype=BF16, cache_dtype="int8")
    gen = torch.Generator().manual_seed(3)
    kv = config.num_kv_heads, config.head_dim
    k = torch.randn(5, *kv, generator=gen).to(BF16)
    v = torch.randn(5, *kv, generator=gen).to(BF16)
    slots = torch.tensor([9, 0, 23, 4, 10])
    pool.store(1, slots, k, v)
    for which, x in (("k", k), ("v", v)):
        codes, scales = quantize_kv(x)
        rows = (slots.unsqueeze(1) * config.num_kv_heads + torch.arange(config.num_kv_heads)).view(
            -1
        )
        got = pool.gather_rows(1, which, rows).view(5, *kv)
        assert got.dtype == BF16
        assert torch.equal(got, dequantized(codes, scales).to(BF16))
        blocks = pool.gather_blocks(1, which, torch.tensor([2, 0])).view(2, 4, *kv)
        assert torch.equal(blocks[1, 0], got[1])  # slot 0: block 0, offset 0
        assert torch.equal(blocks[0, 1], got[0])  # slot 9: block 2, offset 1
        assert torch.equal(blocks[0, 2], got[4])  # slot 10
        assert not blocks[0, 0].any() and not blocks[0, 3].any()
    assert not pool.k[0].any()  # another layer untouched


@needs_kernels
@pytest.mark.parametrize("n", [5, 3000])  # one thread; the rows split over two
def test_the_c_gather_dequantizes_rows_as_torch_does_bit_for_bit(n: int) -> None:
    assert KERNELS is not None
    KERNELS.set_threads(2)
    config, _ = model("tiny", BF16)
    pool = KvPool(config, num_blocks=200, block_size=16, dtype=BF16, cache_dtype="int8")
    gen = torch.Generator().manual_seed(4)
    kv = config.num_kv_heads, config.head_dim
    slots = torch.randperm(pool.num_slots, generator=gen)[:1000]
    pool.store(0, slots, *(torch.randn(1000, *kv, generator=gen).to(BF16) for _ in "kv"))
    rows = torch.randint(0, pool.num_slots * config.num_kv_heads, (n,), generator=gen)
    for which in "kv":
        assert torch.equal(
            pool.gather_rows(0, which, rows, KERNELS), pool.gather_rows(0, which, rows)
        )


@needs_kernels
def test_rope_store_q8_stores_the_codes_quantize_kv_gives_the_rotated_keys() -> None:
    assert KERNELS is not None
    check_rope_store_q8(KERNELS)


def check_rope_store_q8(kernels) -> None:
    """rope_store_q8's codes and scales are quantize_kv's of the keys rope_store rotates (and of
    the values), bit for bit; as_stored by the kernel is torch's."""
    heads, kv_heads, dim, n = 9, 3, 64, 20  # 20 rows: split over threads
    kernels.set_threads(2)
    gen = torch.Generator().manual_seed(1)
    rope = RopeTable(dim, 100000.0, 512, BF16)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(BF16)
    positions = torch.randint(0, 512, (n,), generator=gen)
    slots = torch.randperm(64, generator=gen)[:n]
    k_bf16, v_bf16 = (
        torch.zeros(64, kv_heads, dim, dtype=BF16),
        torch.zeros(64, kv_heads, dim, dtype=BF16),
    )
    q_ref = torch.empty(n, heads, dim, dtype=BF16)
    kernels.rope_store(
        qkv,
        rope.cos,
        rope.sin,
        positions,
        slots,
        q_ref,
        k_bf16.data_ptr(),
        v_bf16.data_ptr(),
        kv_heads,
    )
    codes = {w: torch.zeros(64, kv_heads, dim, dtype=torch.int8) for w in "kv"}
    scales = {w: torch.zeros(64, kv_heads) for w in "kv"}
    for k_out in (None, torch.empty(n, kv_heads, dim, dtype=BF16)):
        q = torch.empty_like(q_ref)
        pools = codes["k"].data_ptr(), codes["v"].data_ptr()
        kernels.rope_store(
            qkv, rope.cos, rope.sin, positions, slots, q, *pools, kv_heads, k_out=k_out,
            scales=(scales["k"].data_ptr(), scales["v"].data_ptr()),
        )  # fmt: skip
        assert torch.equal(q, q_ref)
        if k_out is not None:
            assert torch.equal(k_out, k_bf16[slots])
        for w, ref in (("k", k_bf16), ("v", v_bf16)):
            want_codes, want_scales = quantize_kv(ref[slots])
            assert torch.equal(codes[w][slots], want_codes), w
            assert torch.equal(scales[w][slots], want_scales), w
        untouched = torch.ones(64, dtype=torch.bool)
        untouched[slots] = False
        assert not codes["k"][untouched].any() and not scales["v"][untouched].any()
    x = qkv.view(n, heads + 2 * kv_heads, dim)[:, heads + kv_heads :]
    assert torch.equal(as_stored(x, kernels), as_stored(x))


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32)])
@pytest.mark.parametrize("lengths,block_size", SHAPES)
def test_decode_attention_q8_matches_fp32_attention_on_the_dequantized_pool(
    heads: int, kv_heads: int, dim: int, threads: int, lengths: list[int], block_size: int
) -> None:
    """The shapes of the bf16 kernel's test (a task per KV head below four requests, a task per
    request from four, fixed and dynamic shares), an odd and a long context."""
    assert KERNELS is not None
    check_decode_attention_q8(KERNELS, threads, heads, kv_heads, dim, lengths, block_size)


@needs_kernels
@pytest.mark.parametrize("flags", [["-march=native", "-mno-avx512vnni"], []])
def test_decode_attention_q8_without_vnni_and_without_simd(flags: list[str], tmp_path) -> None:
    """The library built without VNNI (the fp32 SIMD path) and for a generic x86-64 (the scalar
    path): the same codes as torch, the same attention as the fp32 reference."""
    kernels = build_kernels(flags, tmp_path)
    check_rope_store_q8(kernels)
    for lengths, block_size in SHAPES[1:]:
        check_decode_attention_q8(kernels, 2, 9, 3, 64, lengths, block_size)


def check_decode_attention_q8(
    kernels, threads: int, heads: int, kv_heads: int, dim: int, lengths: list[int], block_size: int
) -> None:
    """The kernel over random codes and scales in scattered blocks against fp32 attention over
    code x scale: within the output's bf16 rounding (and the VNNI path's int16 queries and
    probabilities, relative errors below 2e-5)."""
    kernels.set_threads(threads)
    per_request = -(-max(lengths) // block_size)
    num_blocks = per_request * len(lengths) + 3
    gen = torch.Generator().manual_seed(2)
    shape = (num_blocks, block_size, kv_heads, dim)
    k_codes, k_scales = quantize_kv((torch.randn(shape, generator=gen) * 2).to(BF16))
    v_codes, v_scales = quantize_kv(torch.randn(shape, generator=gen).to(BF16))
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(BF16)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.stack(
        [order[i * per_request : (i + 1) * per_request] for i in range(len(lengths))]
    )
    out = torch.empty_like(q)
    kernels.decode_attention(
        q, k_codes.data_ptr(), v_codes.data_ptr(), tables, torch.tensor(lengths), block_size,
        kv_heads, dim**-0.5, out, scales=(k_scales.data_ptr(), v_scales.data_ptr()),
    )  # fmt: skip
    k_all = dequantized(k_codes, k_scales).view(-1, kv_heads, dim)
    v_all = dequantized(v_codes, v_scales).view(-1, kv_heads, dim)
    for r, length in enumerate(lengths):
        slots = tables[r].repeat_interleave(block_size) * block_size
        slots = (slots + torch.arange(block_size).repeat(per_request))[:length]
        k, v = k_all[slots].transpose(0, 1), v_all[slots].transpose(0, 1)  # [kv, len, dim]
        expect = F.scaled_dot_product_attention(q[r].float().unsqueeze(1), k, v, enable_gqa=True)
        error = (out[r].float() - expect.squeeze(1)).abs().max()
        assert error <= 2**-8 * expect.abs().max() + 1e-4 * v.abs().max(), (r, error)


def chunked_then_decoded(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt but its last token in two chunks (the second attends to the first through
    the pool), then one step of every last token beside a fresh prompt's chunk (a mixed step),
    then one decode-only step: the logits of both steps, stacked."""
    tables = []
    for i, ids in enumerate(prompts):
        table = [b + 16 * i for b in scattered_table(64, 4, 16, seed=11 + i)]
        tables.append(table)
        half = (len(ids) - 1) // 2
        runner.compute_logits([WorkItem(str(i), ids[:half], 0, table, sample=False)])
        runner.compute_logits([WorkItem(str(i), ids[half:-1], half, table, sample=False)])
    fresh = [b + 16 * len(prompts) for b in range(16)]
    mixed = [WorkItem(str(i), [ids[-1]], len(ids) - 1, tables[i]) for i, ids in enumerate(prompts)]
    mixed.append(WorkItem("fresh", prompts[0][:9], 0, fresh))
    first = runner.compute_logits(mixed)
    decodes = [WorkItem(str(i), [7], len(ids), tables[i]) for i, ids in enumerate(prompts)]
    return torch.cat([first, runner.compute_logits(decodes)])


@pytest.mark.parametrize("use_kernels", [True, False])
def test_the_model_over_an_int8_pool_stays_close_to_bf16_and_its_two_paths_agree(
    use_kernels: bool,
) -> None:
    """Prompt chunks that read cached context, a mixed step and a decode step, on the tiny
    model: over the int8 pool the logits stay near the bf16 pool's (every argmax the same), and
    the fused kernels' path near the torch path's over the same codes."""
    if use_kernels and KERNELS is None:
        pytest.skip("no C compiler: kernels not built")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (5, 23, 41, 30, 12)]
    config, weights = model("tiny", BF16)
    blocks = 16 * (len(prompts) + 1)

    def runner(cache_dtype: str, kernels: bool) -> ModelRunner:
        return ModelRunner(
            config, weights, blocks, 4, dtype=BF16, use_kernels=kernels, cache_dtype=cache_dtype
        )

    int8 = chunked_then_decoded(runner("int8", use_kernels), prompts)
    bf16 = chunked_then_decoded(runner("auto", use_kernels), prompts)
    scale = bf16.abs().max()
    assert (int8 - bf16).abs().max() < 0.05 * scale
    assert torch.equal(int8.argmax(-1), bf16.argmax(-1))
    if use_kernels:
        plain = chunked_then_decoded(runner("int8", False), prompts)
        assert (int8 - plain).abs().max() < 0.05 * scale
        assert torch.equal(int8.argmax(-1), plain.argmax(-1))


def test_a_prompt_reads_the_same_values_fresh_or_from_a_prefix_cache_hit() -> None:
    """Over an int8 pool a fresh prompt chunk attends to its K/V as the pool holds them, as a
    chunk after a prefix-cache hit reads the cached part: the same prompt gives the same logits
    either way (fp32, where no other rounding differs), as it does over an fp32 pool; attending
    to the unrounded fresh K/V instead would differ by the codes' rounding (about 1e-2 here)."""
    config, weights = model("tiny", torch.float32)
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 49152, (37,), generator=gen).tolist()
    for cache_dtype in ("auto", "int8"):
        runner = ModelRunner(config, weights, 16, 4, dtype=torch.float32, cache_dtype=cache_dtype)
        fresh = runner.compute_logits([WorkItem("a", ids, 0, list(range(10)))])
        # the first 8 blocks (32 positions) as a prefix-cache hit shares them: only 5 computed
        table = list(range(8)) + [10, 11]
        hit = runner.compute_logits([WorkItem("b", ids[32:], 32, table)])
        assert (fresh - hit).abs().max() < 1e-4 * fresh.abs().max(), cache_dtype


@needs_kernels
@pytest.mark.parametrize("n", [5, 100])  # one thread; tokens split over two
def test_the_c_as_stored_rounds_as_torch_does_bit_for_bit(n: int) -> None:
    """On a view with tokens apart (v in the qkv projection's output) and on contiguous rows."""
    assert KERNELS is not None
    KERNELS.set_threads(2)
    gen = torch.Generator().manual_seed(7)
    qkv = (torch.randn(n, 15, 64, generator=gen) * 3).to(BF16)
    qkv[1, 13] = 0  # a zero row
    for x in (qkv[:, 12:], qkv[:, 12:].contiguous()):
        assert torch.equal(as_stored(x, KERNELS), as_stored(x))
    assert KERNELS.as_stored(qkv[:, 12:].transpose(0, 1)) is None  # rows not contiguous: torch's
