"""The core's state, and the few steps every concern of it takes: finish, preempt, reap,
chunk a request's pending tokens, plan its chunk into a step."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable

from scheduler_svc.config import BatchMode, CoreConfig, KvPolicy, WorkerSpec
from scheduler_svc.kv_records import KvRecords
from scheduler_svc.output import Event
from scheduler_svc.reasons import StallReason
from scheduler_svc.request_queue import RequestQueue, create_request_queue
from scheduler_svc.run_rule import ArrivalRate
from scheduler_svc.sequence import NO_HANDLE, Finish, SeqStatus, Sequence
from scheduler_svc.speculation.potential import Potential
from scheduler_svc.speculation.proposer import Proposer
from scheduler_svc.speculation.suffix import SuffixIndex
from scheduler_svc.step import Step, Work
from scheduler_svc.step_cost import BatchShape
from scheduler_svc.step_model import BUILTIN_PRIOR, StepPredictor
from scheduler_svc.worker_state import WorkerState

RUNNING, FINISHED = SeqStatus.RUNNING, SeqStatus.FINISHED


class CoreState:
    """What the scheduler holds: settings, workers, the waiting queue, every request in flight
    and the counters. The concerns (the other modules here) each extend it with their steps."""

    def __init__(
        self,
        config: CoreConfig,
        workers: Iterable[WorkerSpec] = (),
        clock: Callable[[], float] = time.monotonic,
        predict: StepPredictor | None = None,
    ) -> None:
        """`predict`: (worker index, step shape) -> seconds, each worker's step-time model, for
        --step-time-budget-ms (without one, a fixed prior that over-predicts)."""
        self.config = config
        self.predict = predict or _prior
        self.time_full: set[int] = set()  # workers whose last step left no time for the head
        self.chunked = config.chunked_prefill
        self.reserve = config.policy is KvPolicy.RESERVE
        self.static = config.mode is BatchMode.STATIC
        self.caching = config.prefix_caching and not self.reserve
        self.kv_records = KvRecords(live=True)  # what the KV layer keeps per request, for all
        self.workers: list[WorkerState] = []
        for spec in workers:
            self.add_worker(spec)
        self.clock = clock
        # seconds a request no live worker can hold waits for a failed one that could to come
        # back (a scheduler resumed after a stall, a worker restarted); 0 = it fails at once
        self.return_wait = 0.0
        self.waiting: RequestQueue = create_request_queue(config.queue_policy, clock)
        self.waiting.eta = self._first_token_eta
        self.waiting_tokens = 0  # sum of num_pending over `waiting`, kept as it changes
        self.seqs: dict[str, Sequence] = {}
        self.stalls: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.head_reason: StallReason | None = None
        self.steps = self.admitted = self.finished = self.preemptions = 0
        self.generated = 0  # tokens sampled and kept
        self.wakes: set[int] = set()  # workers that should plan: the head waits for them
        self.stop_ids: frozenset[int] = frozenset()  # every request's stop tokens, together
        self.setting_changes: Counter[str] = Counter()  # live changes applied, by setting
        self.longest_run = 1  # the most executions a step has been planned with (--decode-steps)
        self.run_steps = 0  # steps planned with several executions
        self.arrivals = ArrivalRate()  # requests added per second, recently (--decode-runs auto)
        # speculative decoding (--speculative): the proposer, and vLLM's counters of the drafts
        self.proposer = Proposer.of(config)
        self.kept_suffix: SuffixIndex | None = None  # the last suffix index, across switches
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.spec_accepted_per_pos: Counter[int] = Counter()  # draft position (0-based) -> kept
        # what speculation would give on the finished requests (--speculation-potential)
        self.potential = Potential()
        # (head, admitted, finished, preemptions) when the head last found nobody to preempt,
        # and the workers it was asked for then
        self._found_nobody: tuple[tuple, set[int]] = ((), set())

    def add_worker(self, spec: WorkerSpec) -> int:
        """A worker joins: it takes admissions from its first step."""
        index = len(self.workers)
        self.workers.append(WorkerState(spec, index, self.caching, self.kv_records))
        return index

    def take_wakes(self) -> set[int]:
        wakes, self.wakes = self.wakes, set()
        return wakes

    def abort(
        self, request_id: str, finish: Finish = Finish.CANCELLED, error: str = ""
    ) -> list[Event]:
        """Finish a request now; a running one frees its KV at its worker's next step. Returns
        its finish (none if it is unknown or finished already)."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return []
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            self.waiting_tokens -= seq.num_pending
        event = self._finish(seq, finish, error)
        if seq.worker is None:
            del self.seqs[request_id]
        return [event]

    def _finish(self, seq: Sequence, finish: Finish, error: str = "") -> Event:
        seq.status, seq.finish, seq.error = FINISHED, finish, error
        seq.drafting = False  # planned into no step again: a draft in flight is dropped
        self.finished += 1
        if self.proposer is not None:
            self.proposer.learn(seq)
        cfg = self.config
        if cfg.speculation_potential and finish in (Finish.STOP, Finish.LENGTH):
            self.potential.observe(
                seq.prompt_ids, seq.output_ids, cfg.num_speculative_tokens,
                cfg.prompt_lookup_min, cfg.prompt_lookup_max, self._pricer(seq.worker),
            )  # fmt: skip
        if seq.worker is not None and seq.handle != NO_HANDLE:
            self.workers[seq.worker].done.append((seq, seq.handle))
            seq.handle, seq.max_planned = NO_HANDLE, 0
        return Event(seq.request_id, finish=finish, error=error, preemptions=seq.preemptions)

    def _pricer(self, worker: int | None):
        """A step of one request on `worker` by its step-time model: (position of the token it
        feeds, draft length) -> seconds; None for a request that ran nowhere."""
        if worker is None:
            return None

        def price(position: int, drafted: int) -> float:
            shape = BatchShape.draft(position, drafted) if drafted else None
            return self.predict(worker, shape or BatchShape.item(position, 1, True))

        return price

    def _preempt(self, ws: WorkerState, seq: Sequence, cache: bool = True) -> None:
        """Free `seq`'s KV and put it back at the front of the queue, to be recomputed."""
        ws.running.remove(seq)
        ws.prefilling.discard(seq)
        ws.kv.free(seq, keep_cache=cache)  # its recompute (or another request) may find these
        ws.released.append(seq.handle)
        seq.status, seq.worker, seq.handle = SeqStatus.WAITING, None, NO_HANDLE
        seq.num_computed, seq.drafting = 0, False
        seq.num_planned = seq.num_tokens
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.prepend(seq)
        self.waiting_tokens += seq.num_planned

    def _reap(self, ws: WorkerState) -> None:
        if not ws.done:
            return
        for seq, handle in ws.done:
            ws.prefilling.discard(seq)
            ws.kv.free(seq, keep_cache=seq.finish is not Finish.ERROR)  # an error's is suspect
            ws.released.append(handle)
            if self.seqs.get(seq.request_id) is seq:
                del self.seqs[seq.request_id]
        ws.done = []
        ws.running = [s for s in ws.running if s.status is RUNNING]

    def _stall(self, ws: WorkerState, reason: StallReason) -> None:
        """The head of the queue waits, for `reason` on `ws` (its best worker)."""
        self.head_reason = reason
        self.stalls[reason] += 1
        ws.stalls[reason] += 1

    def _first_token_eta(self, seq: Sequence) -> float:
        """The seconds `seq`'s prompt is predicted to take once admitted: its chunks of the token
        budget, each alone in a step of the first live worker (the least it can take there)."""
        worker = next((ws.index for ws in self.workers if ws.live), 0)
        budget, total, start = self._full_budget(), 0.0, 0
        pending = seq.num_pending
        for _ in range(min(64, -(-pending // budget))):  # the first 64 chunks: a bound is enough
            n = min(budget, pending - start)
            total += self.predict(worker, BatchShape.item(start, n, start + n == pending))
            start += n
        return total

    def _full_budget(self) -> int:
        """Static batching predates token budgets: its batch is prefilled in one execution."""
        return sys.maxsize if self.static else self.config.token_budget

    def _chunk(self, seq: Sequence, budget: int, start: int = 0) -> int:
        """Tokens `seq` can process within `budget`: 1 in decode, a prompt (chunk) in prefill;
        a request being admitted with `start` positions cached computes from there."""
        pending = seq.num_planned - max(seq.num_computed, start)
        if self._divisible(seq):
            return min(pending, budget)
        return pending if pending <= budget else 0

    def _divisible(self, seq: Sequence) -> bool:
        """Its pending tokens may be split across steps: chunked prefill, or a recompute."""
        return bool(self.chunked or seq.num_computed or seq.output_ids)

    def _plan_chunk(self, ws: WorkerState, step: Step, seq: Sequence, n: int) -> None:
        start = seq.num_computed
        sample = start + n == seq.num_planned
        work = Work(seq, seq.handle, start, n, sample)
        step.chunks.append(work)
        if step.timer is not None:
            step.timer.add(start, n, sample)
        seq.num_computed = start + n
        if self.caching:
            work.blocks = ws.kv.blocks(seq, start, start + n)
            ws.kv.commit(seq, start, start + n)
        if sample:
            seq.num_planned += 1
            ws.prefilling.discard(seq)
        else:
            ws.prefilling.add(seq)


def _prior(worker: int, shape: BatchShape) -> float:
    """The step time of a worker without a model of its own: the built-in prior."""
    return BUILTIN_PRIOR.predict(shape)
