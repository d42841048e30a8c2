"""The batching core: one `schedule()` per model execution, as in the seed's Figure 2.

1. check results and clean up finished requests (free their KV)   -> `postprocess`, `_reap`
2. prepare the running requests' next work (grow KV; preempt if paged KV runs out)
3. admit waiting requests in FCFS order while budget, running limit and KV allow
4. the caller executes the batches and hands the sampled tokens back to `postprocess`
"""

from __future__ import annotations

import sys
import time
from collections import Counter, deque
from collections.abc import Callable

from scheduler_svc.blocks import BlockPool, blocks_for
from scheduler_svc.config import BatchMode, CoreConfig, KvPolicy, StallReason, WorkerSpec
from scheduler_svc.plan import Event, Refused, Snapshot, Work, WorkerBatch, WorkerKv
from scheduler_svc.sequence import Finish, SeqStatus, Sequence


class WorkerState:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.pool = BlockPool(spec.num_blocks, spec.block_size)
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.released: list[str] = []
        self.healthy = True
        self.draining = False  # stopping: finishes what it runs, takes nothing new
        self.batch_open = True  # static mode: may new requests join this step?


class Scheduler:
    def __init__(
        self,
        config: CoreConfig,
        workers: list[WorkerSpec],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not workers:
            raise ValueError("the scheduler needs at least one worker")
        self.config = config
        self.workers = [WorkerState(spec) for spec in workers]
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.waiting_tokens = 0  # sum of num_pending over `waiting`, kept as it changes
        self.seqs: dict[str, Sequence] = {}
        self.stalls: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.head_reason: StallReason | None = None
        self.steps = self.admitted = self.finished = self.preemptions = 0
        self.outbox: list[Event] = []
        self._planned: dict[str, int] = {}  # request -> positions it will hold after this step

    # ---- requests in and out -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs:
            self._refuse("duplicate", f"request id {seq.request_id!r} is already in flight")
        self._check_can_ever_run(seq)
        seq.status, seq.arrival = SeqStatus.WAITING, seq.arrival or self.clock()
        self.seqs[seq.request_id] = seq
        self.waiting.append(seq)
        self.waiting_tokens += seq.num_pending

    def abort(self, request_id: str, finish: Finish = Finish.CANCELLED, error: str = "") -> bool:
        """Finish a request now; a running one frees its KV at the next clean-up."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            self.waiting_tokens -= seq.num_pending
        self._finish(seq, finish, error)
        if seq.worker is None:
            del self.seqs[request_id]
        return True

    def fail_worker(self, index: int) -> list[Sequence]:
        """A worker is gone: requeue its requests (prompt + generated) for recompute elsewhere."""
        ws = self.workers[index]
        ws.healthy = False
        moved = [s for s in ws.running if not s.is_finished]
        for seq in reversed(list(ws.running)):
            if seq.is_finished:
                self._release(index, seq)
                self.seqs.pop(seq.request_id, None)
            else:
                self._preempt(index, seq)
        ws.pool = BlockPool(ws.spec.num_blocks, ws.spec.block_size)
        ws.released.clear()
        return moved

    def restore_worker(self, index: int) -> None:
        self.workers[index].healthy = True
        self.workers[index].draining = False

    def drain_worker(self, index: int) -> None:
        """The worker is stopping: its running requests finish there; nothing new joins it."""
        self.workers[index].draining = True

    def take_releases(self) -> list[WorkerBatch]:
        """Requests freed since the last execution, per worker, for a release-only call."""
        batches = []
        for i, ws in enumerate(self.workers):
            if ws.released and ws.healthy:
                batches.append(WorkerBatch(i, released=ws.released))
                ws.released = []
        return batches

    def take_events(self) -> list[Event]:
        events, self.outbox = self.outbox, []
        return events

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> list[WorkerBatch]:
        self._reap()
        self._planned.clear()
        batches = [WorkerBatch(i) for i in range(len(self.workers))]
        budgets = [self._budget()] * len(self.workers)
        for i, ws in enumerate(self.workers):
            ws.batch_open = self.config.mode is BatchMode.CONTINUOUS or self._forming(ws)
            if ws.healthy:
                self._prepare_running(i, budgets, batches[i])
        self._admit(budgets, batches)
        for i, ws in enumerate(self.workers):
            batches[i].released, ws.released = ws.released, []
        self.steps += 1
        return [b for b in batches if b.items or b.released]

    def postprocess(self, batches: list[WorkerBatch], sampled: dict[str, int]) -> None:
        """Record what the executions wrote and sampled; finished requests leave at once."""
        for batch in batches:
            for work in batch.items:
                seq = work.seq
                if seq.is_finished or seq.worker != batch.worker:
                    continue  # cancelled or moved while the execution ran
                seq.num_computed = work.start + work.num_tokens
                if work.sample:
                    self._append_token(seq, sampled[seq.request_id], batch.worker)
        self._reap()

    # ---- step parts ----------------------------------------------------------------------

    def _prepare_running(self, index: int, budgets: list[int], batch: WorkerBatch) -> None:
        ws = self.workers[index]
        for seq in list(ws.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(seq, budgets[index])
            if n == 0:
                continue
            if not self._make_room(index, seq, seq.num_computed + n):
                continue  # it preempted itself
            self._plan(ws, batch, budgets, index, seq, n)

    def _make_room(self, index: int, seq: Sequence, positions: int) -> bool:
        ws = self.workers[index]
        while not ws.pool.can_grow(seq.request_id, positions):
            victim = ws.running[-1]
            self._preempt(index, victim)
            if victim is seq:
                return False
        return True

    def _admit(self, budgets: list[int], batches: list[WorkerBatch]) -> None:
        self.head_reason = None
        while self.waiting:
            seq = self.waiting[0]
            first_reason: StallReason | None = None
            for index in self._by_free_kv():
                reason = self._why_not(index, seq, budgets[index])
                if reason is None:
                    self.waiting.popleft()
                    self.waiting_tokens -= seq.num_pending
                    self._start(index, seq, budgets, batches[index])
                    break
                first_reason = first_reason or reason
            else:
                if first_reason is not None:
                    self.head_reason = first_reason
                    self.stalls[first_reason.value] += 1
                return

    def _why_not(self, index: int, seq: Sequence, budget: int) -> StallReason | None:
        ws = self.workers[index]
        if not ws.batch_open:
            return StallReason.STATIC_BATCH
        if len(ws.running) >= self.config.max_running:
            return StallReason.MAX_RUNNING
        n = self._chunk(seq, budget)
        if n == 0:
            return StallReason.TOKEN_BUDGET
        now = blocks_for(seq.num_computed + n, ws.spec.block_size)
        need = now
        if self.config.policy is KvPolicy.RESERVE:
            need = blocks_for(seq.max_length(ws.spec.max_context), ws.spec.block_size)
        if need <= ws.pool.num_free:
            return None
        if now <= ws.pool.num_free + self._reserved_unused(ws):
            return StallReason.KV_RESERVED
        return StallReason.KV_CAPACITY

    def _start(self, index: int, seq: Sequence, budgets: list[int], batch: WorkerBatch) -> None:
        ws = self.workers[index]
        seq.status, seq.worker = SeqStatus.RUNNING, index
        n = self._chunk(seq, budgets[index])
        hold = seq.num_computed + n
        if self.config.policy is KvPolicy.RESERVE:
            hold = seq.max_length(ws.spec.max_context)
        ws.pool.grow(seq.request_id, hold)
        ws.running.append(seq)
        self.admitted += 1
        if seq.admitted_at is None:
            seq.admitted_at = self.clock()
            self.outbox.append(
                Event(seq.request_id, admitted=True, queue_time=seq.admitted_at - seq.arrival)
            )
        self._plan(ws, batch, budgets, index, seq, n)

    def _plan(
        self,
        ws: WorkerState,
        batch: WorkerBatch,
        budgets: list[int],
        index: int,
        seq: Sequence,
        n: int,
    ) -> None:
        end = seq.num_computed + n
        ws.pool.grow(seq.request_id, end)
        table = ws.pool.table(seq.request_id)[: blocks_for(end, ws.spec.block_size)]
        batch.items.append(Work(seq, seq.num_computed, n, end == seq.num_tokens, table))
        budgets[index] -= n
        self._planned[seq.request_id] = seq.num_computed + n

    # ---- helpers -------------------------------------------------------------------------

    def _budget(self) -> int:
        """Static batching predates token budgets: its batch is prefilled in one execution."""
        if self.config.mode is BatchMode.STATIC:
            return sys.maxsize
        return self.config.token_budget

    @staticmethod
    def _forming(ws: WorkerState) -> bool:
        """Static mode: a batch takes members until one of them has produced a token."""
        return not any(s.output_ids for s in ws.running)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` can process within `budget`: 1 in decode, a prompt (chunk) in prefill."""
        pending = seq.num_pending
        if self.config.chunked_prefill or seq.num_computed or seq.output_ids:
            return min(pending, budget)
        return pending if pending <= budget else 0

    def _reserved_unused(self, ws: WorkerState) -> int:
        """Blocks held by running requests beyond what they hold after this step."""
        bs = ws.spec.block_size
        return sum(
            ws.pool.allocated(s.request_id)
            - blocks_for(self._planned.get(s.request_id, s.num_computed), bs)
            for s in ws.running
        )

    def _by_free_kv(self) -> list[int]:
        healthy = [i for i, ws in enumerate(self.workers) if ws.healthy and not ws.draining]
        return sorted(healthy, key=lambda i: -self.workers[i].pool.num_free)

    def _append_token(self, seq: Sequence, token: int, index: int) -> None:
        seq.output_ids.append(token)
        self.outbox.append(Event(seq.request_id, token_id=token))
        max_context = self.workers[index].spec.max_context
        if token in seq.eos_ids and not seq.ignore_eos:
            self._finish(seq, Finish.STOP)
        elif len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= max_context:
            self._finish(seq, Finish.LENGTH)

    def _finish(self, seq: Sequence, finish: Finish, error: str = "") -> None:
        seq.status, seq.finish, seq.error = SeqStatus.FINISHED, finish, error
        self.finished += 1
        self.outbox.append(
            Event(seq.request_id, finish=finish, error=error, preemptions=seq.preemptions)
        )

    def _preempt(self, index: int, seq: Sequence) -> None:
        """Free `seq`'s KV and put it back at the front of the queue, to be recomputed."""
        self._release(index, seq)
        seq.status, seq.worker, seq.num_computed = SeqStatus.WAITING, None, 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        self.waiting_tokens += seq.num_pending

    def _release(self, index: int, seq: Sequence) -> None:
        ws = self.workers[index]
        ws.running.remove(seq)
        ws.pool.release(seq.request_id)
        ws.released.append(seq.request_id)
        self._planned.pop(seq.request_id, None)

    def _reap(self) -> None:
        for index, ws in enumerate(self.workers):
            for seq in [s for s in ws.running if s.is_finished]:
                self._release(index, seq)
                self.seqs.pop(seq.request_id, None)

    def _check_can_ever_run(self, seq: Sequence) -> None:
        prompt = len(seq.prompt_ids)
        healthy = [ws.spec for ws in self.workers if ws.healthy] or [self.workers[0].spec]
        context = max(spec.max_context for spec in healthy)
        capacity = max(spec.capacity for spec in healthy)
        if prompt >= context:
            self._refuse(
                "context",
                f"prompt of {prompt} tokens leaves no room to generate within the model's "
                f"context of {context} tokens; shorten the prompt",
            )
        need = seq.max_length(context)
        if need > capacity:
            self._refuse(
                "kv_capacity",
                f"request needs up to {need} KV positions (prompt {prompt} + max_tokens "
                f"{seq.max_tokens}) but a worker holds {capacity}; lower max_tokens or raise "
                f"the KV capacity",
            )
        if not self.config.chunked_prefill and prompt > self._budget():
            self._refuse(
                "token_budget",
                f"prompt of {prompt} tokens exceeds the token budget of "
                f"{self.config.token_budget} and chunked prefill is off; enable it or raise "
                f"the budget",
            )

    def _refuse(self, reason: str, message: str) -> None:
        self.refused[reason] += 1
        raise Refused(reason, message)

    def snapshot(self) -> Snapshot:
        now = self.clock()
        return Snapshot(
            waiting=len(self.waiting),
            waiting_tokens=self.waiting_tokens,
            running=sum(len(ws.running) for ws in self.workers),
            workers=[self._kv_of(ws) for ws in self.workers],
            stalls=dict(self.stalls),
            head_wait_reason=self.head_reason.value if self.head_reason and self.waiting else "",
            steps=self.steps,
            admitted=self.admitted,
            finished=self.finished,
            preemptions=self.preemptions,
            refused=dict(self.refused),
            # FCFS: the head arrived first (preempted requests return to the front)
            oldest_wait=now - self.waiting[0].arrival if self.waiting else 0.0,
        )

    def _kv_of(self, ws: WorkerState) -> WorkerKv:
        bs = ws.spec.block_size
        written = sum(s.num_computed for s in ws.running)
        allocated = (ws.pool.num_blocks - ws.pool.num_free) * bs
        return WorkerKv(
            name=ws.spec.name,
            capacity=ws.spec.capacity,
            written=written,
            reserved_unwritten=allocated - written,
            free=ws.pool.num_free * bs,
            running=len(ws.running),
            healthy=ws.healthy,
            draining=ws.draining,
        )
