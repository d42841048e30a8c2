"""The worker service: Describe its pool, Execute one batch per call (in a thread, off the loop)."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from llmserve.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.runner import ModelRunner
from worker_svc.settings import WorkerSettings
from worker_svc.work import SamplingSettings, WorkItem

log = logging.getLogger("worker")
DRIVERLESS_SECONDS = 5.0  # a drain stops waiting when no Execute came for this long


class PoolView:
    """What the worker itself sees of its pool: blocks and positions of live requests."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {}
        self.written: dict[str, int] = {}

    def record(self, item: WorkItem) -> None:
        self.blocks.setdefault(item.request_id, set()).update(item.block_table)
        self.written[item.request_id] = item.end_position

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.blocks.pop(rid, None)
            self.written.pop(rid, None)

    def report(self, runner: ModelRunner) -> worker_pb2.KvReport:
        used = sum(map(len, self.blocks.values()))  # the scheduler never shares a block
        return worker_pb2.KvReport(
            capacity_positions=runner.pool.num_blocks * runner.block_size,
            written_positions=sum(self.written.values()),
            used_blocks=used,
            free_blocks=runner.pool.num_blocks - used,
        )


def to_work_item(item: worker_pb2.WorkItem) -> WorkItem:
    s = item.sampling
    return WorkItem(
        request_id=item.request_id,
        token_ids=list(item.token_ids),
        start_position=item.start_position,
        block_table=list(item.block_table),
        sample=item.sample,
        sampling=SamplingSettings(
            temperature=s.temperature,
            top_p=s.top_p or 1.0,
            top_k=s.top_k,
            seed=s.seed if s.HasField("seed") else None,
        ),
        sample_index=item.sample_index,
    )


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, settings: WorkerSettings, runner: ModelRunner, model_name: str) -> None:
        self.settings = settings
        self.runner = runner
        self.model_name = model_name
        self.view = PoolView()
        self.epoch = ""
        self.last_call = 0.0
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self.on_execute = None  # metrics hook: (items, seconds, report), also for releases only

    async def drain(self) -> None:
        """On SIGTERM (health already NOT_SERVING, so the scheduler sends nothing new): keep
        executing until the scheduler has released every request held here, or time runs out."""
        deadline = time.monotonic() + self.settings.drain_timeout
        while self.view.blocks and time.monotonic() < deadline:
            if time.monotonic() - self.last_call > DRIVERLESS_SECONDS:
                break  # no scheduler drives these requests any more
            await asyncio.sleep(0.05)
        if self.view.blocks:
            log.warning("drain timed out with %d requests still held", len(self.view.blocks))

    def describe(self) -> worker_pb2.WorkerInfo:
        cfg, pool = self.runner.config, self.runner.pool
        return worker_pb2.WorkerInfo(
            name=self.settings.display_name,
            model=self.model_name,
            dtype=self.settings.dtype,
            block_size=self.runner.block_size,
            num_blocks=self.runner.pool.num_blocks,
            capacity_positions=self.runner.pool.num_blocks * self.runner.block_size,
            bytes_per_position=pool.bytes_per_position,
            pool_bytes=pool.pool_bytes,
            max_context=cfg.max_context,
            vocab_size=cfg.vocab_size,
            eos_token_ids=list(cfg.eos_token_ids),
        )

    async def Describe(self, request, context):
        return self.describe()

    async def Execute(self, request, context):
        self.last_call = time.monotonic()
        if request.epoch != self.epoch:  # a new scheduler, or re-admitted: nothing is held
            self.view, self.epoch = PoolView(), request.epoch
        self.view.release(list(request.released))
        items = [to_work_item(i) for i in request.items]
        for item in items:
            self.view.record(item)
        started = time.perf_counter()
        tokens = []
        if items:
            loop = asyncio.get_running_loop()
            tokens = await loop.run_in_executor(self.executor, self.runner.execute, items)
        seconds = time.perf_counter() - started
        report = self.view.report(self.runner)
        if self.on_execute is not None:
            self.on_execute(items, seconds, report)
        results = [
            worker_pb2.Sampled(request_id=i.request_id, has_token=t is not None, token_id=t or 0)
            for i, t in zip(items, tokens, strict=True)
        ]
        return worker_pb2.ExecuteReply(results=results, kv=report, forward_seconds=seconds)
