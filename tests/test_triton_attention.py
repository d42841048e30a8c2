"""The Triton paged-attention kernels, run on CPU tensors by Triton's interpreter (the same
kernel source that compiles for the GPU), against torch's SDPA over the same positions; and the
model's forward with the Triton backend forced, against its torch path.

LLMSERVE_KERNEL_TEST_DEVICE=cuda runs the same tests natively on a GPU (scripts/gpu_check.py)."""

from __future__ import annotations

import os

DEVICE_NAME = os.environ.get("LLMSERVE_KERNEL_TEST_DEVICE", "cpu")
if not DEVICE_NAME.startswith("cuda"):
    # @triton.jit reads TRITON_INTERPRET when it decorates, i.e. when the kernels are imported
    os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: no Triton attention to test")
DEVICE = torch.device(DEVICE_NAME)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip(f"{DEVICE_NAME} asked for, but there is no CUDA device", allow_module_level=True)

from tests.model_support import one_torch_thread  # noqa: E402, F401  (autouse fixture)
from worker_svc.kv_pool import quantize_kv  # noqa: E402
from worker_svc.loader import tiny_model  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402
from worker_svc.triton_attention import (  # noqa: E402
    paged_decode_attention,
    paged_prefill_attention,
)
from worker_svc.work import WorkItem  # noqa: E402

NUM_BLOCKS = 48

# (heads, kv_heads, head_dim, block_size): GQA groups 1, 3 (SmolLM2), 4 and 12, block sizes
# that are and are not powers of two
SHAPES = {
    "group1-d64-bs16": (4, 4, 64, 16),
    "group3-d64-bs16": (9, 3, 64, 16),
    "group4-d128-bs5": (8, 2, 128, 5),
    "group12-d64-bs1": (12, 1, 64, 1),
}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # bf16: the output's own rounding


class PagedCache:
    """K and V pools [blocks, block_size, kv_heads, head_dim] whose slots hold random values
    where a request owns them and NaN everywhere else: a kernel that reads past a request's
    context, or through a table's padding (block 0 is never owned), returns NaN."""

    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype, seed: int) -> None:
        _, kv_heads, head_dim, block_size = shape
        self.block_size = block_size
        self.gen = torch.Generator().manual_seed(seed)
        size = (NUM_BLOCKS, block_size, kv_heads, head_dim)
        self.k = torch.full(size, float("nan"), dtype=dtype)
        self.v = torch.full(size, float("nan"), dtype=dtype)
        self.free = (1 + torch.randperm(NUM_BLOCKS - 1, generator=self.gen)).tolist()

    def request(self, length: int) -> list[int]:
        """A scattered block table for positions 0..length-1, their K/V filled in."""
        table = [self.free.pop() for _ in range(-(-length // self.block_size))]
        for position in range(length):
            block, offset = table[position // self.block_size], position % self.block_size
            self.k[block, offset] = torch.randn(self.k.shape[2:], generator=self.gen)
            self.v[block, offset] = torch.randn(self.v.shape[2:], generator=self.gen)
        return table


def padded(tables: list[list[int]]) -> torch.Tensor:
    """[requests, max_blocks] int32 on the test device, padded with block 0."""
    out = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int32)
    for row, table in enumerate(tables):
        out[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return out.to(DEVICE)


def int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def dev(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEVICE)


def reference(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    cache: PagedCache,
    tables: list[list[int]],
    offsets: list[int],
    lengths: list[int],
    starts: list[int],
    scale: float,
) -> torch.Tensor:
    """fp32 [tokens, heads, head_dim]: per request, SDPA over its positions 0..end-1 gathered
    through its table, the query at position p seeing keys 0..p. Rows of no request stay 0."""
    out = torch.zeros(q.shape)
    for table, offset, length, start in zip(tables, offsets, lengths, starts, strict=True):
        positions = torch.arange(start + length)
        blocks = torch.tensor(table)[positions // cache.block_size]
        slots = positions % cache.block_size
        k = cache.k[blocks, slots].float().transpose(0, 1)  # [kv_heads, end, head_dim]
        v = cache.v[blocks, slots].float().transpose(0, 1)
        rows = slice(offset, offset + length)
        qr = q[rows].float().transpose(0, 1)  # [heads, length, head_dim]
        seen = positions[None, :] <= torch.arange(start, start + length)[:, None]
        o = F.scaled_dot_product_attention(
            qr[None], k[None], v[None], attn_mask=seen, scale=scale, enable_gqa=True
        )  # o: [1, heads, length, head_dim]
        out[rows] = o[0].transpose(0, 1)
    return out


def queries(tokens: int, shape: tuple[int, int, int, int], dtype: torch.dtype) -> torch.Tensor:
    heads, _, head_dim, _ = shape
    gen = torch.Generator().manual_seed(tokens)
    return torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)  # [tokens, heads, dim]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape_name, context_lens",
    [
        ("group1-d64-bs16", [1, 16, 17, 40]),
        ("group3-d64-bs16", [5, 64, 65, 130]),  # on and across 32-key tiles
        ("group4-d128-bs5", [1, 9, 70]),
        ("group12-d64-bs1", [3, 20]),
    ],
)
def test_decode_kernel_matches_torch_over_the_block_table(
    shape_name: str, context_lens: list[int], dtype: torch.dtype
) -> None:
    shape = SHAPES[shape_name]
    cache = PagedCache(shape, dtype, seed=len(context_lens))
    tables = [cache.request(n) for n in context_lens]
    q = queries(len(context_lens), shape, dtype)
    scale = shape[2] ** -0.5
    out = paged_decode_attention(
        dev(q), dev(cache.k), dev(cache.v), padded(tables), int32(context_lens), scale
    )  # out: [requests, heads, head_dim]
    n = len(context_lens)
    expect = reference(
        q, cache, tables, list(range(n)), [1] * n, [c - 1 for c in context_lens], scale
    )
    torch.testing.assert_close(
        out.float().cpu(), expect, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


# (start, length) per chunk, packed in this order into one flat batch
CHUNK_BATCHES = [
    pytest.param("group1-d64-bs16", [(0, 37)], id="one-prefill-group1"),
    pytest.param("group3-d64-bs16", [(0, 5), (30, 12), (64, 70), (7, 1)], id="chunks-group3"),
    pytest.param("group4-d128-bs5", [(3, 20), (0, 9), (41, 33)], id="chunks-group4-d128-bs5"),
    pytest.param("group12-d64-bs1", [(10, 6), (0, 4)], id="chunks-group12-bs1"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape_name, chunks", CHUNK_BATCHES)
def test_chunk_kernel_matches_torch_with_causal_masking_over_cached_context(
    shape_name: str, chunks: list[tuple[int, int]], dtype: torch.dtype
) -> None:
    shape = SHAPES[shape_name]
    cache = PagedCache(shape, dtype, seed=len(chunks))
    tables = [cache.request(start + length) for start, length in chunks]  # chunk K/V written
    starts, lengths = [s for s, _ in chunks], [n for _, n in chunks]
    offsets = [sum(lengths[:i]) for i in range(len(chunks))]
    q = queries(sum(lengths), shape, dtype)
    scale = shape[2] ** -0.5
    out = paged_prefill_attention(
        dev(q), dev(cache.k), dev(cache.v), padded(tables), int32(offsets), int32(lengths),
        int32(starts), max(lengths), scale,
    )  # fmt: skip
    expect = reference(q, cache, tables, offsets, lengths, starts, scale)
    torch.testing.assert_close(
        out.float().cpu(), expect, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_each_kernel_writes_only_its_own_rows(dtype: torch.dtype) -> None:
    """The model's layout: decodes in rows [0, 3), then two chunks; both kernels fill one out."""
    shape = SHAPES["group3-d64-bs16"]
    cache = PagedCache(shape, dtype, seed=5)
    context_lens, chunks = [1, 33, 90], [(0, 20), (45, 16)]
    decode_tables = [cache.request(n) for n in context_lens]
    chunk_tables = [cache.request(start + length) for start, length in chunks]
    starts, lengths = [s for s, _ in chunks], [n for _, n in chunks]
    offsets = [3, 23]
    q = queries(3 + sum(lengths), shape, dtype)
    scale = shape[2] ** -0.5
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    k, v = dev(cache.k), dev(cache.v)
    paged_prefill_attention(
        dev(q), k, v, padded(chunk_tables), int32(offsets), int32(lengths), int32(starts),
        max(lengths), scale, out,
    )  # fmt: skip
    assert out[:3].isnan().all()  # the decodes' rows are not the chunk kernel's
    assert not out[3:].isnan().any()
    paged_decode_attention(dev(q), k, v, padded(decode_tables), int32(context_lens), scale, out)
    expect = reference(
        q, cache, decode_tables + chunk_tables, [0, 1, 2, *offsets], [1, 1, 1, *lengths],
        [n - 1 for n in context_lens] + starts, scale,
    )  # fmt: skip
    torch.testing.assert_close(
        out.float().cpu(), expect, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


def quantized(cache: PagedCache) -> tuple[torch.Tensor, ...]:
    """The cache as an int8 pool holds it: (k codes, v codes, k scales, v scales); the slots no
    request owns (NaN) get code 0 and scale NaN, so that reading one still shows."""
    out = []
    for values in (cache.k, cache.v):
        owned = ~values.isnan().any(-1)  # [blocks, block_size, kv_heads]
        codes, scales = quantize_kv(torch.where(owned[..., None], values, 0).float())
        out.append((codes, torch.where(owned, scales, float("nan"))))
    (k_codes, k_scales), (v_codes, v_scales) = out
    return k_codes, v_codes, k_scales, v_scales


def dequantized(cache: PagedCache, parts: tuple[torch.Tensor, ...]) -> PagedCache:
    """A copy of `cache` holding the codes times their scales (fp32), for the reference."""
    k_codes, v_codes, k_scales, v_scales = parts
    copy = PagedCache.__new__(PagedCache)
    copy.block_size = cache.block_size
    copy.k = k_codes.float() * k_scales[..., None]
    copy.v = v_codes.float() * v_scales[..., None]
    return copy


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_kernels_over_an_int8_pool_match_torch_over_its_values(dtype: torch.dtype) -> None:
    """--kv-cache-dtype int8: the codes and a scale per (position, KV head); the kernels equal
    fp32 attention over code x scale (decodes, and chunks over cached context)."""
    shape = SHAPES["group3-d64-bs16"]
    cache = PagedCache(shape, dtype, seed=7)
    context_lens, chunks = [1, 33, 90], [(0, 20), (45, 16)]
    decode_tables = [cache.request(n) for n in context_lens]
    chunk_tables = [cache.request(start + length) for start, length in chunks]
    starts, lengths = [s for s, _ in chunks], [n for _, n in chunks]
    offsets = [3, 23]
    parts = quantized(cache)
    k, v, k_scales, v_scales = (dev(t) for t in parts)
    q = queries(3 + sum(lengths), shape, dtype)
    scale = shape[2] ** -0.5
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    paged_prefill_attention(
        dev(q), k, v, padded(chunk_tables), int32(offsets), int32(lengths), int32(starts),
        max(lengths), scale, out, (k_scales, v_scales),
    )  # fmt: skip
    paged_decode_attention(
        dev(q), k, v, padded(decode_tables), int32(context_lens), scale, out, (k_scales, v_scales)
    )
    expect = reference(
        q, dequantized(cache, parts), decode_tables + chunk_tables, [0, 1, 2, *offsets],
        [1, 1, 1, *lengths], [n - 1 for n in context_lens] + starts, scale,
    )  # fmt: skip
    torch.testing.assert_close(
        out.float().cpu(), expect, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )
    with pytest.raises(ValueError, match="an int8 cache goes with its scales"):
        paged_decode_attention(dev(q), k, v, padded(decode_tables), int32(context_lens), scale)


def mixed_steps() -> list[list[WorkItem]]:
    """Three steps over three requests: a prefill alone with a chunk; decodes mixed with a
    chunk at a nonzero start and a fresh prefill; decodes only."""
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 49152, (n,), generator=gen).tolist()

    a, b, c = [3, 9, 4, 1], [5, 6], [10, 2, 7]
    return [
        [WorkItem("a", ids(5), 0, a, sample=False), WorkItem("b", ids(3), 0, b)],
        [WorkItem("b", ids(1), 3, b), WorkItem("a", ids(7), 5, a), WorkItem("c", ids(9), 0, c)],
        [WorkItem("a", ids(1), 12, a), WorkItem("b", ids(1), 4, b), WorkItem("c", ids(1), 9, c)],
    ]


def forward_logits(
    backend: str, dtype: torch.dtype, monkeypatch, cache_dtype: str = "auto"
) -> list[torch.Tensor]:
    """All-position logits of each of mixed_steps() on the tiny model, one fresh pool."""
    monkeypatch.setenv("LLMSERVE_ATTENTION", backend)
    config, weights = tiny_model(dtype)
    on_gpu = {} if DEVICE.type == "cpu" else {"device": DEVICE}
    runner = ModelRunner(
        config, weights, num_blocks=16, block_size=4, dtype=dtype, cache_dtype=cache_dtype,
        **on_gpu,
    )  # fmt: skip
    return [runner.compute_logits(step, all_positions=True).cpu() for step in mixed_steps()]


def test_model_forward_with_triton_attention_matches_the_torch_path(monkeypatch) -> None:
    torch_logits = forward_logits("torch", torch.float32, monkeypatch)
    triton_logits = forward_logits("triton", torch.float32, monkeypatch)
    for got, expect in zip(triton_logits, torch_logits, strict=True):
        torch.testing.assert_close(got, expect, atol=1e-4, rtol=0)


def test_model_over_an_int8_pool_with_triton_attention_matches_the_torch_path(monkeypatch) -> None:
    """Both read the pool's values: Triton's kernels the codes and scales, the torch path the
    rows dequantized (a fresh chunk its K/V as the pool holds them, kv_pool.as_stored)."""
    torch_logits = forward_logits("torch", torch.float32, monkeypatch, "int8")
    triton_logits = forward_logits("triton", torch.float32, monkeypatch, "int8")
    bf16_pool = forward_logits("torch", torch.float32, monkeypatch)
    for got, expect, unrounded in zip(triton_logits, torch_logits, bf16_pool, strict=True):
        torch.testing.assert_close(got, expect, atol=1e-4, rtol=0)
        assert (got - unrounded).abs().max() > 1e-4  # the int8 pool's rounding did show


def test_model_bf16_forward_with_triton_is_as_close_to_fp32_as_the_torch_path(
    monkeypatch,
) -> None:
    """bf16 differs from fp32 by rounding; the Triton path (fp32 softmax, one rounding at the
    output) may not add to it beyond that of the torch path (fused C kernels for decodes)."""
    fp32 = forward_logits("torch", torch.float32, monkeypatch)
    torch_bf16 = forward_logits("torch", torch.bfloat16, monkeypatch)
    triton_bf16 = forward_logits("triton", torch.bfloat16, monkeypatch)
    for exact, via_torch, via_triton in zip(fp32, torch_bf16, triton_bf16, strict=True):
        torch_error = (via_torch - exact).abs().mean()
        assert (via_triton - exact).abs().mean() <= 1.2 * torch_error
        assert (via_triton - exact).abs().max() <= 1.5 * (via_torch - exact).abs().max()


COMPILE_FOR_H200 = textwrap.dedent(
    """
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from worker_svc.triton_attention import _paged_attention_kernel as kernel
    from worker_svc.triton_attention import kernel_constants, tiles_for

    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16",
             "scale": "fp32"}
    quant_types = {"k_ptr": "*i8", "v_ptr": "*i8", "k_scale_ptr": "*fp32",
                   "v_scale_ptr": "*fp32"}
    for decode, quant in ((True, False), (False, False), (True, True), (False, True)):
        tiles = tiles_for(3, 64, decode)  # SmolLM2: 9 heads over 3 KV heads, head dim 64
        constants = kernel_constants(3, 64, tiles, decode, torch.bfloat16, quant)
        kinds = {**types, **quant_types} if quant else {
            **types, "k_scale_ptr": "*bf16", "v_scale_ptr": "*bf16"}
        signature = {name: kinds.get(name, "*i32" if name.endswith("_ptr") else "i32")
                     for name in kernel.arg_names}
        signature.update({name: "constexpr" for name in constants})
        source = ASTSource(kernel, signature, constexprs=constants)
        options = {"num_warps": tiles.num_warps}
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        print(decode, quant, len(compiled.asm["cubin"]))
    """
)


@pytest.mark.slow
def test_kernels_compile_to_cubin_for_sm90_without_a_gpu() -> None:
    """The interpreter skips the GPU compiler's checks (tl.dot shapes, types across branches):
    lower the four variants (decode or chunks, a bf16 or an int8 pool), at SmolLM2's shapes in
    bf16, through ptxas for an H200 (sm_90)."""
    pytest.importorskip("triton.backends.nvidia", reason="triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_H200],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    cubins = [line.split() for line in done.stdout.splitlines()]
    assert [(decode, quant) for decode, quant, _ in cubins] == [
        ("True", "False"), ("False", "False"), ("True", "True"), ("False", "True")
    ]  # fmt: skip
    assert all(int(size) > 0 for _, _, size in cubins)
