"""Per-step attention metadata: which flattened tokens are decodes and which are prefills.

Cached K/V are gathered with one index_select over the pool's rows (one row = one slot's one KV
head, head_dim values): row = slot * kv_heads + kv_head. The row indices are laid out so the
gather lands directly in [batch, kv_heads, context, head_dim] order, ready for batched matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillSpan:
    """A request's multi-token chunk at rows [offset, offset + length) of the flat batch."""

    offset: int
    length: int
    start_position: int  # position of the chunk's first token; 0 means no cached context
    rows: torch.Tensor | None  # [kv_heads * (start + length)] pool rows; None when start == 0
    mask: torch.Tensor | None  # [length, start + length] bool, True = attend; None if start == 0


@dataclass(slots=True)
class AttentionPlan:
    """Rows [0, num_decode) hold single-token items, batched into one padded attention call."""

    num_decode: int
    decode_rows: torch.Tensor  # [num_decode * kv_heads * decode_context] pool rows (pad: row 0)
    decode_bias: torch.Tensor  # [num_decode, 1, 1, decode_context] fp32: 0, or -inf for padding
    decode_context: int  # longest context among the decodes (padded key length)
    prefills: list[PrefillSpan]


def slot_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """slots: [..., context] -> pool rows [..., kv_heads, context] (flattened by the caller)."""
    heads = torch.arange(num_kv_heads).view(num_kv_heads, 1)
    return slots.unsqueeze(-2) * num_kv_heads + heads


def context_slots(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    """Slots of positions 0..length-1 of a request: [length] int64."""
    used = -(-length // block_size)
    blocks = torch.tensor(block_table[:used], dtype=torch.int64)
    slots = blocks.view(used, 1) * block_size + torch.arange(block_size)
    return slots.view(-1)[:length]


def build_plan(
    decodes: list[tuple[int, list[int]]],
    prefills: list[tuple[int, int, int, list[int]]],
    block_size: int,
    num_kv_heads: int,
) -> AttentionPlan:
    """decodes: (context length incl. the new token, block table) per single-token row.
    prefills: (offset, length, start_position, block table) per multi-token chunk."""
    num_decode = len(decodes)
    if num_decode:
        context = max(ctx for ctx, _ in decodes)
        slots = torch.zeros(num_decode, context, dtype=torch.int64)
        lengths = torch.empty(num_decode, dtype=torch.int64)
        for row, (ctx, table) in enumerate(decodes):
            slots[row, :ctx] = context_slots(table, ctx, block_size)
            lengths[row] = ctx
        decode_rows = slot_rows(slots, num_kv_heads).view(-1)  # [decodes * kv * context]
        valid = (torch.arange(context)[None, :] < lengths[:, None]).view(num_decode, 1, 1, context)
        decode_bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))
    else:
        context = 0
        decode_bias = torch.zeros(0, 1, 1, 0)
        decode_rows = torch.zeros(0, dtype=torch.int64)
    spans = []
    for offset, length, start, table in prefills:
        if start == 0:
            spans.append(PrefillSpan(offset, length, 0, None, None))
            continue
        end = start + length
        rows = slot_rows(context_slots(table, end, block_size), num_kv_heads).view(-1)
        mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]  # [length, end]
        spans.append(PrefillSpan(offset, length, start, rows, mask))
    return AttentionPlan(num_decode, decode_rows, decode_bias, context, spans)
