"""One scheduler's step stream on the worker: the requests it placed here (block table, last
sampled token, sampling settings) and the execution of its steps, in order."""

from __future__ import annotations

import time
from typing import Protocol

from llmserve.v1 import worker_pb2
from worker_svc.work import BatchShape, SamplingSettings, WorkItem, shape_of


class Runner(Protocol):
    """What executes a batch: the real model (runner.py) or the simulated one (sim.py)."""

    block_size: int

    def execute(self, items: list[WorkItem]) -> list[int | None]: ...


def sampling_of(s: worker_pb2.WorkSampling) -> SamplingSettings:
    return SamplingSettings(
        temperature=s.temperature,
        top_p=s.top_p or 1.0,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
    )


class Session:
    """The worker's side of one step stream. `run` is called from the forward thread only."""

    def __init__(self, runner: Runner, num_blocks: int) -> None:
        self.runner = runner
        self.num_blocks = num_blocks
        self.items: dict[int, WorkItem] = {}  # handle -> its state; token_ids = what comes next
        self.used_blocks = 0
        self.written = 0  # positions written, over the requests held
        self.closed = False  # another stream took over: execute nothing more
        self.last_end = 0.0  # when the last step finished (perf_counter)

    def run(self, step: worker_pb2.Step) -> tuple[worker_pb2.StepResult, BatchShape | None, float]:
        """Apply the step's changes, execute it, remember what it sampled. Returns the result,
        the shape of what ran (for metrics) and the forward seconds."""
        started = time.perf_counter()
        idle = started - self.last_end if self.last_end else 0.0
        result = worker_pb2.StepResult(step=step.step, idle_seconds=idle)
        shape = None
        seconds = 0.0
        try:
            batch = self.apply(step)
            shape = shape_of(batch)
            if batch:
                tokens = self.runner.execute(batch)
                seconds = time.perf_counter() - started
                result.tokens.extend(self.advance(batch, tokens))
        except Exception as err:  # the scheduler fails this step's requests, keeps the worker
            result.error = f"{type(err).__name__}: {err}"
        self.last_end = time.perf_counter()
        result.forward_seconds = seconds
        result.kv.CopyFrom(self.report())
        return result, shape, seconds

    def apply(self, step: worker_pb2.Step) -> list[WorkItem]:
        items = self.items
        for handle in step.released:
            self.release(handle)
        for added in step.added:
            items[added.handle] = WorkItem(
                added.request_id,
                [],
                0,
                [],
                sample=False,
                sampling=sampling_of(added.sampling),
                sample_index=added.sample_index,
            )
        for grant in step.grants:
            items[grant.handle].block_table.extend(grant.blocks)
            self.used_blocks += len(grant.blocks)
        batch = []
        for chunk in step.chunks:
            item = items[chunk.handle]
            if chunk.start_position != item.start_position:
                raise ValueError(
                    f"{item.request_id}: chunk at position {chunk.start_position}, but "
                    f"{item.start_position} positions are written"
                )
            item.token_ids, item.sample = list(chunk.token_ids), chunk.sample
            batch.append(item)
        for handle in step.decodes:
            item = items[handle]
            if len(item.token_ids) != 1 or not item.sample:
                raise ValueError(f"{item.request_id}: a decode without a sampled token")
            batch.append(item)
        return batch

    def advance(self, batch: list[WorkItem], tokens: list[int | None]) -> list[int]:
        """After the execution: each item's next input is the token it sampled."""
        sampled = []
        for item, token in zip(batch, tokens, strict=True):
            self.written += len(item.token_ids)
            item.start_position += len(item.token_ids)
            if token is None:
                item.token_ids, item.sample = [], False
            else:
                item.token_ids, item.sample = [token], True
                item.sample_index += 1
                sampled.append(token)
        return sampled

    def release(self, handle: int) -> None:
        item = self.items.pop(handle, None)
        if item is not None:
            self.used_blocks -= len(item.block_table)
            self.written -= item.start_position

    def report(self) -> worker_pb2.KvReport:
        bs = self.runner.block_size
        return worker_pb2.KvReport(
            capacity_positions=self.num_blocks * bs,
            written_positions=self.written,
            used_blocks=self.used_blocks,
            free_blocks=self.num_blocks - self.used_blocks,
        )
