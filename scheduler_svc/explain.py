"""What would admit the head of the queue: asked on demand, answered from the core's state
without changing it.

What the head needs and what each worker holds are read from the core. The counterfactuals
are the core's own answer: a copy of it (`copy.deepcopy`), the change, one planning pass on
every live worker, and did the head start? So they follow every rule the core applies
(reservations, prefix hits, chunking, the running limit), and the real core is never touched.
The copy is taken once (`explain` takes it in the caller's thread, cheap next to the planning
passes); `explain_copy` then works on it alone and may run in another thread."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_svc.blocks import blocks_for
from scheduler_svc.config import CoreConfig, KvPolicy
from scheduler_svc.core import Scheduler
from scheduler_svc.output import WorkerKv
from scheduler_svc.sequence import SeqStatus, Sequence
from scheduler_svc.step import Step
from scheduler_svc.step_cost import step_shape
from scheduler_svc.worker_state import WorkerState

TIME_STEPS_PER_MS = 10  # the smallest admitting step-time budget is found to 0.1 ms


@dataclass(frozen=True, slots=True)
class Holder:
    """A running request and the positions it holds reserved but has not written."""

    request_id: str
    unwritten: int


@dataclass(frozen=True, slots=True)
class WorkerRoom:
    name: str
    free: int
    written: int
    reserved_unwritten: int
    running: int
    holders: list[Holder] = field(default_factory=list)  # largest first


@dataclass(frozen=True, slots=True)
class Finisher:
    """The running request after whose finish the head is admitted, and when (steps, at most:
    it may stop earlier on a stop token)."""

    request_id: str
    steps: int


@dataclass(frozen=True, slots=True)
class Explanation:
    request_id: str
    wait_seconds: float
    reason: str  # why it waits in the next step ("" = it would be admitted)
    worker: str  # where it would go (the first worker in placement order)
    tokens: int  # prompt tokens still to compute (its first chunk is at most budget_left)
    budget_left: int | None  # of the worker's token budget, after its running requests' work
    positions: int  # KV positions the admission takes: the first chunk, or the reservation
    blocks: int
    running: int  # on that worker, against the running limit
    max_running: int
    workers: list[WorkerRoom]
    policy: str
    other_policy: str
    admitted_under_other_policy: bool
    token_budget: int | None  # the smallest that admits it now (None: no budget does)
    running_limit: int | None  # the smallest running limit that admits it now
    after: Finisher | None  # None: no finish on its own admits it
    # the step-time budget (ms; 0: off), the worker's planned step as its step-time model
    # predicts it (what its running work takes of the budget; None: nothing planned), and the
    # smallest budget that admits the head now (None: the budget is off, or no budget does)
    step_time_budget_ms: float = 0.0
    step_predicted_ms: float | None = None
    time_budget_ms: float | None = None
    # that step's own limit (ms): the budget, or under --step-time-window what the worker's
    # last steps left of window x budget (None: nothing planned, or the budget is off)
    step_limit_ms: float | None = None
    step_time_window: int = 1


def explain(core: Scheduler) -> Explanation | None:
    """The head of the queue's explanation; None when nobody waits."""
    if not core.waiting:
        return None
    return explain_copy(copy_of(core), core.clock())


def explain_copy(base: Scheduler, now: float) -> Explanation:
    """`explain` on a copy of the core that nobody else uses (it stays as it was)."""
    head = base.waiting.peek()
    config = base.config
    planned, worker, step = _plan(base, config)
    ws = base.workers[worker]
    other = KvPolicy.PAGED if config.policy is KvPolicy.RESERVE else KvPolicy.RESERVE
    return Explanation(
        request_id=head.request_id,
        wait_seconds=max(0.0, now - head.arrival),
        reason=planned.head_reason.value if planned.head_reason else "",
        worker=ws.spec.name,
        tokens=head.num_pending,
        budget_left=_budget_left(planned, step),
        positions=_positions(base, ws, head),
        blocks=blocks_for(_positions(base, ws, head), ws.spec.block_size),
        running=len(ws.running),
        max_running=config.max_running,
        workers=_rooms(base),
        policy=config.policy.value,
        other_policy=other.value,
        admitted_under_other_policy=_admits(base, dataclasses.replace(config, policy=other)),
        token_budget=_smallest(
            lambda n: _admits(base, dataclasses.replace(config, token_budget=n)),
            _budget_bound(base, head),
        ),
        running_limit=_smallest(
            lambda m: _admits(base, dataclasses.replace(config, max_running=m)),
            max(len(w.running) for w in base.workers) + 1,
        ),
        after=_finisher(base),
        step_time_budget_ms=config.step_time_budget_ms,
        step_predicted_ms=None if step is None else 1e3 * base.predict(worker, step_shape(step)),
        time_budget_ms=_time_budget(base, config),
        step_limit_ms=None if step is None or step.timer is None else 1e3 * step.timer.limit,
        step_time_window=config.step_time_window,
    )


def _time_budget(base: Scheduler, config: CoreConfig) -> float | None:
    """The smallest step-time budget (ms, to 0.1) that admits the head now; None when the
    budget is off (time does not hold it) or when even no time budget would admit it (another
    limit does). Bounded by the step planned without one: that step fits a budget of its
    predicted time, and admission grows with the budget."""
    if not config.step_time_budget_ms or base.static:
        return None
    untimed = dataclasses.replace(config, step_time_budget_ms=0.0)
    core, worker, step = _plan(base, untimed)
    head = core.seqs.get(base.waiting.peek().request_id)
    if step is None or head is None or head.status is not SeqStatus.RUNNING:
        return None
    bound = int(1e3 * TIME_STEPS_PER_MS * base.predict(worker, step_shape(step))) + 1
    tenths = _smallest(
        lambda n: _admits(
            base, dataclasses.replace(config, step_time_budget_ms=n / TIME_STEPS_PER_MS)
        ),
        bound,
    )
    return None if tenths is None else tenths / TIME_STEPS_PER_MS


def copy_of(core: Scheduler) -> Scheduler:
    """A deep copy sharing what the planning only reads (sampling messages, the clock); the
    step-time predictor is copied with its models (a prediction may refit a model, which the
    copy must do on its own, off the real one); of the waiting queue only the head, since
    admission stops at the head (nobody behind it starts before it), and the rest would be
    most of the copy's cost on a long queue."""
    memo: dict[int, object] = {id(core.clock): core.clock}
    if core.proposer is not None:  # drafts come after admission: the copy plans none (and
        memo[id(core.proposer)] = None  # copies no suffix index)
    for seq in core.seqs.values():
        memo[id(seq.sampling)] = seq.sampling
    if len(core.waiting) > 1:
        first = core.waiting.peek()
        head = copy.deepcopy(first, memo)
        behind = {id(s) for s in core.waiting} - {id(first)}
        queue = memo[id(core.waiting)] = core.waiting.emptied()
        queue.add(head)
        memo[id(core.seqs)] = {
            rid: copy.deepcopy(s, memo) for rid, s in core.seqs.items() if id(s) not in behind
        }
    twin = copy.deepcopy(core, memo)
    twin.waiting_tokens = sum(s.num_pending for s in twin.waiting)
    return twin


def _plan(
    base: Scheduler, config: CoreConfig, finished: tuple[str, ...] = ()
) -> tuple[Scheduler, int, Step | None]:
    """A copy of `base` with `config` and the `finished` requests gone, after one planning pass
    on every live worker; the worker the head went to or stalled on, and its planned step."""
    core = copy_of(base)
    if config != core.config:
        core.reconfigure(config)  # ValueError where a request could then never run
    for rid in finished:
        core.abort(rid)
    stalls = [w.stalls.copy() for w in core.workers]
    steps = core.schedule_workers([w.index for w in core.workers if w.healthy])
    head = core.seqs.get(base.waiting.peek().request_id)
    if head is not None and head.worker is not None:
        worker = head.worker
    else:
        grew = [w.index for w, seen in zip(core.workers, stalls, strict=True) if w.stalls != seen]
        worker = grew[0] if grew else 0
    return core, worker, next((s for s in steps if s.worker == worker), None)


def _admits(base: Scheduler, config: CoreConfig, finished: tuple[str, ...] = ()) -> bool:
    try:
        core, _, _ = _plan(base, config, finished)
    except ValueError:  # a setting no request may be left under
        return False
    head = core.seqs.get(base.waiting.peek().request_id)
    return head is not None and head.status is SeqStatus.RUNNING


def _budget_left(planned: Scheduler, step: Step | None) -> int | None:
    """The worker's token budget after its running requests' work in the planned step (None:
    static batching has no token budget)."""
    if planned.static or step is None:
        return None
    added = set(step.added)
    spent = len(step.decodes) + len(step.drafts)  # a draft row's own token (its draft: leftover)
    spent += sum(w.num_tokens for w in step.chunks if w.seq not in added)
    return planned.config.token_budget - spent


def _positions(core: Scheduler, ws: WorkerState, head: Sequence) -> int:
    """KV positions an admission of `head` takes on `ws`: the whole reservation under reserve,
    otherwise its first chunk (its prompt within the full token budget)."""
    if core.config.policy is KvPolicy.RESERVE:
        return head.max_length(ws.spec.max_context)
    return (
        min(head.num_planned, core.config.token_budget)
        if core.config.chunked_prefill
        else head.num_planned
    )


def _rooms(core: Scheduler) -> list[WorkerRoom]:
    live = [w for w in core.workers if not w.gone]  # the snapshot's workers, in its order
    return [_room(kv, w) for kv, w in zip(core.snapshot().workers, live, strict=True)]


def _room(kv: WorkerKv, ws: WorkerState) -> WorkerRoom:
    holders = [Holder(s.request_id, ws.kv.held(s) - s.num_computed) for s in ws.running]
    holders = sorted((h for h in holders if h.unwritten > 0), key=lambda h: -h.unwritten)
    return WorkerRoom(kv.name, kv.free, kv.written, kv.reserved_unwritten, kv.running, holders)


def _smallest(admits: Callable[[int], bool], bound: int) -> int | None:
    """The smallest n in 1..bound with admits(n), by bisection (taking admission to grow with
    n); None if even `bound` does not admit."""
    if not admits(bound):
        return None
    low, high = 1, bound
    while low < high:
        mid = (low + high) // 2
        if admits(mid):
            high = mid
        else:
            low = mid + 1
    return low


def _budget_bound(core: Scheduler, head: Sequence) -> int:
    """A token budget beyond which more budget cannot help: every running request's next work
    and the head's whole prompt in one step."""
    running = sum(max(1, s.num_planned - s.num_computed) for w in core.workers for s in w.running)
    return max(core.config.token_budget, running + head.num_pending)


def steps_left(seq: Sequence, budget: int) -> int:
    """Steps until a running request has taken its last one (at most: a stop token may end it
    sooner): its prompt chunks still to compute, then a decode per token."""
    pending = len(seq.prompt_ids) - seq.num_computed
    chunks = -(-pending // budget) if pending > 0 else 0
    return chunks + max(0, seq.max_planned - seq.num_planned - (1 if chunks else 0))


def _finisher(base: Scheduler) -> Finisher | None:
    """The first running request (in the order they finish) after whose finish, and those
    before it, the head is admitted: by bisection over how many have finished (each finish
    only gives room back)."""
    budget = base.config.token_budget
    order = sorted(
        (steps_left(s, budget), s.request_id)
        for w in base.workers
        for s in w.running
        if s.status is SeqStatus.RUNNING
    )
    if not order:
        return None
    gone = [rid for _, rid in order]
    k = _smallest(lambda n: _admits(base, base.config, tuple(gone[:n])), len(order))
    return None if k is None else Finisher(order[k - 1][1], order[k - 1][0])
