"""CUDA graphs for decode steps: a decode batch of n requests runs as the graph captured for the
smallest bucket >= n, its inputs copied into static buffers and the rest padded. Capture is once
per bucket, after the KV pool is allocated (a graph records the pool's addresses).

The bucketing and the static buffers are plain torch and are tested on the CPU; only the
capture itself (`torch.cuda.graph`) needs a GPU."""

from __future__ import annotations

from collections.abc import Callable

import torch

DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def bucket_for(n: int, buckets: tuple[int, ...] = DECODE_BUCKETS) -> int | None:
    """The smallest bucket that holds n rows; None when n is beyond the largest (run eagerly)."""
    for b in buckets:
        if b >= n:
            return b
    return None


class StaticDecodeInputs:
    """The buffers a captured decode graph reads, sized for the largest bucket. A padded row
    decodes a dummy token at position 0 of `scratch_block` (a block no request owns: the pool
    keeps one aside) over a context of one position, so it never touches a request's KV."""

    def __init__(
        self,
        max_rows: int,
        max_blocks: int,
        scratch_block: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * block_size
        i64 = {"dtype": torch.int64, "device": device}
        self.token_ids = torch.zeros(max_rows, **i64)  # [rows]
        self.positions = torch.zeros(max_rows, **i64)  # [rows]
        self.slots = torch.zeros(max_rows, **i64)  # [rows]
        self.block_tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(max_rows, dtype=torch.int32, device=device)  # [rows]
        self.pad(0, max_rows)

    def fill(
        self,
        bucket: int,
        token_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        slots: torch.Tensor,  # [n] int64
        block_tables: torch.Tensor,  # [n, blocks] int32, blocks <= max_blocks
        context_lens: torch.Tensor,  # [n] int32
    ) -> None:
        """Copy a batch of n <= bucket rows in (host tensors may be pinned: the copies do not
        wait); rows n..bucket become padding."""
        n, blocks = block_tables.shape
        if n > bucket or bucket > self.max_rows or blocks > self.max_blocks:
            raise ValueError(f"{n} rows x {blocks} blocks do not fit bucket {bucket}")
        self.token_ids[:n].copy_(token_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(slots, non_blocking=True)
        self.block_tables[:n, :blocks].copy_(block_tables, non_blocking=True)
        self.block_tables[:n, blocks:].zero_()
        self.context_lens[:n].copy_(context_lens, non_blocking=True)
        self.pad(n, bucket)

    def pad(self, start: int, end: int) -> None:
        self.token_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slots[start:end].fill_(self.scratch_slot)
        self.block_tables[start:end].zero_()
        self.block_tables[start:end, 0] = self.scratch_block
        self.context_lens[start:end].fill_(1)


class DecodeGraphs:
    """One captured graph per bucket, made on first use. `step(inputs, rows)` runs the decode
    forward over the first `rows` of the static inputs and returns the logits [rows, vocab];
    on a GPU it is captured once per bucket and then replayed; elsewhere it is simply called."""

    def __init__(
        self,
        inputs: StaticDecodeInputs,
        step: Callable[[StaticDecodeInputs, int], torch.Tensor],
        device: torch.device,
        buckets: tuple[int, ...] = DECODE_BUCKETS,
    ) -> None:
        self.inputs, self.step, self.device = inputs, step, device
        self.buckets = tuple(b for b in buckets if b <= inputs.max_rows)
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}  # bucket -> (graph, logits)
        self.captures = 0

    @property
    def capturing(self) -> bool:
        return self.device.type == "cuda"

    def run(self, n: int, **batch: torch.Tensor) -> torch.Tensor | None:
        """The logits of a decode batch of n rows, or None when n exceeds every bucket (the
        caller runs it eagerly)."""
        bucket = bucket_for(n, self.buckets)
        if bucket is None:
            return None
        self.inputs.fill(bucket, **batch)
        if bucket not in self.graphs:
            self.graphs[bucket] = self.capture(bucket)
        graph, logits = self.graphs[bucket]
        if graph is None:
            logits = self.step(self.inputs, bucket)
        else:
            graph.replay()
        return logits[:n]

    def capture(self, bucket: int) -> tuple[object, torch.Tensor]:
        self.captures += 1
        if not self.capturing:
            return None, torch.empty(0)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm up outside the graph (allocator, autotuning)
            self.step(self.inputs, bucket)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.step(self.inputs, bucket)
        return graph, logits
