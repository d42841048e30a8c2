"""Per-step attention metadata: which flattened tokens are decodes and which are prefills.

Decodes gather their cached K/V by whole blocks (index_select of contiguous
[block_size, kv_heads, head_dim] chunks); a prefill over cached context gathers rows (one row =
one slot's one KV head: row = slot * kv_heads + kv_head), ordered so that the gather lands in
[kv_heads, context, head_dim] order for SDPA. The Triton kernels read the block tables instead:
`paged_batch` puts them, padded, in int32 tensors on the model's device, once per step.
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
    block_table: list[int]  # the request's blocks (at least those of positions < start + length)


@dataclass(slots=True)
class AttentionPlan:
    """Rows [0, num_decode) hold single-token items, batched into one padded attention call."""

    num_decode: int
    decode_blocks: torch.Tensor  # [num_decode * max_blocks] block ids (padding: block 0)
    decode_bias: torch.Tensor  # [num_decode, 1, decode_context] fp32: 0, or -inf for padding
    decode_context: int  # max_blocks * block_size (padded key length)
    decode_lengths: torch.Tensor  # [num_decode] int64: cached positions incl. the new token
    prefills: list[PrefillSpan]

    def to(self, device: torch.device) -> AttentionPlan:
        """The plan's tensors on `device` (itself when they are there already)."""
        if self.decode_blocks.device == device:
            return self
        move = {"device": device, "non_blocking": True}
        spans = [
            PrefillSpan(
                s.offset, s.length, s.start_position,
                None if s.rows is None else s.rows.to(**move),
                None if s.mask is None else s.mask.to(**move),
                s.block_table,
            )
            for s in self.prefills
        ]  # fmt: skip
        return AttentionPlan(
            self.num_decode,
            self.decode_blocks.to(**move),
            self.decode_bias.to(**move),
            self.decode_context,
            self.decode_lengths.to(**move),
            spans,
        )


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
        max_blocks = max(-(-ctx // block_size) for ctx, _ in decodes)
        table = torch.zeros(num_decode, max_blocks, dtype=torch.int64)
        lengths = torch.empty(num_decode, dtype=torch.int64)
        for row, (ctx, blocks) in enumerate(decodes):
            used = -(-ctx // block_size)
            table[row, :used] = torch.tensor(blocks[:used], dtype=torch.int64)
            lengths[row] = ctx
        context = max_blocks * block_size
        valid = (torch.arange(context)[None, :] < lengths[:, None]).view(num_decode, 1, context)
        decode_bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))
        decode_blocks = table.view(-1)
    else:
        context = 0
        decode_bias = torch.zeros(0, 1, 0)
        decode_blocks = torch.zeros(0, dtype=torch.int64)
        lengths = torch.zeros(0, dtype=torch.int64)
    spans = []
    for offset, length, start, table in prefills:
        if start == 0:
            spans.append(PrefillSpan(offset, length, 0, None, None, table))
            continue
        end = start + length
        rows = slot_rows(context_slots(table, end, block_size), num_kv_heads).view(-1)
        mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]  # [length, end]
        spans.append(PrefillSpan(offset, length, start, rows, mask, table))
    return AttentionPlan(num_decode, decode_blocks, decode_bias, context, lengths, spans)


@dataclass(slots=True)
class PagedBatch:
    """The step's requests as the Triton kernels read them: int32, on the model's device."""

    decode_tables: torch.Tensor  # [num_decode, max_blocks] (padding: block 0)
    decode_lengths: torch.Tensor  # [num_decode] cached positions incl. the new token
    chunk_tables: torch.Tensor  # [chunks, max_blocks] (padding: block 0)
    chunk_offsets: torch.Tensor  # [chunks] row of the chunk's first token in the flat batch
    chunk_lengths: torch.Tensor  # [chunks] tokens in the chunk
    chunk_starts: torch.Tensor  # [chunks] position of the chunk's first token
    max_chunk_length: int


def paged_batch(plan: AttentionPlan, block_size: int, device: torch.device) -> PagedBatch:
    """The plan's block tables and lengths for the paged kernels: the decodes' cast where the
    plan's tensors are, the chunks' built on the host and sent in one copy."""
    nd, spans = plan.num_decode, plan.prefills
    decode_tables = plan.decode_blocks.view(nd, -1) if nd else plan.decode_blocks.view(0, 1)
    width = max((-(-(s.start_position + s.length) // block_size) for s in spans), default=1)
    chunk_tables = torch.zeros(len(spans), width, dtype=torch.int32)
    for row, span in enumerate(spans):
        used = -(-(span.start_position + span.length) // block_size)
        chunk_tables[row, :used] = torch.tensor(span.block_table[:used], dtype=torch.int32)
    chunks = [(s.offset, s.length, s.start_position) for s in spans]
    chunk_info = torch.tensor(chunks, dtype=torch.int32).view(len(spans), 3)  # [chunks, 3]
    flat = torch.cat([chunk_tables.view(-1), chunk_info.T.reshape(-1)]).to(device)
    tables, info = flat.split([chunk_tables.numel(), chunk_info.numel()])
    offsets, lengths, starts = info.view(3, len(spans))  # each [chunks], contiguous
    return PagedBatch(
        decode_tables.to(device, torch.int32),
        plan.decode_lengths.to(device, torch.int32),
        tables.view(chunk_tables.shape),
        offsets,
        lengths,
        starts,
        max((s.length for s in spans), default=0),
    )
