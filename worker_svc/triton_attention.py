"""Paged attention in Triton: each query row reads its request's K/V through the block table.

One kernel serves both entry points. A program takes a tile of one request's query tokens and,
for one KV head, every query head that reads it (GQA: rows = token * group + head in group, so
a group of 3 fills 3 of the tile's rows per token); it walks the request's key positions in tiles
of BLOCK_N, looking up each position's block in the table (any block size works), and keeps an
online softmax in fp32. Causal: the query at position p sees keys 0..p, and keys beyond the
tile's last query are never read. The chunk's own K/V must already be in the pool.

An int8 pool (--kv-cache-dtype int8, QUANT) holds codes and a scale per (position, KV head): the
dots take the codes (small integers, exact in TF32), each key's scale multiplies its column of
scores and each value row's scale its column of probabilities.

Every load is widened to fp32 before any arithmetic (Triton's CPU interpreter computes bf16 as
raw integers, so this is also what lets the tests here run the shipped kernel). For 16-bit
caches the dots run as TF32, which holds bf16 and fp16 values exactly; fp32 caches get IEEE dots.

Importing this module imports triton: the model imports it only once attention_backend has
chosen Triton. TRITON_INTERPRET=1 must be set before the first import to run on CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [tokens, heads, head_dim]
    k_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    v_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    k_scale_ptr,  # QUANT: [num_blocks, block_size, kv_heads] fp32 (k_ptr holds int8 codes)
    v_scale_ptr,  # QUANT: the same for v
    out_ptr,  # [tokens, heads, head_dim]
    tables_ptr,  # [requests, max_blocks] int32
    lengths_ptr,  # [requests] int32: query tokens, or (DECODE) context length incl. the query
    offsets_ptr,  # [requests] int32: row of the first query token (unused when DECODE)
    starts_ptr,  # [requests] int32: position of the first query token (unused when DECODE)
    scale,
    block_size,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_s_block,  # QUANT: the scales' strides (K's and V's alike)
    stride_s_slot,
    stride_s_head,
    stride_table,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_Q: tl.constexpr,  # query tokens per program (BLOCK_M // GROUP at most)
    BLOCK_N: tl.constexpr,  # key positions per loop step
    DECODE: tl.constexpr,  # one query per request, at the last context position, row = request
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 queries, "tf32" for 16-bit ones
    QUANT: tl.constexpr,  # an int8 pool: codes times a scale per (position, KV head)
):
    request = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_Q  # the tile's first query token within the request
    kv_head = tl.program_id(2)
    if DECODE:
        length = 1
        offset = request
        start = tl.load(lengths_ptr + request) - 1
    else:
        length = tl.load(lengths_ptr + request)
        offset = tl.load(offsets_ptr + request)
        start = tl.load(starts_ptr + request)
    if first < length:
        rows = tl.arange(0, BLOCK_M)
        token = first + rows // GROUP  # [BLOCK_M] query token within the request
        head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
        row_valid = (rows < BLOCK_Q * GROUP) & (token < length)
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < HEAD_DIM
        row = (offset + token).to(tl.int64)
        q_rows = q_ptr + row[:, None] * stride_q_token + head[:, None] * stride_q_head
        q_mask = row_valid[:, None] & dim_valid[None, :]
        q = tl.load(q_rows + dims[None, :], mask=q_mask, other=0.0).to(tl.float32)  # [M, D]
        position = start + token  # [BLOCK_M]
        qk_scale = scale * 1.4426950408889634  # log2(e): exp2 below instead of exp
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 units)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        key_end = start + tl.minimum(first + BLOCK_Q, length)  # one past the tile's last query
        table = tables_ptr + request.to(tl.int64) * stride_table
        for key_first in range(0, key_end, BLOCK_N):
            keys = key_first + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
            key_valid = keys < key_end
            block = tl.load(table + keys // block_size, mask=key_valid, other=0).to(tl.int64)
            slot_in_block = keys % block_size
            kv_mask = key_valid[:, None] & dim_valid[None, :]
            k_rows = k_ptr + block * stride_k_block + slot_in_block * stride_k_slot
            k_rows += kv_head * stride_k_head
            k = tl.load(k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            k = k.to(tl.float32)  # [N, D]
            v_rows = v_ptr + block * stride_v_block + slot_in_block * stride_v_slot
            v_rows += kv_head * stride_v_head
            v = tl.load(v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            v = v.to(tl.float32)  # [N, D]
            if QUANT:  # the codes' dot products (exact in tf32), times each key's scale
                s_rows = block * stride_s_block + slot_in_block * stride_s_slot
                s_rows += kv_head * stride_s_head
                k_scale = tl.load(k_scale_ptr + s_rows, mask=key_valid, other=0.0)  # [N]
                v_scale = tl.load(v_scale_ptr + s_rows, mask=key_valid, other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
                s = s * (k_scale * qk_scale)[None, :]  # [M, N]
            else:
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
            seen = key_valid[None, :] & (keys[None, :] <= position[:, None])
            s = tl.where(seen, s, float("-inf"))
            # key 0 is seen by every row in the first step, so m_new is finite from then on
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)  # [M] rescales what was summed so far
            p = tl.exp2(s - m_new[:, None])  # [M, N]
            l_i = l_i * alpha + tl.sum(p, 1)
            if QUANT:  # each value row's scale folded into its probabilities
                pv = tl.dot(p * v_scale[None, :], v, input_precision=DOT_PRECISION)
            else:
                pv = tl.dot(p, v, input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        acc = acc / l_i[:, None]
        o_rows = out_ptr + row[:, None] * stride_o_token + head[:, None] * stride_o_head
        tl.store(o_rows + dims[None, :], acc.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode_attention(
    q: torch.Tensor,  # [requests, heads, head_dim], one query per request
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [requests, max_blocks] int32
    context_lens: torch.Tensor,  # [requests] int32, cached positions incl. the query's own
    scale: float,
    out: torch.Tensor | None = None,  # [requests, heads, head_dim]; rows [0, requests) written
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an int8 pool's K, V scales
) -> torch.Tensor:
    """Each request's query (at position context_len - 1) against its whole cached context.
    With `scales` ([num_blocks, block_size, kv_heads] fp32 each), the caches hold int8 codes."""
    out = torch.empty_like(q) if out is None else out
    _launch(q, k_cache, v_cache, out, block_tables, context_lens, None, None, 1, scale, scales)
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim], the flat batch
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [chunks, max_blocks] int32
    query_offsets: torch.Tensor,  # [chunks] int32, the chunk's first row in q
    query_lens: torch.Tensor,  # [chunks] int32, tokens in the chunk
    start_positions: torch.Tensor,  # [chunks] int32, position of the chunk's first token
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [tokens, heads, head_dim]; only the chunks' rows written
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an int8 pool's K, V scales
) -> torch.Tensor:
    """Chunks of several requests: each token attends causally within its chunk and fully to
    its request's positions before the chunk (chunked prefill, recompute). With `scales`, as
    paged_decode_attention's."""
    out = torch.empty_like(q) if out is None else out
    _launch(
        q, k_cache, v_cache, out, block_tables, query_lens, query_offsets, start_positions,
        max_query_len, scale, scales,
    )  # fmt: skip
    return out


@dataclass(frozen=True, slots=True)
class Tiles:
    """A launch's tile sizes: rows are query tokens × the group's heads."""

    rows: int  # BLOCK_M
    tokens: int  # BLOCK_Q: query tokens per program
    keys: int  # BLOCK_N: key positions per loop step
    num_warps: int


def tiles_for(group: int, head_dim: int, decode: bool) -> Tiles:
    """No register spills on sm_90 at head dims 64 and 128 (ptxas -v on the compiled kernel,
    docs/gpu.md); not yet timed on a GPU. 16 rows is the smallest tl.dot operand."""
    if decode:
        return Tiles(max(16, triton.next_power_of_2(group)), 1, 32, 4)
    rows = max(64, triton.next_power_of_2(group))
    return Tiles(rows, rows // group, 64 if head_dim <= 64 else 32, 8)


def kernel_constants(
    group: int, head_dim: int, tiles: Tiles, decode: bool, dtype: torch.dtype, quant: bool = False
) -> dict[str, int | bool | str]:
    """The kernel's compile-time arguments (what a launch passes, and what the tests compile);
    dtype: the queries' (and a 16-bit pool's)."""
    return {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "BLOCK_D": triton.next_power_of_2(max(head_dim, 16)),
        "BLOCK_M": tiles.rows,
        "BLOCK_Q": tiles.tokens,
        "BLOCK_N": tiles.keys,
        "DECODE": decode,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "QUANT": quant,
    }


def group_size(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} KV heads evenly")
    return heads // kv_heads


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor | None,  # None: decode (row = request, one query at the end)
    starts: torch.Tensor | None,
    max_query_len: int,
    scale: float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    requests, head_dim, kv_heads = tables.shape[0], q.shape[2], k_cache.shape[2]
    if requests == 0 or max_query_len == 0:
        return
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head dimension must be contiguous")
    decode, group = offsets is None, group_size(q, k_cache)
    if (scales is not None) != (k_cache.dtype == torch.int8):
        raise ValueError("an int8 cache goes with its scales, and only an int8 cache")
    k_scale, v_scale = scales if scales is not None else (k_cache, v_cache)  # unread if not QUANT
    s_strides = k_scale.stride()[:3] if scales is not None else (0, 0, 0)
    tiles = tiles_for(group, head_dim, decode)
    grid = (requests, triton.cdiv(max_query_len, tiles.tokens), kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, out, tables, lengths,
        lengths if decode else offsets, lengths if decode else starts,
        scale, k_cache.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *s_strides,
        tables.stride(0),
        **kernel_constants(group, head_dim, tiles, decode, q.dtype, scales is not None),
        num_warps=tiles.num_warps,
    )  # fmt: skip
