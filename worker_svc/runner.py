"""Runs one scheduler step: a mix of prefill chunks and decodes, flattened into one batch."""

from __future__ import annotations

import torch

from worker_svc import verify
from worker_svc.attention_backend import attention_backend
from worker_svc.attention_plan import PagedBatch, build_plan
from worker_svc.cuda_graphs import (
    CHUNK_BUCKETS,
    CHUNK_LOGIT_BUCKETS,
    CHUNK_TOKEN_BUCKETS,
    DECODE_BUCKETS,
    GraphShape,
    StaticStepInputs,
    StepBatch,
    StepGraphs,
)
from worker_svc.grammar import row_masks
from worker_svc.kv_pool import KvPool
from worker_svc.model import LlamaModel
from worker_svc.model_config import ModelConfig
from worker_svc.sampling import fresh_generator, sample_tokens, token_logprobs
from worker_svc.weights import Weights
from worker_svc.work import WorkItem


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.bfloat16,
        num_threads: int | None = None,
        use_kernels: bool = True,
        device: torch.device | str = "cpu",
        cuda_graphs: bool = False,
        cache_dtype: str = "auto",
    ) -> None:
        """num_threads: if given, sets torch's (process-wide) intra-op thread count. On a CPU
        shared with other busy processes, 1 thread avoids stalls at every parallel region.
        use_kernels: allow the fused CPU kernels for small bf16 decode steps (model.py; CPU only).
        device: where the weights, the KV pool and every step's tensors live.
        cuda_graphs: steps run as graphs at bucketed sizes (cuda_graphs.py: decode-only steps,
        and decodes beside small prompt chunks or drafts) where the attention is Triton's (a
        CUDA device; on the CPU only in tests, by the interpreter).
        cache_dtype: the KV pool's values: auto (dtype's) or int8 (kv_pool.py)."""
        if num_threads:
            torch.set_num_threads(num_threads)
        self.config = config
        self.block_size = block_size
        self.device = torch.device(device)
        on_cpu = self.device.type == "cpu"
        self.model = LlamaModel(config, weights, dtype, use_kernels and on_cpu).to(self.device)
        backend = attention_backend(self.device, self.model.attention_choice)
        self.cache_dtype = cache_dtype
        self.use_graphs = cuda_graphs and backend == "triton"
        self.num_blocks = num_blocks  # the blocks requests may own (graphs keep one more aside)
        self.pool = self.make_pool(num_blocks, dtype)
        self.staging = HostStaging(self.device)
        self.rng = fresh_generator()  # sampling runs on the host: seeded draws stay exact
        self.graphs = self.make_graphs() if self.use_graphs else None
        self.threads = torch.get_num_threads()
        self.small_steps = (0, self.threads)  # (rows, threads): steps of <= rows run on threads

    def thread_steps(self, threads: int, small_rows: int = 0, small_threads: int = 0) -> None:
        """Steps of at most `small_rows` rows run on `small_threads` torch threads, the rest on
        `threads` (both set by this thread, the one that executes)."""
        self.threads = threads
        self.small_steps = (small_rows, small_threads or threads)
        torch.set_num_threads(threads)

    def _threads_for(self, items: list[WorkItem]) -> None:
        small_rows, small_threads = self.small_steps
        rows = sum(len(item.token_ids) for item in items)
        wanted = small_threads if rows <= small_rows else self.threads
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)  # only where a step crosses the line

    def make_pool(self, num_blocks: int, dtype: torch.dtype) -> KvPool:
        """With graphs, one block more: the scratch block that padded decode rows write."""
        extra = 1 if self.use_graphs else 0
        return KvPool(
            self.config, num_blocks + extra, self.block_size, dtype, self.device, self.cache_dtype
        )

    def make_graphs(self) -> StepGraphs:
        max_blocks = -(-self.config.max_context // self.block_size)
        inputs = StaticStepInputs(
            max(DECODE_BUCKETS), max_blocks, self.num_blocks, self.block_size, self.device,
            max(CHUNK_TOKEN_BUCKETS), max(CHUNK_BUCKETS), max(CHUNK_LOGIT_BUCKETS),
        )  # fmt: skip

        def step(inputs: StaticStepInputs, shape: GraphShape) -> torch.Tensor:
            d, c, tokens = shape.decodes, shape.chunks, shape.tokens
            paged = PagedBatch(
                inputs.block_tables[:d], inputs.context_lens[:d], inputs.chunk_tables[:c],
                inputs.chunk_offsets[:c], inputs.chunk_lengths[:c], inputs.chunk_starts[:c],
                shape.chunk_tokens,
            )  # fmt: skip
            ids, positions = inputs.token_ids[:tokens], inputs.positions[:tokens]
            rows = inputs.logit_rows[: shape.logit_rows]
            return self.model.forward_paged(
                ids, positions, inputs.slots[:tokens], paged, self.pool, rows
            )

        return StepGraphs(inputs, step, self.device)

    def resize_pool(self, num_blocks: int) -> None:
        """A new, empty pool (after sizing from memory: the weights stay where they are)."""
        dtype = self.pool.dtype
        self.pool = self.graphs = None  # free the old ones first (graphs hold pool addresses)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.num_blocks = num_blocks
        self.pool = self.make_pool(num_blocks, dtype)
        self.graphs = self.make_graphs() if self.use_graphs else None

    @torch.inference_mode()
    def execute(self, items: list[WorkItem]) -> list[int | None]:
        """Process every item's tokens; return the next token of each item with sample=True."""
        wanted = [i for i, item in enumerate(items) if item.sample]
        if self.device.type == "cpu":
            self._threads_for(items)
        logits = self.compute_logits(items)  # one row per sampled item (a draft's: 1 + drafted)
        if any(item.drafted for item in items):
            return self.verified(logits, items, wanted)
        out: list[int | None] = [None] * len(items)
        if wanted:
            settings = [items[i].sampling for i in wanted]
            if logits.device.type != "cpu" and plain_greedy(settings):
                tokens = logits.argmax(dim=-1).tolist()  # the step's one device sync
            else:  # drawn rows are drawn on the host, as on the CPU: seeded draws stay exact
                logits = logits.float().cpu()
                tokens = sample_tokens(
                    logits,
                    settings,
                    [items[i].sample_index for i in wanted],
                    self.rng,
                    [items[i].history + items[i].token_ids for i in wanted],
                    row_masks([items[i].grammar for i in wanted], logits.shape[-1]),
                )
            for row, (i, token) in enumerate(zip(wanted, tokens, strict=True)):
                out[i] = token
                top = items[i].sampling.logprobs
                items[i].logprobs = None if top is None else token_logprobs(logits[row], token, top)
        return out

    def verified(
        self, logits: torch.Tensor, items: list[WorkItem], wanted: list[int]
    ) -> list[int | None]:
        """A step with drafts: each sampled item's emitted tokens (verify.py) in its `emitted`;
        the last of them is what it returns (its next input)."""
        sampled = [items[i] for i in wanted]
        first_rows, row = [], 0
        for item in sampled:
            first_rows.append(row)
            row += 1 + item.drafted
        if plain_greedy([item.sampling for item in sampled]):  # every row's argmax, one copy
            emitted = verify.greedy_emit(logits.argmax(dim=-1).tolist(), sampled, first_rows)
        else:
            emitted = verify.emit(logits.float().cpu(), sampled, first_rows, self.rng)
        out: list[int | None] = [None] * len(items)
        for i, item, tokens in zip(wanted, sampled, emitted, strict=True):
            item.emitted = tokens
            out[i], item.logprobs = tokens[-1]
        return out

    @torch.inference_mode()
    def compute_logits(self, items: list[WorkItem], all_positions: bool = False) -> torch.Tensor:
        """Logits [rows, vocab] fp32: the last token of each sampled item, in item order; with
        all_positions, every token of every item, in item order (for tests)."""
        bs = self.block_size
        for item in items:
            self.check(item)
        if self.graphs is not None and not all_positions:
            logits = self.graph_logits(items)
            if logits is not None:
                return logits
        # rows: single-token items and drafts first (batched decode attention: a draft is one
        # decode row per position, each reading the K/V the rows before it store in the same
        # layer, as its own decodes would), then multi-token chunks
        order = [i for i, it in enumerate(items) if it.fed == 1]
        order += [i for i, it in enumerate(items) if it.fed > 1]
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decodes: list[tuple[int, list[int]]] = []
        prefills: list[tuple[int, int, int, list[int]]] = []
        first_row = [0] * len(items)
        for i in order:
            item = items[i]
            offset, start, table = len(token_ids), item.start_position, item.block_table
            first_row[i] = offset
            token_ids += item.token_ids
            span = range(start, item.end_position)
            positions += span
            slots += [table[p // bs] * bs + p % bs for p in span]
            if item.fed == 1:
                decodes += [(p + 1, table) for p in span]
            else:
                prefills.append((offset, len(item.token_ids), start, table))
        plan = build_plan(decodes, prefills, bs, self.config.num_kv_heads)
        if all_positions:
            rows = [
                first_row[i] + j for i, it in enumerate(items) for j in range(len(it.token_ids))
            ]
        else:  # a sampled item's last token; a draft's every position
            rows = [
                first_row[i] + j
                for i, it in enumerate(items)
                if it.sample
                for j in range(len(it.token_ids) - 1 - it.drafted, len(it.token_ids))
            ]
        token_ids_t, positions_t, slots_t, rows_t = self.staging.send(
            token_ids, positions, slots, rows
        )
        return self.model.forward(
            token_ids_t, positions_t, slots_t, plan.to(self.device), self.pool, rows_t
        )

    def graph_logits(self, items: list[WorkItem]) -> torch.Tensor | None:
        """The logits of a step by its graph (one row per sampled item, a draft's 1 + drafted,
        in item order), or None when the step fits no graph."""
        decodes = [i for i, item in enumerate(items) if len(item.token_ids) == 1]
        chunks = [i for i, item in enumerate(items) if len(item.token_ids) > 1]
        tokens = sum(len(items[i].token_ids) for i in chunks)
        logit_rows = sum(1 + items[i].drafted for i in chunks)
        if self.graphs.shape_of(len(decodes), tokens, len(chunks), logit_rows) is None:
            return None  # a step beyond the buckets (a long prompt): its inputs are not built
        first, row = {}, 0  # each item's first logit row in the batch: decodes, then chunks
        for i in decodes + chunks:
            first[i], row = row, row + 1 + items[i].drafted
        picked = [
            r
            for i, item in enumerate(items)
            if item.sample
            for r in range(first[i], first[i] + 1 + item.drafted)
        ]
        batch = step_batch([items[i] for i in decodes], [items[i] for i in chunks], self.block_size)
        return self.graphs.run(batch, picked)

    def check(self, item: WorkItem) -> None:
        if not item.token_ids:
            raise ValueError(f"{item.request_id}: no tokens to process")
        end = item.end_position
        if item.start_position < 0 or end > self.config.max_context:
            raise ValueError(f"{item.request_id}: positions beyond the model's context")
        if len(item.block_table) * self.block_size < end:
            raise ValueError(f"{item.request_id}: block table too short for position {end - 1}")
        if any(not 0 <= b < self.num_blocks for b in item.block_table):
            raise ValueError(f"{item.request_id}: block id outside the pool")


class HostStaging:
    """Index lists to the device through one pinned host buffer: one copy per step, which does
    not wait. On the CPU the tensors are simply made."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = torch.empty(0, dtype=torch.int64)

    def send(self, *lists: list[int]) -> list[torch.Tensor]:
        if self.device.type == "cpu":
            return [torch.tensor(v, dtype=torch.int64) for v in lists]
        sizes = [len(v) for v in lists]
        total = sum(sizes)
        if self.pinned.numel() < total:
            self.pinned = torch.empty(max(total, 2 * self.pinned.numel()), dtype=torch.int64)
            if self.device.type == "cuda":
                self.pinned = self.pinned.pin_memory()
        flat = [x for v in lists for x in v]
        self.pinned[:total].copy_(torch.tensor(flat, dtype=torch.int64))
        on_device = self.pinned[:total].to(self.device, non_blocking=True)
        return list(on_device.split(sizes))


def plain_greedy(settings: list) -> bool:
    """Every row a plain argmax: greedy, nothing shaping its logits, no logprobs asked."""
    return all(s.greedy and not s.shapes_logits and s.logprobs is None for s in settings)


def step_batch(decodes: list[WorkItem], chunks: list[WorkItem], block_size: int) -> StepBatch:
    """A step as the static graph inputs take it (host tensors): its single-token items, then
    its chunks (prompt chunks and drafts)."""
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for item in decodes + chunks:
        start, table = item.start_position, item.block_table
        token_ids += item.token_ids
        span = range(start, start + len(item.token_ids))
        positions += span
        slots += [table[p // block_size] * block_size + p % block_size for p in span]
    i64, i32 = torch.int64, torch.int32
    return StepBatch(
        torch.tensor(token_ids, dtype=i64),
        torch.tensor(positions, dtype=i64),
        torch.tensor(slots, dtype=i64),
        block_table_tensor(decodes, block_size),
        torch.tensor([item.end_position for item in decodes], dtype=i32),
        block_table_tensor(chunks, block_size),
        torch.tensor([len(item.token_ids) for item in chunks], dtype=i32),
        torch.tensor([item.start_position for item in chunks], dtype=i32),
        torch.tensor([1 + item.drafted for item in chunks], dtype=i64),
    )


def block_table_tensor(items: list[WorkItem], block_size: int) -> torch.Tensor:
    """[items, blocks] int32: each item's blocks up to its last position, padded with block 0;
    one tensor made from one list (a tensor per row cost 2 ms at 256 rows on the H200's host)."""
    used = [-(-item.end_position // block_size) for item in items]
    width = max(used, default=1)
    flat: list[int] = []
    for item, n in zip(items, used, strict=True):
        flat += item.block_table[:n]
        flat += [0] * (width - n)
    return torch.tensor(flat, dtype=torch.int32).view(len(items), width)
