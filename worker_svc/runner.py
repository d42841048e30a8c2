"""Runs one scheduler step: a mix of prefill chunks and decodes, flattened into one batch."""

from __future__ import annotations

import torch

from worker_svc.attention_plan import build_plan
from worker_svc.kv_pool import KvPool
from worker_svc.model import LlamaModel
from worker_svc.model_config import ModelConfig
from worker_svc.sampling import fresh_generator, sample_tokens
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
    ) -> None:
        """num_threads: if given, sets torch's (process-wide) intra-op thread count. On a CPU
        shared with other busy processes, 1 thread avoids stalls at every parallel region.
        use_kernels: allow the fused CPU kernels for small bf16 decode steps (model.py)."""
        if num_threads:
            torch.set_num_threads(num_threads)
        self.config = config
        self.block_size = block_size
        self.model = LlamaModel(config, weights, dtype, use_kernels)
        self.pool = KvPool(config, num_blocks, block_size, dtype)
        self.rng = fresh_generator()

    @torch.inference_mode()
    def execute(self, items: list[WorkItem]) -> list[int | None]:
        """Process every item's tokens; return the next token of each item with sample=True."""
        wanted = [i for i, item in enumerate(items) if item.sample]
        logits = self.compute_logits(items)  # one row per sampled item, in item order
        out: list[int | None] = [None] * len(items)
        if wanted:
            tokens = sample_tokens(
                logits,
                [items[i].sampling for i in wanted],
                [items[i].sample_index for i in wanted],
                self.rng,
            )
            for i, token in zip(wanted, tokens, strict=True):
                out[i] = token
        return out

    @torch.inference_mode()
    def compute_logits(self, items: list[WorkItem], all_positions: bool = False) -> torch.Tensor:
        """Logits [rows, vocab] fp32: the last token of each sampled item, in item order; with
        all_positions, every token of every item, in item order (for tests)."""
        bs = self.block_size
        for item in items:
            self.check(item)
        # rows: single-token items first (batched decode attention), then multi-token chunks
        order = [i for i, it in enumerate(items) if len(it.token_ids) == 1]
        order += [i for i, it in enumerate(items) if len(it.token_ids) > 1]
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
            if len(item.token_ids) == 1:
                decodes.append((start + 1, table))
            else:
                prefills.append((offset, len(item.token_ids), start, table))
        plan = build_plan(decodes, prefills, bs, self.config.num_kv_heads)
        if all_positions:
            rows = [
                first_row[i] + j for i, it in enumerate(items) for j in range(len(it.token_ids))
            ]
        else:
            rows = [first_row[i] + len(it.token_ids) - 1 for i, it in enumerate(items) if it.sample]
        return self.model.forward(
            torch.tensor(token_ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor(slots, dtype=torch.int64),
            plan,
            self.pool,
            torch.tensor(rows, dtype=torch.int64),
        )

    def check(self, item: WorkItem) -> None:
        if not item.token_ids:
            raise ValueError(f"{item.request_id}: no tokens to process")
        end = item.end_position
        if item.start_position < 0 or end > self.config.max_context:
            raise ValueError(f"{item.request_id}: positions beyond the model's context")
        if len(item.block_table) * self.block_size < end:
            raise ValueError(f"{item.request_id}: block table too short for position {end - 1}")
        if any(not 0 <= b < self.pool.num_blocks for b in item.block_table):
            raise ValueError(f"{item.request_id}: block id outside the pool")
