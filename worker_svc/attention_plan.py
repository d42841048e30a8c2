"""Per-step attention metadata: which flattened tokens are decodes and which are prefills."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillSpan:
    """A request's multi-token chunk at rows [offset, offset + length) of the flat batch."""

    offset: int
    length: int
    start_position: int  # position of the chunk's first token; 0 means no cached context
    blocks: torch.Tensor | None  # [blocks covering 0..start+length-1]; None when start == 0
    mask: torch.Tensor | None  # [length, context] bool, True = attend; None when start == 0


@dataclass(slots=True)
class AttentionPlan:
    """Rows [0, num_decode) hold single-token items, batched into one padded attention call."""

    num_decode: int
    decode_blocks: torch.Tensor  # [num_decode * max_blocks] block ids, padded with 0
    decode_bias: torch.Tensor  # [num_decode, 1, 1, max_blocks * block_size] fp32: 0 or -inf
    decode_context: int  # max_blocks * block_size (padded key length)
    prefills: list[PrefillSpan]


def build_plan(
    decodes: list[tuple[int, list[int]]],
    prefills: list[tuple[int, int, int, list[int]]],
    block_size: int,
) -> AttentionPlan:
    """decodes: (context length incl. the new token, block table) per single-token row.
    prefills: (offset, length, start_position, block table) per multi-token chunk."""
    num_decode = len(decodes)
    if num_decode:
        max_blocks = max(-(-ctx // block_size) for ctx, _ in decodes)
        table = torch.zeros(num_decode, max_blocks, dtype=torch.int64)
        lengths = torch.empty(num_decode, dtype=torch.int64)
        for row, (ctx, blocks) in enumerate(decodes):
            used = -(-ctx // block_size)
            table[row, :used] = torch.tensor(blocks[:used], dtype=torch.int64)
            lengths[row] = ctx
        context = max_blocks * block_size
        keys = torch.arange(context)
        valid = (keys[None, :] < lengths[:, None]).view(num_decode, 1, 1, context)
        decode_bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))
        decode_blocks = table.view(-1)
    else:
        context = 0
        decode_bias = torch.zeros(0, 1, 1, 0)
        decode_blocks = torch.zeros(0, dtype=torch.int64)
    spans = []
    for offset, length, start, blocks in prefills:
        if start == 0:
            spans.append(PrefillSpan(offset, length, 0, None, None))
            continue
        end = start + length
        used = -(-end // block_size)
        keys = torch.arange(used * block_size)
        queries = torch.arange(start, end)
        mask = keys[None, :] <= queries[:, None]  # [length, used * block_size]
        spans.append(
            PrefillSpan(offset, length, start, torch.tensor(blocks[:used], dtype=torch.int64), mask)
        )
    return AttentionPlan(num_decode, decode_blocks, decode_bias, context, spans)
