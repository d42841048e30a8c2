"""Our forward and transformers' on the same weights, each a callable to time, and the
interleaved medians that time them."""

from __future__ import annotations

import inspect
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from worker_svc.model_config import ModelConfig  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402
from worker_svc.weights import Weights  # noqa: E402
from worker_svc.work import WorkItem  # noqa: E402


def median_ms(fns: list[Callable[[], object]], reps: int, warmup: int = 2) -> list[float]:
    """Median wall time of each fn; runs are interleaved (A B A B ...) so that load from other
    processes on a shared machine hits all contenders alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, record in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            record.append(time.perf_counter() - start)
    return [statistics.median(record) * 1e3 for record in times]


class Ours:
    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        dtype: torch.dtype,
        max_batch: int,
        context: int,
        block_size: int = 16,
        device: str = "cpu",
        cuda_graphs: bool = False,
        cache_dtype: str = "auto",
    ) -> None:
        """cuda_graphs: steps replay CUDA graphs (a CUDA device only, as in a worker);
        cache_dtype: the KV pool's values (--kv-cache-dtype)."""
        self.block_size = block_size
        per_request = -(-(context + 1) // block_size)
        num_blocks = max_batch * per_request + 8
        self.runner = ModelRunner(
            config, weights, num_blocks, block_size, dtype, device=device,
            cuda_graphs=cuda_graphs, cache_dtype=cache_dtype,
        )  # fmt: skip
        # cached positions hold random values (timing does not depend on them); blocks are
        # handed out shuffled, as they would be after a while of serving
        pool = self.runner.pool
        for values in (pool.k, pool.v):
            if values.dtype == torch.int8:
                values.random_(-127, 128)
            else:
                values.normal_()
        for scales in (pool.k_scale, pool.v_scale):
            if scales is not None:
                scales.uniform_(0.005, 0.02)
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.tables = [order[i * per_request : (i + 1) * per_request] for i in range(max_batch)]
        self.context = context

    def decode_items(self, batch: int) -> list[WorkItem]:
        return [
            WorkItem(str(i), [100 + i], self.context, self.tables[i], sample_index=1)
            for i in range(batch)
        ]

    def decode(self, batch: int) -> Callable[[], object]:
        items = self.decode_items(batch)
        return lambda: self.runner.execute(items)

    def prefill(self, ids: list[int]) -> Callable[[], object]:
        # a prompt longer than one request's context spans the blocks of the next requests too
        need = -(-len(ids) // self.block_size)
        table = [block for table in self.tables for block in table][: max(need, 1)]
        items = [WorkItem("p", ids, 0, table)]
        return lambda: self.runner.execute(items)

    def draft(self, batch: int, drafted: int) -> Callable[[], object]:
        """`batch` decodes, each verifying a draft of `drafted` tokens (1 + drafted rows of one
        request: the cached context shared), fresh items each call (a draft step fills them)."""
        context = self.context - drafted  # the same cached positions as a plain decode's end
        per_request = -(-(context + 1 + drafted) // self.block_size)

        def items() -> list[WorkItem]:
            return [
                WorkItem(str(i), [100 + i, *range(200, 200 + drafted)], context,
                         self.tables[i][:per_request], sample_index=1, drafted=drafted)
                for i in range(batch)
            ]  # fmt: skip

        def step() -> list[WorkItem]:
            batch = items()
            self.runner.execute(batch)
            return batch  # each item's `emitted`: what its draft gave

        return step

    def mixed(self, batch: int, ids: list[int]) -> Callable[[], object]:
        """`batch` decodes beside a fresh prompt's whole chunk (max_batch must exceed batch)."""
        items = [*self.decode_items(batch), WorkItem("p", ids, 0, self.tables[batch])]
        return lambda: self.runner.execute(items)


class Theirs:
    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        dtype: torch.dtype,
        context: int,
        attn: str = "sdpa",
        device: str = "cpu",
    ) -> None:
        from llmserve.bench.hf_reference import hf_model

        self.config = config
        self.dtype = dtype
        self.attn = attn
        self.device = torch.device(device)
        self.model = hf_model(config, weights, dtype, attn=attn).to(self.device)
        self.context = context

    def decode(self, batch: int) -> Callable[[], object]:
        from transformers import DynamicCache

        cfg = self.config
        cache = DynamicCache(config=self.model.config)
        shape = (batch, cfg.num_kv_heads, self.context, cfg.head_dim)
        on = {"dtype": self.dtype, "device": self.device}
        for layer in range(cfg.num_layers):
            cache.update(torch.randn(shape, **on), torch.randn(shape, **on), layer)
        ids = torch.arange(100, 100 + batch, device=self.device).view(batch, 1)
        positions = torch.full((batch, 1), self.context, device=self.device)
        mask = torch.ones(batch, self.context + 1, dtype=torch.int64, device=self.device)

        # the cache's argument is `cache` in recent transformers, `past_key_values` before
        takes = inspect.signature(self.model.forward).parameters
        given = {"cache" if "cache" in takes else "past_key_values": cache}

        @torch.inference_mode()
        def step() -> object:
            out = self.model(
                input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True, **given
            )
            cache.crop(-1)  # back to the same cached length
            return out.logits[:, -1].argmax(-1).tolist()  # waits for the device, as ours does

        return step

    def prefill(self, ids: list[int]) -> Callable[[], object]:
        tokens = torch.tensor([ids], device=self.device)

        @torch.inference_mode()
        def step() -> object:
            logits = self.model(input_ids=tokens, logits_to_keep=1).logits
            return logits[:, -1].argmax(-1).tolist()

        return step
