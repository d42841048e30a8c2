"""Admission from the queue's head: which worker it goes to and the cached blocks it reuses
there, or why it waits (a stall reason); the step-time budget's part in it."""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass

from scheduler_svc.blocks import blocks_for
from scheduler_svc.core.state import CoreState
from scheduler_svc.output import Event
from scheduler_svc.reasons import StallReason
from scheduler_svc.request_queue import RequestQueue
from scheduler_svc.sequence import Finish, SeqStatus, Sequence
from scheduler_svc.step import Step
from scheduler_svc.worker_state import WorkerState

RUNNING, FINISHED = SeqStatus.RUNNING, SeqStatus.FINISHED
_NEVER_OUTRANKS = RequestQueue.outranks  # FCFS's: the running came first
# the stalls a head may preempt a running request for (its ordering permitting)
ROOM = frozenset({StallReason.MAX_RUNNING, StallReason.KV_CAPACITY, StallReason.KV_RESERVED})


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


class Admission(CoreState):
    """Admission from the head of the waiting queue, in its order, until the head must wait."""

    def _admit(self, steps: dict[int, Step], failed: list[Event]) -> None:
        """Admit from the queue's head, in its order, until it must wait; then, when the
        longest-waiting request is not the head, count the ordering as what holds it back."""
        self._admit_heads(steps, failed)
        waiting = self.waiting
        reason = waiting.order_reason
        if reason is not None and waiting and waiting.oldest() is not waiting.peek():
            self.stalls[reason] += 1

    def _admit_heads(self, steps: dict[int, Step], failed: list[Event]) -> None:
        """Admit from the queue's head, in order, until it must wait. A request that no live
        worker can ever hold fails (its finish into `failed`), never waits."""
        self.head_reason = None
        waiting = self.waiting
        while waiting:
            seq = waiting.peek()
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
            waiting.pop()
            self.waiting_tokens -= seq.num_planned
            self._start(ws, seq, step, n, hit)

    def _cut_to_time(self, seq: Sequence, step: Step, start: int, n: int) -> int:
        """Of the head's `n` tokens from `start`, those that fit the step's time left; in a step
        with nothing else, at least one (its whole prompt, without chunking)."""
        assert step.timer is not None
        return step.timer.cut(
            start, n, start + n == seq.num_planned, least=int(not step.has_work),
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
            back = self._returning(seq)
            return None if back is None else Stall(back, StallReason.WORKER_DOWN)
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
            if seq.num_planned >= spec.max_context:
                continue
            if blocks_for(min(want, spec.max_context), spec.block_size) > spec.num_blocks:
                continue
            (full if want <= spec.max_context else partial).append(ws)
        return full or partial

    def _returning(
        self, seq: Sequence, back: list[WorkerState] | None = None
    ) -> WorkerState | None:
        """A failed worker that can hold `seq` and may still come back (failed less than
        `return_wait` ago; `back`: those workers, found once for many requests): while there
        is one, `seq` waits for it rather than fail."""
        back = self.returning_workers() if back is None else back
        if not back:
            return None
        return next((ws for ws in self._candidates(seq, live=False) if ws in back), None)

    def returning_workers(self) -> list[WorkerState]:
        """The failed workers (listed, not gone) that failed less than `return_wait` ago."""
        if self.return_wait <= 0:
            return []
        now = self.clock()
        return [
            ws
            for ws in self.workers
            if not (ws.healthy or ws.gone)
            and ws.down_since is not None
            and now - ws.down_since < self.return_wait
        ]

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
        seq.max_planned = seq.max_length(ws.spec.max_context)
        seq.output_limit = seq.max_planned - len(seq.prompt_ids)
        ws.kv.place(seq, hit)
        if hit:
            step.shares.append((seq.handle, hit))
            seq.num_computed = len(hit) * ws.spec.block_size
        ws.prompt_tokens += seq.num_planned
        ws.hit_tokens += seq.num_computed
        new = ws.kv.allocate(seq, seq.max_planned if self.reserve else seq.num_computed + n)
        assert new is not None, "admitted without room"  # `_why_not` found it
        step.grants.append((seq.handle, new))
        step.added.append(seq)
        if self.waiting.ranks_running:
            insort(ws.running, seq, key=self.waiting.running_key)
        else:
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

    def _displace(self, planned: set[int]) -> None:
        """Before the running requests are planned: when the head cannot be admitted on any
        worker for its running limit or KV, and its ordering names running requests on a worker
        planned now that it may preempt (priority: lower ones) and whose going makes room for
        it, preempt those (they are recomputed later, nothing lost); once per head. A head that
        found nobody on these workers is not asked again before the running requests change."""
        waiting = self.waiting
        tried: set[int] = set()
        while waiting and id(head := waiting.peek()) not in tried:
            tried.add(id(head))
            seen = (id(head), self.admitted, self.finished, self.preemptions)
            seen += waiting.victim_order()
            memo, asked = self._found_nobody
            if memo != seen:
                asked = set()
            elif planned <= asked:
                return  # the same head before the same running requests: nobody then
            place = self._place(head, {})
            if type(place) is not Stall or place.reason not in ROOM:
                return
            for ws in self._candidates(head, live=True):
                if ws.index in planned:  # a live candidate: not draining
                    victims = self._victims(ws, head)
                    if victims:
                        for victim in victims:
                            self._preempt(ws, victim)
                        break
            else:
                self._found_nobody = (seen, asked | planned)
                return

    def _victims(self, ws: WorkerState, head: Sequence) -> list[Sequence]:
        """The running requests on `ws` whose preemption, in the order the head's ordering
        names them, first leaves a running place and the KV blocks `head` needs (its first
        chunk after its cached blocks, or its reservation); none if even all it may name leave
        too little. A victim's going frees only the blocks no other request still holds (a
        prefix it shares stays); the head's cached blocks that nobody would hold then, and the
        blocks the decodes that stay need for their next token, are taken from the free ones."""
        spec, kv, limit = ws.spec, ws.kv, self.config.max_running
        if self.reserve:
            hit: list[int] = []
            need = blocks_for(head.max_length(spec.max_context), spec.block_size)
        else:
            hit = kv.hit(head)
            start = len(hit) * spec.block_size
            end = start + self._chunk(head, self._full_budget(), start)
            need = blocks_for(end, spec.block_size) - len(hit)
        refs, table = kv.pool.refs, kv.pool.table
        dropped: dict[int, int] = {}  # block -> references the victims so far hold
        rest, victims, freed = list(ws.running), [], 0

        holds, prefilling, size = kv.held, ws.prefilling, spec.block_size
        full, outranks, own = self._full_budget(), self.waiting.outranks, need * size

        def taken() -> int:
            """The blocks the requests that stay take in this step, planned after this and
            before admission as the planner does (in running order, within the token budget):
            a decode's next token, a prompt chunk's positions (the head's own tokens left out
            of the chunk of a request it outranks)."""
            budget, blocks = full, 0
            for s in rest:
                if s.num_planned >= s.max_planned or s.drafting or budget == 0:
                    continue
                if s not in prefilling:
                    budget -= 1
                    blocks += s.num_computed >= holds(s)
                    continue
                n = self._chunk(s, max(0, budget - own) if outranks(head, s) else budget)
                budget -= n
                blocks += max(0, blocks_for(s.num_computed + n, size) - holds(s) // size)
            return blocks

        def room() -> int:
            """Free blocks once the victims leave, less those the hit takes and those the
            requests that stay take in this step."""
            hit_held = sum(refs[b] == dropped.get(b, 0) for b in hit)
            return kv.num_free + freed - hit_held - taken()

        while len(rest) >= limit or room() < need:
            victim = self.waiting.victim(head, rest, limit)
            if victim is None:
                return []
            rest.remove(victim)
            victims.append(victim)
            for block in table(victim.request_id):
                held = dropped[block] = dropped.get(block, 0) + 1
                freed += held == refs[block]
        return victims

    def _held_for_head(self, ws: WorkerState) -> tuple[Sequence, int] | None:
        """Under an ordering that ranks the head above a request prefilling on `ws`: the head,
        and the tokens of its prompt here, which that request's chunk leaves it, so that a
        short head gets its first token in this step instead of waiting for the running
        prompts; None otherwise: the head could not be admitted here anyway, or its
        prompt is longer than the budget (taking the budget from running prompts for it would
        only spread prefill over more requests at once, more KV held and more preempted)."""
        waiting = self.waiting
        if not ws.prefilling or not waiting or type(waiting).outranks is _NEVER_OUTRANKS:
            return None
        head = waiting.peek()
        if not any(waiting.outranks(head, s) for s in ws.prefilling):
            return None
        place = self._place(head, {})
        if type(place) is not Placement or place.worker is not ws:
            return None
        start = len(place.hit) * ws.spec.block_size
        n = self._chunk(head, self._full_budget(), start)
        if start + n < head.num_planned:
            return None  # a prompt longer than the budget: no first token this step anyway
        return head, n

    def fail_unplaceable(self) -> list[Event]:
        """After the live workers changed, and while a failed one may come back: fail every
        waiting request that none of them can ever hold (when none is live, every waiting
        request), unless a failed worker that could hold it may still come back (`_returning`).
        No step loop may be left to see it. Returns their finishes."""
        failed, back = [], self.returning_workers()
        for seq in list(self.waiting):
            if not self._candidates(seq, live=True) and self._returning(seq, back) is None:
                failed += self.abort(seq.request_id, Finish.ERROR, self._no_worker_message(seq))
        return failed

    def _no_worker_message(self, seq: Sequence) -> str:
        """Why no live worker can hold `seq`: none can at all, or only those down."""
        live = sum(ws.live for ws in self.workers)
        if self._candidates(seq, live=False):
            waited = f", none back within {self.return_wait:g} s" if self.return_wait > 0 else ""
            return (
                f"no live worker can hold this request (the workers that could are failed or "
                f"draining{waited}; {live} live); retry"
            )
        return f"no worker can hold this request ({live} live); retry"
