"""One scheduler's step stream on the worker: the requests it placed here (block table, last
sampled token, sampling settings) and the execution of its steps, in order."""

from __future__ import annotations

import logging
import time
from typing import Protocol

from llmcommon.sampling import InvalidSampling
from llmcommon.sampling_wire import from_wire
from llmcommon.v1 import common_pb2, worker_pb2
from worker_svc.grammar import GrammarCache
from worker_svc.model_config import ModelConfig
from worker_svc.step_checks import (
    blocks_problem,
    cached_problem,
    repeat_problem,
    room_problem,
    shared_problem,
    tokens_problem,
    write_problem,
)
from worker_svc.work import BatchShape, TokenLogprobs, WorkItem, shape_of

log = logging.getLogger("worker")


class Runner(Protocol):
    """What executes a batch: the real model (runner.py) or the simulated one (sim.py)."""

    block_size: int
    config: ModelConfig  # vocab_size and max_context bound what a step may ask

    def execute(self, items: list[WorkItem]) -> list[int | None]: ...


def logprobs_message(lp: TokenLogprobs | None) -> common_pb2.TokenLogprobs:
    if lp is None:
        return common_pb2.TokenLogprobs()
    return common_pb2.TokenLogprobs(
        logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs
    )


class Session:
    """The worker's side of one step stream. `run` is called from the forward thread only.

    A request with bad input (or one whose execution fails on its own) fails alone: it is
    forgotten here and reported in the result's `failed`; the rest of its step runs."""

    def __init__(self, runner: Runner, num_blocks: int, grammars: GrammarCache | None = None):
        self.runner = runner
        self.grammars = grammars  # compiles structured output's grammars (None: refused)
        self.num_blocks = num_blocks
        self.block_size = runner.block_size
        self.vocab_size = runner.config.vocab_size
        self.max_context = runner.config.max_context
        self.items: dict[int, WorkItem] = {}  # handle -> its state; token_ids = what comes next
        self.holders: dict[int, set[int]] = {}  # block -> the handles holding it
        self.writer: dict[int, int] = {}  # block -> the holder it was granted to (who writes it)
        self.own_written = 0  # positions the requests held wrote themselves
        self.closed = False  # another stream took over: execute nothing more
        self.last_end = 0.0  # when the last step finished (perf_counter)
        self.executions: list[tuple[BatchShape, float]] = []  # the last step's: (shape, seconds)

    @property
    def used_blocks(self) -> int:
        return len(self.holders)

    @property
    def written(self) -> int:
        """Positions written in the blocks held: each request's own, plus the shared blocks
        whose writer has gone (full blocks, only read now)."""
        return self.own_written + (len(self.holders) - len(self.writer)) * self.block_size

    def run(self, step: worker_pb2.Step) -> tuple[worker_pb2.StepResult, BatchShape | None, float]:
        """Apply the step's changes, execute it, remember what it sampled. Returns the result,
        the shape of what ran (for metrics) and the forward seconds."""
        started = time.perf_counter()
        idle = started - self.last_end if self.last_end else 0.0
        result = worker_pb2.StepResult(step=step.step, idle_seconds=idle)
        shape = None
        seconds = 0.0
        failed: dict[int, str] = {}
        self.executions = []
        try:
            why = repeat_problem(step.repeat, len(step.chunks), len(step.drafts))
            if why:
                raise ValueError(why)
            handles, batch = self.constrain(*self.apply(step, failed), failed)
            shape = shape_of(batch)
            if batch:
                sampled = self.executed(handles, batch, max(1, step.repeat), failed)
                seconds = sum(took for _, took in self.executions)
                result.tokens.extend(token for token, _ in sampled)
                if any(lp is not None for _, lp in sampled):
                    result.logprobs.extend(logprobs_message(lp) for _, lp in sampled)
                result.emitted.extend(self.emitted_counts(step, handles, failed))
        except Exception as err:  # the scheduler fails this step's requests, keeps the worker
            result.error = f"{type(err).__name__}: {err}"
        for handle in failed:
            self.release(handle)
        result.failed.update(failed)
        self.last_end = time.perf_counter()
        result.forward_seconds = seconds
        result.kv.CopyFrom(self.report())
        return result, shape, seconds

    def executed(
        self, handles: list[int], batch: list[WorkItem], runs: int, failed: dict[int, str]
    ) -> list[tuple[int, TokenLogprobs | None]]:
        """Execute the batch `runs` times (a decode-only step may repeat), each execution
        feeding the next the tokens it sampled. Returns the sampled tokens, execution by
        execution, of the requests that did not fail (one that fails in any execution fails
        whole). Each execution is timed: what its shape drives (forward, sampling), as it is
        predicted."""
        first, by_handle = handles, {}
        for run in range(runs):
            if run:  # the same decodes again: each now holds the token it sampled
                handles, batch = self.constrain(*self.again(handles, batch, failed), failed)
                if not batch:
                    break
            shape = shape_of(batch)
            begun = time.perf_counter()
            tokens = self.execute(handles, batch, failed)
            self.executions.append((shape, time.perf_counter() - begun))
            for handle, token, lp in self.advance(handles, batch, tokens, failed):
                by_handle.setdefault(handle, []).append((token, lp))
        kept = [h for h in first if h not in failed and h in by_handle]
        if runs == 1:  # a draft's tokens, all of them, in its place
            return [sampled for h in kept for sampled in by_handle[h]]
        return [by_handle[h][run] for run in range(runs) for h in kept if run < len(by_handle[h])]

    def emitted_counts(self, step: worker_pb2.Step, ran: list[int], failed: dict[int, str]):
        """Per draft of the step that did not fail: how many tokens it produced."""
        ran_set = set(ran)
        return [
            len(self.items[d.handle].emitted)
            for d in step.drafts
            if d.handle not in failed and d.handle in ran_set
        ]

    def again(
        self, handles: list[int], batch: list[WorkItem], failed: dict[int, str]
    ) -> tuple[list[int], list[WorkItem]]:
        """The decodes of a repeated step that can run once more (room in their tables)."""
        kept = []
        for handle, item in zip(handles, batch, strict=True):
            if handle in failed:
                continue
            why = self.decode_problem(handle, item)
            if why:
                failed.setdefault(handle, why)
                continue
            kept.append((handle, item))
        return [h for h, _ in kept], [i for _, i in kept]

    def apply(self, step: worker_pb2.Step, failed: dict[int, str]) -> tuple[list[int], list]:
        """The step's changes, checked one request at a time (`failed` keeps each one's first
        problem); the batch to execute."""
        items = self.items
        for handle in step.released:
            self.release(handle)
        for trim in step.trims:
            why = self.trim(trim.handle, trim.keep)
            if why:
                failed.setdefault(trim.handle, why)
        for added in step.added:
            why = self.add(added)
            if why:
                failed.setdefault(added.handle, why)
        self.share(step, failed)
        for grant in step.grants:
            item = items.get(grant.handle)
            why = blocks_problem(list(grant.blocks), self.holders, self.num_blocks)
            if item is None or why:
                failed.setdefault(grant.handle, why or "unknown handle")
                continue
            for block in grant.blocks:
                self.holders[block] = {grant.handle}
                self.writer[block] = grant.handle
            item.block_table.extend(grant.blocks)
        handles, batch = [], []
        seen: set[int] = set()  # a request runs once a step: a second chunk or decode fails it
        twice = "planned twice in one step (a chunk or decode already)"
        for chunk in step.chunks:
            item = items.get(chunk.handle)
            why = twice if chunk.handle in seen else self.chunk_problem(item, chunk)
            seen.add(chunk.handle)
            if why:
                failed.setdefault(chunk.handle, why)
                continue
            item.token_ids, item.sample = list(chunk.token_ids), chunk.sample
            handles.append(chunk.handle)
            batch.append(item)
        for handle in step.decodes:
            item = items.get(handle)
            why = twice if handle in seen else self.decode_problem(handle, item)
            seen.add(handle)
            if why:
                failed.setdefault(handle, why)
                continue
            handles.append(handle)
            batch.append(item)
        for draft in step.drafts:
            item = items.get(draft.handle)
            why = self.draft_problem(draft, item, set(handles))
            if why:
                failed.setdefault(draft.handle, why)
                continue
            item.token_ids += draft.token_ids
            item.drafted = len(draft.token_ids)
            handles.append(draft.handle)
            batch.append(item)
        if failed:  # e.g. a chunk's handle whose decode failed later in the step
            kept = [(h, i) for h, i in zip(handles, batch, strict=True) if h not in failed]
            handles, batch = [h for h, _ in kept], [i for _, i in kept]
        return handles, batch

    def add(self, added: worker_pb2.Added) -> str | None:
        """Place a request, its sampling settings converted from the wire here, once, and
        checked (the worker's door: nothing after checks them again); what is wrong, or None."""
        if added.handle in self.items:
            return "its handle is already in use"
        try:
            sampling = from_wire(added.sampling)
        except InvalidSampling as err:
            return str(err)
        cached = list(added.cached_token_ids)
        why = sampling.vocab_problem(self.vocab_size)
        why = why or (tokens_problem(cached, self.vocab_size) if cached else None)
        if why:
            return why
        item = self.items[added.handle] = WorkItem(
            added.request_id,
            [],
            len(cached),
            [],
            sample=False,
            sampling=sampling,
            sample_index=added.sample_index,
            cached=len(cached),
        )
        if sampling.grammar is not None:
            why = self.attach_grammar(item)
            if why:
                return why
        if sampling.needs_history:  # the cached prefix is part of what it has processed
            item.history.extend(cached)
        return None

    def attach_grammar(self, item: WorkItem) -> str | None:
        """The request's grammar state, fresh: `constrain` brings it up to its generated tokens."""
        if self.grammars is None:
            return "structured output is not available on this worker"
        try:
            state = self.grammars.state(item.sampling.grammar, self.vocab_size)
        except Exception as err:  # a grammar that fails to compile, a table that failed
            return f"{type(err).__name__}: {err}"
        item.grammar = state
        return None

    def constrain(
        self, handles: list[int], batch: list[WorkItem], failed: dict[int, str]
    ) -> tuple[list[int], list[WorkItem]]:
        """Each constrained item that samples now: its matcher caught up with the tokens it
        generated (all of them after a recompute). One whose grammar fails fails alone."""
        kept_handles, kept = [], []
        for handle, item in zip(handles, batch, strict=True):
            state = item.grammar
            if state is not None and item.sample:
                try:
                    state.sync(item.history + item.token_ids[: item.fed], item.sample_index)
                except ValueError as err:
                    failed.setdefault(handle, str(err))
                    continue
            kept_handles.append(handle)
            kept.append(item)
        return kept_handles, kept

    def share(self, step: worker_pb2.Step, failed: dict[int, str]) -> None:
        """The shared blocks of the requests added in this step: the first of their tables."""
        new = {added.handle for added in step.added} - set(failed)
        for grant in step.shared:
            item = self.items.get(grant.handle)
            why = shared_problem(list(grant.blocks), self.num_blocks)
            if item is None or grant.handle not in new:
                why = "shared blocks for a request not added in this step"
            if why:
                failed.setdefault(grant.handle, why)
                continue
            for block in grant.blocks:
                self.holders.setdefault(block, set()).add(grant.handle)
            item.block_table.extend(grant.blocks)
        for handle in new:
            why = cached_problem(self.items[handle], self.block_size)
            if why:
                failed.setdefault(handle, why)

    def chunk_problem(self, item: WorkItem | None, chunk: worker_pb2.Chunk) -> str | None:
        if item is None:
            return "unknown handle"
        if chunk.start_position != item.start_position:
            return (
                f"chunk at position {chunk.start_position}, but {item.start_position} positions "
                f"are written"
            )
        end = chunk.start_position + len(chunk.token_ids)
        return (
            tokens_problem(list(chunk.token_ids), self.vocab_size)
            or room_problem(item, end, self.block_size, self.max_context)
            or write_problem(chunk.handle, item, end, self.holders, self.block_size)
        )

    def decode_problem(self, handle: int, item: WorkItem | None) -> str | None:
        if item is None:
            return "unknown handle"
        if len(item.token_ids) != 1 or not item.sample:
            return "a decode without a sampled token"
        end = item.end_position
        return room_problem(item, end, self.block_size, self.max_context) or write_problem(
            handle, item, end, self.holders, self.block_size
        )

    def draft_problem(
        self, draft: worker_pb2.Draft, item: WorkItem | None, placed: set[int]
    ) -> str | None:
        """A draft follows a decode's sampled token, once per step, into its own blocks."""
        if item is not None and draft.handle in placed:
            return "a draft for a request that also runs otherwise in this step"
        why = self.decode_problem(draft.handle, item)
        if why or item is None:
            return why
        end = item.end_position + len(draft.token_ids)
        return (
            tokens_problem(list(draft.token_ids), self.vocab_size)
            or room_problem(item, end, self.block_size, self.max_context)
            or write_problem(draft.handle, item, end, self.holders, self.block_size)
        )

    def execute(self, handles: list[int], batch: list[WorkItem], failed: dict[int, str]) -> list:
        """Run the batch; if it raises, run each request alone, so that only those that fail on
        their own fail (each rewrites its KV positions whole: the broken batch leaves no trace)."""
        try:
            return self.runner.execute(batch)
        except Exception as err:
            if len(batch) == 1:
                failed[handles[0]] = f"{type(err).__name__}: {err}"
                return [None]
        log.warning("a step of %d requests failed; running them one by one", len(batch))
        tokens: list[int | None] = []
        for handle, item in zip(handles, batch, strict=True):
            try:
                tokens += self.runner.execute([item])
            except Exception as err:
                failed[handle] = f"{type(err).__name__}: {err}"
                tokens.append(None)
        return tokens

    def advance(
        self, handles: list[int], batch: list[WorkItem], tokens: list, failed: dict[int, str]
    ) -> list[tuple[int, int, TokenLogprobs | None]]:
        """After the execution: each item's next input is the token it sampled. Returns
        (handle, token, logprobs) of each that sampled."""
        sampled = []
        for handle, item, token in zip(handles, batch, tokens, strict=True):
            if handle in failed:
                continue
            if item.drafted:
                sampled += self.advance_draft(handle, item)
                continue
            self.own_written += len(item.token_ids)
            if item.sampling.needs_history:
                item.history.extend(item.token_ids)
            item.start_position += len(item.token_ids)
            if token is None:
                item.token_ids, item.sample = [], False
            else:
                item.token_ids, item.sample = [token], True
                item.sample_index += 1
                if item.grammar is not None:
                    item.grammar.advance(token)
                sampled.append((handle, token, item.logprobs))
        return sampled

    def advance_draft(self, handle: int, item: WorkItem) -> list:
        """After a draft's execution: the positions it kept are written (its sampled token and
        the draft tokens accepted); the rest hold garbage the next tokens overwrite. Its grammar
        has consumed all it emitted but the last (verify.py), which it consumes now."""
        emitted, written = item.emitted, len(item.emitted)
        self.own_written += written
        if item.sampling.needs_history:
            item.history.extend(item.token_ids[:written])
        item.start_position += written
        last = emitted[-1][0]
        item.token_ids, item.sample, item.drafted = [last], True, 0
        item.sample_index += written
        if item.grammar is not None:
            item.grammar.advance(last)
        item.logprobs = emitted[-1][1]
        return [(handle, token, lp) for token, lp in emitted]

    def trim(self, handle: int, keep: int) -> str | None:
        """Drop the blocks from `keep` on from a request's table: they were reserved and never
        written. Why not, if any."""
        item = self.items.get(handle)
        if item is None:
            return "unknown handle"
        table = item.block_table
        if keep > len(table) or keep * self.block_size < item.start_position:
            return f"a trim to {keep} blocks would drop written positions or blocks it lacks"
        self._let_go(handle, table[keep:])
        del table[keep:]
        return None

    def _let_go(self, handle: int, blocks: list[int]) -> None:
        """`handle` neither holds nor writes `blocks` from here on."""
        for block in blocks:
            holders = self.holders.get(block, set())
            holders.discard(handle)
            if not holders:
                self.holders.pop(block, None)
            if self.writer.get(block) == handle:
                del self.writer[block]

    def release(self, handle: int) -> None:
        item = self.items.pop(handle, None)
        if item is not None:
            self._let_go(handle, item.block_table)
            self.own_written -= item.start_position - item.cached

    def report(self) -> worker_pb2.KvReport:
        bs = self.block_size
        return worker_pb2.KvReport(
            capacity_positions=self.num_blocks * bs,
            written_positions=self.written,
            used_blocks=self.used_blocks,
            free_blocks=self.num_blocks - self.used_blocks,
        )
