"""CUDA graphs for steps: decode-only steps, and steps with chunks beside the decodes: prompt
chunks, and drafts (speculative decoding: a request's last token and its draft, every position
scored). A step of d decodes and c chunks of t tokens in all, which want l logit rows, runs as
the graph captured for its shape's buckets (d, t, c and l each rounded up), its inputs copied
into static buffers and the rest padded; a step beyond the largest buckets runs eagerly.
Capture is once per shape, on first use, after the KV pool is allocated (a graph records the
pool's addresses).

Why mixed steps too: on a GPU an eager step of a small model is bound by the host launching
its ~600 kernels (docs/gpu.md: 19.6 ms for 255 decodes + a 16-token prompt on an H200, of which
2.1 ms on the GPU), under load almost every step admits a prompt, and a draft's step eagerly
would cost several plain steps by graph.

The bucketing and the static buffers are plain torch and are tested on the CPU; only the
capture itself (`torch.cuda.graph`) needs a GPU."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
CHUNK_TOKEN_BUCKETS = (16, 32, 64, 128, 256)  # a step's prompt-chunk tokens, all chunks together
CHUNK_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # a step's chunks (prompt chunks and drafts)
CHUNK_LOGIT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # their logit rows (a draft's: 1 + k)


def bucket_for(n: int, buckets: tuple[int, ...] = DECODE_BUCKETS) -> int | None:
    """The smallest bucket that holds n rows; None when n is beyond the largest (run eagerly)."""
    for b in buckets:
        if b >= n:
            return b
    return None


@dataclass(frozen=True, slots=True)
class GraphShape:
    """A graph's key: decode rows, chunk tokens, chunks and the chunks' logit rows, each a
    bucket (or 0). Its flat batch is the decode rows, then the chunks' tokens."""

    decodes: int
    chunk_tokens: int
    chunks: int
    chunk_logits: int = 0

    @property
    def tokens(self) -> int:
        return self.decodes + self.chunk_tokens

    @property
    def logit_rows(self) -> int:
        """Every decode row's, then each chunk's last rows' (its last token's, a draft's last
        1 + k)."""
        return self.decodes + self.chunk_logits


def shape_for(
    decodes: int,
    chunk_tokens: int,
    chunks: int,
    chunk_logits: int = -1,
    decode_buckets: tuple[int, ...] = DECODE_BUCKETS,
    token_buckets: tuple[int, ...] = CHUNK_TOKEN_BUCKETS,
    chunk_buckets: tuple[int, ...] = CHUNK_BUCKETS,
    logit_buckets: tuple[int, ...] = CHUNK_LOGIT_BUCKETS,
) -> GraphShape | None:
    """The graph a step of this size runs as; None when a part is beyond its largest bucket.
    chunk_logits: the chunks' logit rows (-1: one each)."""
    chunk_logits = chunks if chunk_logits < 0 else chunk_logits
    d = bucket_for(decodes, decode_buckets) if decodes else 0
    t = bucket_for(chunk_tokens, token_buckets) if chunks else 0
    c = bucket_for(chunks, chunk_buckets) if chunks else 0
    r = bucket_for(chunk_logits, logit_buckets) if chunks else 0
    if d is None or t is None or c is None or r is None or not d + c:
        return None
    return GraphShape(d, t, c, r)


@dataclass(slots=True)
class StepBatch:
    """A step as host tensors: the decodes (one token each), then the chunks (prompt chunks and
    drafts)."""

    token_ids: torch.Tensor  # [decodes + chunk tokens] int64
    positions: torch.Tensor  # [decodes + chunk tokens] int64
    slots: torch.Tensor  # [decodes + chunk tokens] int64
    block_tables: torch.Tensor  # [decodes, blocks] int32
    context_lens: torch.Tensor  # [decodes] int32: cached positions incl. the new token
    chunk_tables: torch.Tensor  # [chunks, blocks] int32
    chunk_lengths: torch.Tensor  # [chunks] int32: tokens in each chunk
    chunk_starts: torch.Tensor  # [chunks] int32: position of each chunk's first token
    chunk_logits: torch.Tensor  # [chunks] int64: logit rows of each (1; a draft's 1 + k)

    @property
    def decodes(self) -> int:
        return self.block_tables.shape[0]

    @property
    def chunks(self) -> int:
        return self.chunk_tables.shape[0]

    @property
    def chunk_tokens(self) -> int:
        return self.token_ids.shape[0] - self.decodes

    @property
    def chunk_logit_rows(self) -> int:
        return int(self.chunk_logits.sum())


def decode_batch(
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> StepBatch:
    """A decode-only step."""
    none = torch.zeros(0, dtype=torch.int32)
    return StepBatch(
        token_ids, positions, slots, block_tables, context_lens, none.view(0, 1), none, none,
        none.long(),
    )  # fmt: skip


class StaticStepInputs:
    """The buffers a captured graph reads, sized for the largest buckets. Padding decodes a
    dummy token at position 0 of `scratch_block` (a block no request owns: the pool keeps one
    aside) over a context of one position; padded chunk tokens write the same scratch slot and
    no chunk reads them; padded chunks have no tokens. So padding never touches a request's KV.
    `logits` is where every graph leaves its output (the graphs share one memory pool)."""

    def __init__(
        self,
        max_rows: int,
        max_blocks: int,
        scratch_block: int,
        block_size: int,
        device: torch.device,
        max_chunk_tokens: int = 0,
        max_chunks: int = 0,
        max_chunk_logits: int = 0,
    ) -> None:
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self.max_chunk_tokens, self.max_chunks = max_chunk_tokens, max_chunks
        self.max_chunk_logits = max_chunk_logits
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * block_size
        tokens = max_rows + max_chunk_tokens
        i64 = {"dtype": torch.int64, "device": device}
        i32 = {"dtype": torch.int32, "device": device}
        self.token_ids = torch.zeros(tokens, **i64)  # [tokens]: the decodes, then chunk tokens
        self.positions = torch.zeros(tokens, **i64)
        self.slots = torch.zeros(tokens, **i64)
        self.block_tables = torch.zeros(max_rows, max_blocks, **i32)
        self.context_lens = torch.ones(max_rows, **i32)
        self.chunk_tables = torch.zeros(max_chunks, max_blocks, **i32)
        self.chunk_offsets = torch.zeros(max_chunks, **i32)  # row of a chunk's first token
        self.chunk_lengths = torch.zeros(max_chunks, **i32)
        self.chunk_starts = torch.zeros(max_chunks, **i32)
        self.logit_rows = torch.zeros(max_rows + max_chunk_logits, **i64)
        self.decode_rows = torch.arange(max_rows, **i64)  # decode row i's logits are row i
        self.logits: torch.Tensor | None = None  # [max_rows + max_chunk_logits, vocab]
        self.pad_decodes(0, max_rows)
        self.pad_tokens(max_rows, tokens)

    def fill(self, shape: GraphShape, batch: StepBatch) -> None:
        """Copy the batch in (host tensors may be pinned: the copies do not wait); the rest of
        the shape becomes padding."""
        n, c, t, r = batch.decodes, batch.chunks, batch.chunk_tokens, batch.chunk_logit_rows
        blocks = max(batch.block_tables.shape[1], batch.chunk_tables.shape[1])
        if (
            n > shape.decodes or c > shape.chunks or t > shape.chunk_tokens
            or r > shape.chunk_logits or shape.decodes > self.max_rows
            or shape.chunks > self.max_chunks or shape.chunk_tokens > self.max_chunk_tokens
            or shape.chunk_logits > self.max_chunk_logits or blocks > self.max_blocks
        ):  # fmt: skip
            raise ValueError(
                f"{n} decodes, {c} chunks of {t} tokens ({r} logit rows) x {blocks} blocks "
                f"do not fit {shape}"
            )
        d = shape.decodes
        copy = {"non_blocking": True}
        self.token_ids[:n].copy_(batch.token_ids[:n], **copy)
        self.positions[:n].copy_(batch.positions[:n], **copy)
        self.slots[:n].copy_(batch.slots[:n], **copy)
        width = batch.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(batch.block_tables, **copy)
        self.block_tables[:n, width:].zero_()
        self.context_lens[:n].copy_(batch.context_lens, **copy)
        self.pad_decodes(n, d)
        self.logit_rows[:d].copy_(self.decode_rows[:d])  # a mixed step's chunks wrote there
        if not shape.chunks:
            return
        self.token_ids[d : d + t].copy_(batch.token_ids[n:], **copy)
        self.positions[d : d + t].copy_(batch.positions[n:], **copy)
        self.slots[d : d + t].copy_(batch.slots[n:], **copy)
        self.pad_tokens(d + t, shape.tokens)
        width = batch.chunk_tables.shape[1]
        self.chunk_tables[:c, :width].copy_(batch.chunk_tables, **copy)
        self.chunk_tables[:c, width:].zero_()
        self.chunk_tables[c : shape.chunks].zero_()
        lengths = batch.chunk_lengths.to(torch.int64)
        offsets = d + torch.cumsum(lengths, 0) - lengths  # host arithmetic, [c]
        self.chunk_offsets[:c].copy_(offsets, **copy)
        self.chunk_lengths[:c].copy_(batch.chunk_lengths, **copy)
        self.chunk_starts[:c].copy_(batch.chunk_starts, **copy)
        self.chunk_lengths[c : shape.chunks].zero_()  # no tokens: the kernel skips them
        # each chunk's logit rows: its last k tokens (k = 1; a draft's 1 + drafted)
        ends = (offsets + lengths).tolist()
        rows = [row for end, k in zip(ends, batch.chunk_logits.tolist(), strict=True)
                for row in range(end - k, end)]  # fmt: skip
        self.logit_rows[d : d + r].copy_(torch.tensor(rows, dtype=torch.int64), **copy)
        self.logit_rows[d + r : d + shape.chunk_logits].zero_()

    def pad_decodes(self, start: int, end: int) -> None:
        self.pad_tokens(start, end)
        self.block_tables[start:end].zero_()
        self.block_tables[start:end, 0] = self.scratch_block
        self.context_lens[start:end].fill_(1)

    def pad_tokens(self, start: int, end: int) -> None:
        self.token_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slots[start:end].fill_(self.scratch_slot)


class StepGraphs:
    """One captured graph per shape, made on first use. `step(inputs, shape)` runs the forward
    over the shape's part of the static inputs and returns its logits [shape.logit_rows, vocab];
    on a GPU it is captured once per shape and then replayed; elsewhere it is simply called."""

    def __init__(
        self,
        inputs: StaticStepInputs,
        step: Callable[[StaticStepInputs, GraphShape], torch.Tensor],
        device: torch.device,
        buckets: tuple[int, ...] = DECODE_BUCKETS,
        token_buckets: tuple[int, ...] = CHUNK_TOKEN_BUCKETS,
        chunk_buckets: tuple[int, ...] = CHUNK_BUCKETS,
        logit_buckets: tuple[int, ...] = CHUNK_LOGIT_BUCKETS,
    ) -> None:
        self.inputs, self.step, self.device = inputs, step, device
        self.buckets = tuple(b for b in buckets if b <= inputs.max_rows)
        self.token_buckets = tuple(b for b in token_buckets if b <= inputs.max_chunk_tokens)
        self.chunk_buckets = tuple(b for b in chunk_buckets if b <= inputs.max_chunks)
        self.logit_buckets = tuple(b for b in logit_buckets if b <= inputs.max_chunk_logits)
        self.graphs: dict[GraphShape, object] = {}
        self.captures = 0
        self.pool = torch.cuda.graph_pool_handle() if self.capturing else None

    @property
    def capturing(self) -> bool:
        return self.device.type == "cuda"

    def shape_of(
        self, decodes: int, chunk_tokens: int, chunks: int, chunk_logits: int
    ) -> GraphShape | None:
        """The graph a step of these sizes runs as, or None (it runs eagerly)."""
        return shape_for(
            decodes, chunk_tokens, chunks, chunk_logits,
            self.buckets, self.token_buckets, self.chunk_buckets, self.logit_buckets,
        )  # fmt: skip

    def shape(self, batch: StepBatch) -> GraphShape | None:
        return self.shape_of(
            batch.decodes, batch.chunk_tokens, batch.chunks, batch.chunk_logit_rows
        )

    def run(self, batch: StepBatch, rows: list[int] | None = None) -> torch.Tensor | None:
        """The step's logits: its decodes' rows, then each chunk's (its last token's, a draft's
        last 1 + k), or only `rows` of those, in that order (one gather); None when the step
        fits no graph (the caller runs it eagerly). The rows are overwritten by the next step:
        read them first."""
        shape = self.shape(batch)
        if shape is None:
            return None
        self.inputs.fill(shape, batch)
        if shape not in self.graphs:
            self.graphs[shape] = self.capture(shape)
        graph = self.graphs[shape]
        if graph is None:
            logits = self.step(self.inputs, shape)
        else:
            graph.replay()
            logits = self.inputs.logits
        n, pad = batch.decodes, shape.decodes - batch.decodes  # chunks' rows follow padding
        if rows is None:
            rows = list(range(n + batch.chunk_logit_rows))
        keep = [r if r < n else r + pad for r in rows]
        if keep == list(range(len(keep))):
            return logits[: len(keep)]
        return logits[torch.tensor(keep, device=logits.device)]

    def capture(self, shape: GraphShape) -> object:
        """The shape's graph (None where nothing is captured: the step is called each time).
        Its logits land in `inputs.logits`, outside the graphs' shared pool."""
        self.captures += 1
        if not self.capturing:
            return None
        started = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm up outside the graph (allocator, autotuning)
            logits = self.step(self.inputs, shape)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.inputs.logits is None:
            rows = self.inputs.max_rows + self.inputs.max_chunk_logits
            self.inputs.logits = torch.empty(
                rows, logits.shape[-1], dtype=logits.dtype, device=logits.device
            )
        out = self.inputs.logits[: shape.logit_rows]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out.copy_(self.step(self.inputs, shape))
        # a capture holds its step up: say so (a ramp of new shapes shows in the step times)
        took = time.perf_counter() - started
        log.info("captured %s in %.0f ms (%d graphs)", shape, 1e3 * took, self.captures)
        return graph
