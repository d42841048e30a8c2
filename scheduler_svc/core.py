"""The batching core: one `schedule()` per model execution of a worker, as in the seed's Figure 2.

1. clean up finished requests (free their KV)                       -> `_reap`
2. prepare the running requests' next work (grow KV; preempt if paged KV runs out)
3. admit waiting requests in FCFS order while budget, running limit and KV allow
4. the caller executes the step and hands the sampled tokens back to `complete`

Every worker has its own step loop over the one shared FCFS queue. A step may be planned while
the worker's previous step still runs (overlap): a request then decodes the token the worker
sampled in that step, which the core learns one step late (`Sequence.num_inflight`).

Prefix caching (paged only): a request admitted to a worker starts from the longest run of full
blocks of its tokens that the worker's pool already holds (`KvManager.hit`), shared by
reference, and computes only the rest. A block is cached when a chunk completes it (readable from
the next step on) and, for generated tokens, when its request leaves. `reserve` keeps it off:
reserving the maximum length per request is the contiguous allocation of servers before paging,
which cannot share, and it is the baseline the seed's figures compare against.
"""

from __future__ import annotations

import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from functools import partial

from llmcommon.request_checks import context_problem
from scheduler_svc.blocks import blocks_for
from scheduler_svc.config import BatchMode, CoreConfig, KvPolicy, WorkerSpec
from scheduler_svc.kv import FailedWork, KeyMemo
from scheduler_svc.live_settings import stranded
from scheduler_svc.output import Event, Outputs, Refused, Snapshot, StepTokens
from scheduler_svc.reasons import RefusalReason, StallReason
from scheduler_svc.sequence import NO_HANDLE, Finish, SeqStatus, Sequence
from scheduler_svc.step import Step, Work
from scheduler_svc.step_cost import BatchShape, step_shape
from scheduler_svc.step_model import BUILTIN_PRIOR, StepPredictor
from scheduler_svc.time_budget import StepTimer
from scheduler_svc.worker_state import WorkerState

RUNNING, FINISHED = SeqStatus.RUNNING, SeqStatus.FINISHED
RUN_LIMIT_S = 0.1  # the longest a step of several executions is predicted to take (--decode-steps)


@dataclass(frozen=True, slots=True)
class Placement:
    """The head of the queue goes to `worker`, starting from the cached blocks `hit`."""

    worker: WorkerState
    hit: list[int]


@dataclass(frozen=True, slots=True)
class Stall:
    """The head of the queue waits: `reason`, on its best worker."""

    worker: WorkerState
    reason: StallReason


class Scheduler:
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
        self.key_memo = KeyMemo()  # shared by the workers' KV managers
        self.workers: list[WorkerState] = []
        for spec in workers:
            self.add_worker(spec)
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
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

    # ---- workers in and out --------------------------------------------------------------

    def add_worker(self, spec: WorkerSpec) -> int:
        """A worker joins: it takes admissions from its first step."""
        index = len(self.workers)
        self.workers.append(WorkerState(spec, index, self.caching, self.key_memo))
        return index

    def remove_worker(self, index: int) -> None:
        """A worker has left the stack (drained, or gone for good): requeue what it held."""
        ws = self.workers[index]
        if ws.running or ws.done:
            self.fail_worker(index)
        ws.healthy, ws.gone = False, True

    def fail_worker(self, index: int) -> list[Sequence]:
        """A worker is gone: requeue its requests (prompt + generated) for recompute elsewhere."""
        ws = self.workers[index]
        ws.healthy = False
        self._reap(ws)
        moved = list(ws.running)
        for seq in reversed(moved):  # newest first: the oldest ends at the queue's front
            self._preempt(ws, seq)
        ws.reset_pool()
        return moved

    def restore_worker(self, index: int, spec: WorkerSpec | None = None) -> None:
        """A failed worker answers again (a replacement may bring another pool)."""
        ws = self.workers[index]
        ws.reset_pool(spec)
        ws.healthy, ws.draining, ws.gone = True, False, False

    def drain_worker(self, index: int) -> None:
        """The worker is stopping: its running requests finish there; nothing new joins it."""
        self.workers[index].draining = True

    # ---- settings changed live -----------------------------------------------------------

    def reconfigure(self, config: CoreConfig) -> None:
        """New settings, followed from each worker's next plan. reserve -> paged releases the
        reservations' unwritten blocks at once (the worker's next step trims those tables);
        paged -> reserve lets the running requests grow as paged ones until they finish and
        admits a reservation only beside the blocks they may still take, so none is
        oversubscribed. ValueError, and nothing changes, if a request could then never run."""
        problem = stranded(config, self.seqs.values())
        if problem:
            raise ValueError(problem)
        release = self.reserve and config.policy is KvPolicy.PAGED
        for f in fields(CoreConfig):
            if getattr(config, f.name) != getattr(self.config, f.name):
                self.setting_changes[f.name] += 1
        self.config, self.chunked = config, config.chunked_prefill
        self.reserve = config.policy is KvPolicy.RESERVE
        self.static = config.mode is BatchMode.STATIC
        self.caching = config.prefix_caching and not self.reserve
        for ws in self.workers:
            ws.caching = self.caching
            ws.kv.set_caching(self.caching)
            for seq in ws.running if release else ():
                if seq.handle == NO_HANDLE:
                    continue  # finished since its last step: all its blocks go at the next
                keep = ws.kv.trim(seq)
                if keep is not None:
                    ws.trims.append((seq.handle, keep))

    # ---- requests in and out -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs:
            self._refuse(
                RefusalReason.DUPLICATE, f"request id {seq.request_id!r} is already in flight"
            )
        self._check_can_ever_run(seq)
        seq.status, seq.arrival = SeqStatus.WAITING, seq.arrival or self.clock()
        self.seqs[seq.request_id] = seq
        self.stop_ids |= seq.stop_ids
        seq.stepwise = _stepwise(seq.sampling)
        self.waiting.append(seq)
        self.waiting_tokens += seq.num_pending

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

    def take_wakes(self) -> set[int]:
        wakes, self.wakes = self.wakes, set()
        return wakes

    # ---- one step ------------------------------------------------------------------------

    def schedule(self, index: int) -> Step:
        """The next execution of one worker (its own step loop calls this)."""
        return self.schedule_workers([index])[0]

    def schedule_all(self) -> list[Step]:
        """One execution on every live worker at once (lock-step: tests and the simulator)."""
        healthy = [ws.index for ws in self.workers if ws.healthy]
        steps = self.schedule_workers(healthy)
        return [s for s in steps if s.has_work or s.released or s.failed]

    def schedule_workers(self, indices: list[int]) -> list[Step]:
        """The next execution of each of these workers, planned together (one FCFS pass over
        the queue). What the planning did comes with the steps: each step's admissions, and
        on the first step the requests failed because no live worker can ever hold them."""
        steps: dict[int, Step] = {}
        budget = sys.maxsize if self.static else self.config.token_budget
        limit = 0.0 if self.static else self.config.step_time_budget_ms / 1e3
        for index in indices:
            ws = self.workers[index]
            ws.kv.sent()  # the steps that write what they cached have been sent
            self._reap(ws)
            if not ws.running:
                ws.batch_closed = False
            step = steps[index] = Step(index, budget)
            if limit:
                window_limit = ws.time_limit(limit, self.config.step_time_window)
                step.timer = StepTimer(partial(self.predict, index), window_limit)
            if ws.healthy:
                self._prepare_running(ws, step)
        failed: list[Event] = []
        self._admit(steps, failed)
        if failed:
            next(iter(steps.values())).failed = failed
        if limit:
            self._note_time_left(steps)
        else:
            self.time_full.clear()
        if self.config.decode_steps > 1 and not self.waiting:
            for index, step in steps.items():
                self._lengthen(self.workers[index], step)
        for index, step in steps.items():
            ws = self.workers[index]
            if self.static and step.has_work:  # the batch has started: nothing joins it now
                ws.batch_closed = True
            step.released, ws.released = ws.released, []
            if ws.trims:  # those of requests released since are moot (the worker forgot them)
                gone = set(step.released)
                step.trims, ws.trims = [t for t in ws.trims if t[0] not in gone], []
            if step.has_work:  # executions; release-only and empty steps are not
                ws.steps += step.repeat
                self.steps += step.repeat
                if step.timer is not None:
                    ws.planned_s.extend([step.timer.predicted()] * step.repeat)
        return list(steps.values())

    def complete(self, step: Step, tokens: list[int]) -> Outputs:
        """Record what an execution sampled: `tokens` in the step's order (sampling chunks,
        then decodes). A request preempted, moved or finished since the step was planned has
        another handle (or none): its token is dropped, never emitted. Returns the tokens
        kept and the requests that finished."""
        if step.repeat > 1:
            return self._complete_run(step, tokens)
        sampling = [w for w in step.chunks if w.sample] if step.chunks else None
        decodes = step.decodes
        seqs = [w.seq for w in sampling] + decodes if sampling else decodes
        emitted = StepTokens(seqs, tokens)
        outputs = Outputs(emitted)
        finishes = outputs.finishes
        self.generated += len(tokens)
        if sampling:
            for work, token in zip(sampling, tokens, strict=False):
                if work.seq.handle == work.handle:
                    self._sampled(work.seq, token, finishes)
                else:
                    self._drop(emitted, work.seq)
            tokens = tokens[len(sampling) :]
        # the usual step has no stop token at all: one isdisjoint instead of a lookup per token
        check_stops = not self.stop_ids.isdisjoint(tokens)
        for seq, handle, token in zip(decodes, step.decode_handles, tokens, strict=True):
            if seq.handle != handle:
                self._drop(emitted, seq)
                continue
            out = seq.output_ids
            out.append(token)
            if check_stops and token in seq.stop_ids:
                finishes.append(self._finish(seq, Finish.STOP))
            elif len(out) >= seq.max_out:
                finishes.append(self._finish(seq, Finish.LENGTH))
        return outputs

    def _complete_run(self, step: Step, tokens: list[int]) -> Outputs:
        """A step of several executions of its decodes: `tokens` holds `repeat` groups of
        them, execution by execution. A request keeps its tokens up to the one that finishes
        it (a stop token, its length); the worker computed the rest, which are dropped."""
        decodes, n = step.decodes, len(step.decodes)
        if len(tokens) != n * step.repeat:
            raise ValueError(f"{len(tokens)} tokens for {step.repeat} executions of {n} decodes")
        live = [seq.handle == h for seq, h in zip(decodes, step.decode_handles, strict=True)]
        kept_seqs: list[Sequence] = []
        kept: list[int] = []
        finishes: list[Event] = []
        for first in range(0, len(tokens), n):
            for i, token in enumerate(tokens[first : first + n]):
                if not live[i]:
                    continue
                seq = decodes[i]
                seq.output_ids.append(token)
                kept_seqs.append(seq)
                kept.append(token)
                if token in seq.stop_ids:
                    finishes.append(self._finish(seq, Finish.STOP))
                    live[i] = False
                elif len(seq.output_ids) >= seq.max_out:
                    finishes.append(self._finish(seq, Finish.LENGTH))
                    live[i] = False
        self.generated += len(kept)
        return Outputs(StepTokens(kept_seqs, kept), finishes=finishes)

    def _drop(self, emitted: StepTokens, seq: Sequence) -> None:
        self.generated -= 1
        if emitted.dropped is None:
            emitted.dropped = set()
        emitted.dropped.add(seq)

    def fail_items(self, step: Step, failed: dict[int, str], where: str) -> list[Event]:
        """The worker could not run these requests (by handle): each fails alone, the rest of
        the step stands. Their work leaves the step, so `complete` gets the others' tokens.
        Returns their finishes."""
        self._distrust(step, set(failed))
        finishes = []
        for seq in self.workers[step.worker].running:
            if seq.handle in failed and not seq.is_finished:
                error = f"worker {where} could not run this request: {failed[seq.handle]}"
                finishes.append(self._finish(seq, Finish.ERROR, error))
        step.chunks = [w for w in step.chunks if w.handle not in failed]
        kept = [
            p for p in zip(step.decodes, step.decode_handles, strict=True) if p[1] not in failed
        ]
        step.decodes = [seq for seq, _ in kept]
        step.decode_handles = [handle for _, handle in kept]
        return finishes

    def fail_unplaceable(self) -> list[Event]:
        """After the live workers changed: fail every waiting request that none of them can ever
        hold (when none is live, every waiting request). No step loop may be left to see it.
        Returns their finishes."""
        failed = []
        for seq in list(self.waiting):
            if not self._candidates(seq, live=True):
                failed += self.abort(seq.request_id, Finish.ERROR, self._no_worker_message(seq))
        return failed

    def _no_worker_message(self, seq: Sequence) -> str:
        """Why no live worker can hold `seq`: none can at all, or only those down."""
        live = sum(ws.live for ws in self.workers)
        if self._candidates(seq, live=False):
            return (
                f"no live worker can hold this request (the workers that could are failed or "
                f"draining; {live} live); retry"
            )
        return f"no worker can hold this request ({live} live); retry"

    def fail_step(self, step: Step, error: str) -> list[Event]:
        """The worker answered that this execution raised: fail its requests (re-queueing them
        would carry a request that breaks the model to every worker). Returns their finishes."""
        failed = []
        self._distrust(step, {w.handle for w in step.chunks} | set(step.decode_handles))
        for seq, handle in [(w.seq, w.handle) for w in step.chunks] + list(
            zip(step.decodes, step.decode_handles, strict=True)
        ):
            if seq.handle == handle and not seq.is_finished:
                failed.append(self._finish(seq, Finish.ERROR, error))
        return failed

    # ---- step parts ----------------------------------------------------------------------

    def _prepare_running(self, ws: WorkerState, step: Step) -> None:
        """Every running request's next work, in admission order, within the token budget.
        The usual step (only decodes, the budget enough for all) takes a loop of its own."""
        if ws.prefilling or step.budget < len(ws.running):
            return self._prepare_within_budget(ws, step)
        decodes, handles = step.decodes, step.decode_handles
        add_decode, add_handle = decodes.append, handles.append
        for seq in ws.running:  # a preemption removes from the end: safe to iterate
            computed, known = seq.num_computed, seq.known
            if known >= seq.stop_at:
                continue  # finished, or its last token is in flight: nothing to compute
            if computed >= seq.held and not self._make_room(ws, seq, computed + 1, step):
                continue  # it preempted itself
            seq.num_computed, seq.known = computed + 1, known + 1
            add_decode(seq)
            add_handle(seq.handle)
        step.budget -= len(decodes)
        if step.timer is not None:  # decodes always run, whatever their predicted time
            step.timer.add_decodes(sum(s.num_computed for s in decodes), len(decodes))

    def _prepare_within_budget(self, ws: WorkerState, step: Step) -> None:
        """A request decodes when the worker holds its next token (its last work sampled);
        otherwise its next tokens are prompt (or recompute) tokens, sent as a chunk. Under a
        step-time budget the decodes are counted first (they always run) and a chunk is cut to
        the time left, the first one of the step to at least one token."""
        timer, ahead = step.timer, 0
        if timer is not None:
            decoding = [s for s in ws.running if s not in ws.prefilling and s.known < s.stop_at]
            timer.add_decodes(sum(s.num_computed + 1 for s in decoding), len(decoding))
            ahead = len(decoding)
        for seq in ws.running:
            computed, known = seq.num_computed, seq.known
            if known >= seq.stop_at or step.budget == 0:
                continue  # finished, its last token in flight, or no budget left
            if seq not in ws.prefilling:
                if computed >= seq.held and not self._make_room(ws, seq, computed + 1, step):
                    continue
                seq.num_computed, seq.known = computed + 1, known + 1
                step.decodes.append(seq)
                step.decode_handles.append(seq.handle)
                step.budget -= 1
                continue
            n = self._chunk(seq, step.budget)
            if n and timer is not None:
                n = timer.cut(computed, n, computed + n == known, least=int(not step.chunks))
            if n and (computed + n <= seq.held or self._make_room(ws, seq, computed + n, step)):
                step.budget -= n
                self._plan_chunk(ws, step, seq, n)
        if timer is not None and len(step.decodes) != ahead:  # a decode was cut (preempted, or
            timer.shape = step_shape(step)  # no budget left): what the step holds, anew

    def _plan_chunk(self, ws: WorkerState, step: Step, seq: Sequence, n: int) -> None:
        start = seq.num_computed
        sample = start + n == seq.known
        work = Work(seq, seq.handle, start, n, sample)
        step.chunks.append(work)
        if step.timer is not None:
            step.timer.add(start, n, sample)
        seq.num_computed = start + n
        if self.caching:
            work.blocks = ws.kv.blocks(seq, start, start + n)
            ws.kv.commit(seq, start, start + n)
        if sample:
            seq.known += 1
            ws.prefilling.discard(seq)
        else:
            ws.prefilling.add(seq)

    def _lengthen(self, ws: WorkerState, step: Step) -> None:
        """Nothing waits and the step only decodes: run its decodes up to --decode-steps times,
        each execution feeding the next the token it sampled. As many as every request may
        still sample (its length, its context) and hold KV for without preempting anyone; a
        request whose tokens are taken one at a time (logprobs, a grammar) keeps the step
        at one execution. A run is predicted to last at most RUN_LIMIT_S: where one execution
        takes longer (a large batch on a CPU) a run would hold a new arrival back for long and
        save little (the control plane's cost per token is small there). The blocks taken stay
        granted even if the run comes out shorter."""
        decodes = step.decodes
        if step.chunks or not decodes:
            return
        runs = self.config.decode_steps
        for seq in decodes:
            if seq.stepwise:
                return
            runs = min(runs, seq.stop_at - seq.known + 1)
        if runs < 2:
            return
        one = self.predict(ws.index, step_shape(step))  # an execution, as the worker's model says
        if one > 0:
            runs = min(runs, max(1, int(RUN_LIMIT_S / one)))
            if runs < 2:
                return
        granted = {handle: i for i, (handle, _) in enumerate(step.grants)}
        for seq in decodes:
            need = seq.num_computed + runs - 1
            if need <= seq.held:
                continue
            new = ws.kv.allocate(seq, need)
            if new is None:
                runs = min(runs, seq.held - seq.num_computed + 1)
                continue
            if seq.handle in granted:  # its table grew in this step already: one grant
                i = granted[seq.handle]
                step.grants[i] = (seq.handle, step.grants[i][1] + new)
            else:
                step.grants.append((seq.handle, new))
        if runs < 2:
            return
        for seq in decodes:
            seq.num_computed += runs - 1
            seq.known += runs - 1
        step.repeat = runs
        self.longest_run = max(self.longest_run, runs)
        self.run_steps += 1

    def _make_room(self, ws: WorkerState, seq: Sequence, positions: int, step: Step) -> bool:
        """Blocks for `seq` to hold `positions`, preempting the newest running requests until
        they fit; False if `seq` itself was preempted."""
        while (new := ws.kv.allocate(seq, positions)) is None:
            victim = ws.running[-1]
            self._preempt(ws, victim)
            if victim is seq:
                return False
        step.grants.append((seq.handle, new))
        return True

    def _admit(self, steps: dict[int, Step], failed: list[Event]) -> None:
        """Admit from the queue's head, in order, until it must wait. A request that no live
        worker can ever hold fails (its finish into `failed`), never waits."""
        self.head_reason = None
        waiting = self.waiting
        while waiting:
            seq = waiting[0]
            place = self._place(seq, steps)
            if place is None:
                failed += self.abort(seq.request_id, Finish.ERROR, self._no_worker_message(seq))
                continue
            if type(place) is Stall:
                return self._stall(place.worker, place.reason)
            ws, hit = place.worker, place.hit
            step = steps.get(ws.index)
            if step is None:
                self.wakes.add(ws.index)  # its place is on a worker not planning now
                return
            start = len(hit) * ws.spec.block_size
            n = self._chunk(seq, step.budget, start)
            if n == 0:
                return self._stall(ws, StallReason.TOKEN_BUDGET)
            if step.timer is not None:
                n = self._cut_to_time(seq, step, start, n)
                if n == 0:
                    return self._stall(ws, StallReason.TIME_BUDGET)
            waiting.popleft()
            self.waiting_tokens -= seq.known
            self._start(ws, seq, step, n, hit)

    def _cut_to_time(self, seq: Sequence, step: Step, start: int, n: int) -> int:
        """Of the head's `n` tokens from `start`, those that fit the step's time left; in a step
        with nothing else, at least one (its whole prompt, without chunking)."""
        assert step.timer is not None
        return step.timer.cut(
            start, n, start + n == seq.known, least=int(not step.has_work),
            whole=not self._divisible(seq),
        )  # fmt: skip

    def _note_time_left(self, steps: dict[int, Step]) -> None:
        """Remember which of the planned workers have no time left for another token: while
        their loops run that step, the head goes to a worker that has (`_out_of_time`)."""
        for index, step in steps.items():
            if step.timer is not None and step.has_work and not step.timer.cut(0, 1, False):
                self.time_full.add(index)
            else:
                self.time_full.discard(index)

    def _out_of_time(self, ws: WorkerState, steps: dict[int, Step]) -> StallReason | None:
        """TIME_BUDGET when `ws`'s step (being planned, or its last) has no time left for the
        head; an empty step always has (it must make progress)."""
        step = steps.get(ws.index)
        if step is None:
            return StallReason.TIME_BUDGET if ws.index in self.time_full else None
        if step.timer is None or not step.has_work or step.timer.cut(0, 1, False):
            return None
        return StallReason.TIME_BUDGET

    def _stall(self, ws: WorkerState, reason: StallReason) -> None:
        """The head of the queue waits, for `reason` on `ws` (its best worker)."""
        self.head_reason = reason
        self.stalls[reason] += 1
        ws.stalls[reason] += 1

    def _place(self, seq: Sequence, steps: dict[int, Step]) -> Placement | Stall | None:
        """The worker for the head of the queue and the cached blocks it would reuse there:
        among the live workers that can ever hold it, the best one whose running limit and KV
        allow it now. Best = the most free KV positions plus positions found in its prefix
        cache: a cached position is one the request need not take from the pool nor compute,
        so a long cached history outweighs a little more free KV, while a short shared system
        prompt does not pull every request onto one worker. Otherwise it stalls on the best
        one, for that one's reason; None if no live worker can ever hold it."""
        candidates = self._candidates(seq, live=True)
        if not candidates:
            return None
        if len(candidates) == 1:  # a full worker needs no cache hit (and no key) to refuse
            full = self._worker_full(candidates[0])
            if full is not None:
                return Stall(candidates[0], full)
        hits = {ws.index: ws.kv.hit(seq) for ws in candidates}
        if len(candidates) > 1:
            candidates.sort(
                key=lambda w: (
                    -w.free_positions - len(hits[w.index]) * w.spec.block_size,
                    w.index not in steps,
                    w.index,
                )
            )
        first: StallReason | None = None
        for ws in candidates:
            reason = self._why_not(ws, seq, hits[ws.index]) or self._out_of_time(ws, steps)
            if reason is None:
                return Placement(ws, hits[ws.index])
            first = first or reason
        assert first is not None
        return Stall(candidates[0], first)

    def _candidates(self, seq: Sequence, live: bool) -> list[WorkerState]:
        """Workers whose context and pool can ever hold `seq`; those that hold all of prompt +
        max_tokens come first, a shorter context (finishing early) only if none does."""
        full: list[WorkerState] = []
        partial: list[WorkerState] = []
        want = len(seq.prompt_ids) + seq.max_tokens
        for ws in self.workers:
            if ws.gone or (live and not ws.live):
                continue
            spec = ws.spec
            if seq.known >= spec.max_context:
                continue
            if blocks_for(min(want, spec.max_context), spec.block_size) > spec.num_blocks:
                continue
            (full if want <= spec.max_context else partial).append(ws)
        return full or partial

    def _why_not(self, ws: WorkerState, seq: Sequence, hit: list[int]) -> StallReason | None:
        """The per-worker limits that do not depend on the step's token budget. With `hit`
        cached blocks, the request needs blocks for the rest only, plus the cached ones that
        nobody holds (sharing takes them out of the evictable, counted-free ones)."""
        full = self._worker_full(ws)
        if full is not None:
            return full
        start = len(hit) * ws.spec.block_size
        end = start + self._chunk(seq, self._full_budget(), start)
        reserve = seq.max_length(ws.spec.max_context) if self.reserve else None
        return ws.kv.why_not_admit(hit, end, reserve, ws.running)

    def _worker_full(self, ws: WorkerState) -> StallReason | None:
        """The limits of a worker that no request can pass now, whatever its tokens."""
        if self.static and ws.batch_closed and ws.running:
            return StallReason.STATIC_BATCH
        if len(ws.running) >= self.config.max_running:
            return StallReason.MAX_RUNNING
        return None

    def _start(self, ws: WorkerState, seq: Sequence, step: Step, n: int, hit: list[int]) -> None:
        seq.status, seq.worker = RUNNING, ws.index
        seq.handle, ws.next_handle = ws.next_handle, ws.next_handle + 1
        seq.stop_at = seq.max_length(ws.spec.max_context)
        seq.max_out = seq.stop_at - len(seq.prompt_ids)
        seq.suspect = False  # what it computes from here is computed anew
        if hit:
            ws.kv.share(seq, hit)
            step.shares.append((seq.handle, hit))
            seq.num_computed = len(hit) * ws.spec.block_size
        seq.cached_to = seq.num_computed  # shared blocks are cached; its own, not yet
        ws.prompt_tokens += seq.known
        ws.hit_tokens += seq.num_computed
        new = ws.kv.allocate(seq, seq.stop_at if self.reserve else seq.num_computed + n)
        assert new is not None, "admitted without room"  # `_why_not` found it
        step.grants.append((seq.handle, new))
        step.added.append(seq)
        ws.running.append(seq)
        self.admitted += 1
        if seq.admitted_at is None:
            seq.admitted_at = self.clock()
            step.admissions.append(
                Event(
                    seq.request_id,
                    admitted=True,
                    queue_time=seq.admitted_at - seq.arrival,
                    cached_tokens=seq.num_computed,
                )
            )
        step.budget -= n
        self._plan_chunk(ws, step, seq, n)

    # ---- the prefix cache ----------------------------------------------------------------

    def _distrust(self, step: Step, handles: set[int]) -> None:
        """These items of a step failed: the KV they wrote, and everything computed over it
        since (with overlap, later steps were planned over it), is not to be trusted
        (`KvManager.distrust`). A request that filled a block over a distrusted one goes back
        to the queue (admitted with overlap before the failure was known), or, if it has
        finished since, caches nothing when it leaves."""
        if not self.caching:
            return
        ws = self.workers[step.worker]
        failed = [
            self._failed_work(ws, w.seq, w.handle, w.start, w.blocks)
            for w in step.chunks
            if w.handle in handles
        ]
        failed += [  # a decode writes past the prompt
            self._failed_work(ws, seq, h, len(seq.prompt_ids), [])
            for seq, h in zip(step.decodes, step.decode_handles, strict=True)
            if h in handles
        ]
        others = [s for s in ws.running if s.handle not in handles]
        for seq in ws.kv.distrust(failed, others):
            if seq.is_finished:
                seq.suspect = True
            else:
                self._preempt(ws, seq, cache=False)

    @staticmethod
    def _failed_work(
        ws: WorkerState, seq: Sequence, handle: int, start: int, blocks: list[int]
    ) -> FailedWork:
        """The request's table on `ws` is the one this work wrote into while it runs there
        under the same handle, or has finished there (its table not freed yet)."""
        owns = seq.handle == handle or (seq.is_finished and seq.worker == ws.index)
        return FailedWork(seq, start, blocks, owns)

    # ---- helpers -------------------------------------------------------------------------

    def _full_budget(self) -> int:
        """Static batching predates token budgets: its batch is prefilled in one execution."""
        return sys.maxsize if self.static else self.config.token_budget

    def _chunk(self, seq: Sequence, budget: int, start: int = 0) -> int:
        """Tokens `seq` can process within `budget`: 1 in decode, a prompt (chunk) in prefill;
        a request being admitted with `start` positions cached computes from there."""
        pending = seq.known - max(seq.num_computed, start)
        if self._divisible(seq):
            return min(pending, budget)
        return pending if pending <= budget else 0

    def _divisible(self, seq: Sequence) -> bool:
        """Its pending tokens may be split across steps: chunked prefill, or a recompute."""
        return bool(self.chunked or seq.num_computed or seq.output_ids)

    def _sampled(self, seq: Sequence, token: int, finishes: list[Event]) -> None:
        """A chunk's sampled token (its prompt is computed): stop tokens are checked always."""
        seq.output_ids.append(token)
        if token in seq.stop_ids:
            finishes.append(self._finish(seq, Finish.STOP))
        elif len(seq.output_ids) >= seq.max_out:
            finishes.append(self._finish(seq, Finish.LENGTH))

    def _finish(self, seq: Sequence, finish: Finish, error: str = "") -> Event:
        seq.status, seq.finish, seq.error = FINISHED, finish, error
        self.finished += 1
        if seq.worker is not None and seq.handle != NO_HANDLE:
            self.workers[seq.worker].done.append((seq, seq.handle))
            seq.handle, seq.stop_at = NO_HANDLE, 0
        return Event(seq.request_id, finish=finish, error=error, preemptions=seq.preemptions)

    def _preempt(self, ws: WorkerState, seq: Sequence, cache: bool = True) -> None:
        """Free `seq`'s KV and put it back at the front of the queue, to be recomputed."""
        ws.running.remove(seq)
        ws.prefilling.discard(seq)
        ws.kv.free(seq, keep_cache=cache)  # its recompute (or another request) may find these
        ws.released.append(seq.handle)
        seq.status, seq.worker, seq.handle = SeqStatus.WAITING, None, NO_HANDLE
        seq.num_computed = seq.held = 0
        seq.known = seq.num_tokens
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        self.waiting_tokens += seq.known

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

    def _check_can_ever_run(self, seq: Sequence) -> None:
        prompt = len(seq.prompt_ids)
        specs = [ws.spec for ws in self.workers if ws.live]
        if not specs:
            self._refuse(RefusalReason.NO_WORKER, RefusalReason.NO_WORKER.description)
        fits = [s for s in specs if prompt < s.max_context]
        if not fits:
            context = max(s.max_context for s in specs)
            self._refuse(RefusalReason.CONTEXT, context_problem(prompt, context) or "")
        if not any(seq.max_length(s.max_context) <= s.capacity for s in fits):
            need = min(seq.max_length(s.max_context) for s in fits)
            capacity = max(s.capacity for s in fits)
            self._refuse(
                RefusalReason.KV_CAPACITY,
                f"request needs up to {need} KV positions (prompt {prompt} + max_tokens "
                f"{seq.max_tokens}) but a worker holds {capacity}; lower max_tokens or raise "
                f"the KV capacity",
            )
        if not self.chunked and prompt > self._full_budget():
            self._refuse(
                RefusalReason.TOKEN_BUDGET,
                f"prompt of {prompt} tokens exceeds the token budget of "
                f"{self.config.token_budget} and chunked prefill is off; enable it or raise "
                f"the budget",
            )

    def _refuse(self, reason: RefusalReason, message: str) -> None:
        self.refused[reason] += 1
        raise Refused(reason, message)

    def snapshot(self) -> Snapshot:
        now = self.clock()
        return Snapshot(
            waiting=len(self.waiting),
            waiting_tokens=self.waiting_tokens,
            running=sum(len(ws.running) for ws in self.workers),
            workers=[ws.report() for ws in self.workers if not ws.gone],
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


def _stepwise(sampling: object) -> bool:
    """Does the request take its tokens one execution at a time (logprobs, a grammar)?"""
    has = getattr(sampling, "HasField", None)
    return has is not None and (has("logprobs") or has("grammar"))


def _prior(worker: int, shape: BatchShape) -> float:
    """The step time of a worker without a model of its own: the built-in prior."""
    return BUILTIN_PRIOR.predict(shape)
