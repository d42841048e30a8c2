"""Pins of preemption for the head (`Admission._victims`, `_displace`) and of what the orderings
tell it (docs/queue-policies.md: "The core preempts only when the victims' going really makes
room"). `_victims` counts the room the head would have once its victims leave: the free blocks,
plus those the victims alone held, less the head's cached blocks nobody would hold and less the
blocks the requests that stay take in this step, planned as the planner plans them (`taken()`:
in running order, within the token budget; a decode's next token, a prompt chunk's positions).
Each test builds a small worker at an exact boundary, so that one block more or less of room
changes who is preempted: a miscount preempts in vain, or preempts nobody where a victim made
room. Also: the tenant service a step's drafts are charged (fair share), and the orderings'
bookkeeping that decides who is the head, the oldest, or a victim."""

from __future__ import annotations

import dataclasses

from llmcommon.tenancy import Tenancy
from scheduler_svc.config import (
    CoreConfig,
    DraftLength,
    KvPolicy,
    QueuePolicy,
    Speculative,
    WorkerSpec,
)
from scheduler_svc.core import Scheduler
from scheduler_svc.request_queue import FairRequestQueue, FCFSRequestQueue
from scheduler_svc.sequence import SeqStatus, Sequence
from tests import spec_sim
from tests.test_preemption_room import _seq, _step

PREFIX = list(range(100, 116))  # 4 full blocks of 4


def _core(num_blocks: int, token_budget: int = 64, **config) -> Scheduler:
    spec = WorkerSpec("w0", num_blocks=num_blocks, block_size=4, max_context=4096)
    config = dict(queue_policy="priority", token_budget=token_budget, decode_steps=1, **config)
    return Scheduler(CoreConfig(**config), [spec])


def _state(core: Scheduler) -> dict[str, tuple[int, int, int, int, bool]]:
    """Each running request: (computed, planned, max planned, positions held, prefilling)."""
    ws = core.workers[0]
    return {
        s.request_id: (
            s.num_computed,
            s.num_planned,
            s.max_planned,
            ws.kv.held(s),
            s in ws.prefilling,
        )
        for s in ws.running
    }


def _victims(core: Scheduler, head: Sequence) -> list[str]:
    return [v.request_id for v in core._victims(core.workers[0], head)]


def _head(blocks: int, priority: int = 1) -> Sequence:
    """A head (priority 1: above 5, below 0 and -1) whose prompt needs `blocks` blocks."""
    return _seq(f"H{blocks}", list(range(1000, 1000 + 4 * blocks)), 2, priority)


# ---- taken(): what the requests that stay take in this step ----------------------------------


def test_a_decode_after_the_budget_is_spent_takes_no_block_in_the_step() -> None:
    """Token budget 8. P (priority -1, first in the running order) has 14 prompt tokens left:
    its chunk takes the whole budget, 2 new blocks, and D (whose next token would need a new
    block) gets no token in this step. L's going leaves 3 free + 1 - 2 = 2 blocks: the 2 the
    head needs. Counting D's next block too (the budget left after P read as not spent, or as
    spent only at 1) leaves 1, and the head would preempt nobody while L's going makes room."""
    core = _core(7, token_budget=8, prefix_caching=False, max_running=3)
    core.add(_seq("D", [1, 2, 3], 20, priority=0))
    core.add(_seq("L", [4, 5, 6], 20, priority=5))
    _step(core)
    core.add(_seq("P", list(range(100, 120)), 4, priority=-1))
    _step(core)
    assert _state(core) == {
        "P": (6, 20, 24, 8, True),
        "D": (4, 5, 23, 4, False),
        "L": (4, 5, 23, 4, False),
    }
    assert core.workers[0].kv.num_free == 3
    assert _victims(core, _head(2)) == ["L"]
    assert _victims(core, _head(1)) == ["L"]  # (a running place: someone must go)


def _decodes_with_one_finishing() -> Scheduler:
    """Under overlap, the next plan while a step is in flight: F's last token is in flight
    (planned = its most), D1 and D2 decode, each with its blocks full (its next token takes a
    new block), L (priority 5) below the head. 4 blocks free; the running limit (4) is full."""
    core = _core(8, prefix_caching=False, max_running=4)
    core.add(_seq("F", [1, 2, 3], 2, priority=0))
    core.add(_seq("D1", [4, 5, 6], 20, priority=0))
    core.add(_seq("D2", [4, 5, 6], 20, priority=0))
    core.add(_seq("L", [7, 8, 9], 20, priority=5))
    _step(core)
    core.schedule_all()  # sent, not completed: the state the next plan sees under overlap
    assert _state(core) == {
        "F": (4, 5, 5, 4, False),
        "D1": (4, 5, 23, 4, False),
        "D2": (4, 5, 23, 4, False),
        "L": (4, 5, 23, 4, False),
    }
    assert core.workers[0].kv.num_free == 4
    return core


def test_each_decode_that_stays_takes_its_next_block_and_a_finishing_one_none() -> None:
    """L's going leaves 4 free + 1 = 5 blocks, of which D1's and D2's next tokens take 2: 3
    for the head. F, its last token in flight, takes nothing. Counting F (as a decode, whether
    its planned count reaches its most or not) leaves 2 and preempts nobody for a head of 3;
    stopping at F, or after the first decode, or counting one block for both decodes, leaves
    4 or more and preempts L in vain for a head of 4."""
    core = _decodes_with_one_finishing()
    assert _victims(core, _head(3)) == ["L"]
    assert _victims(core, _head(4)) == []
    assert core.preemptions == 0  # (asking preempts nobody)


def test_the_decodes_budget_leaves_a_prompt_chunk_its_exact_share() -> None:
    """Token budget 15. D1 and D2 decode (1 token each, each a new block), then P (priority 0,
    not below the head) has 28 prompt tokens left from 12: its chunk is the 13 tokens the
    decodes leave, to position 25: 4 blocks beyond its 3. L's going leaves 8 + 1 - 6 = 3 blocks.
    A chunk of another size (the decodes' tokens miscounted), P's own blocks miscounted, or P
    leaving the head its tokens (it does not outrank P) gives another room: a head of 3 blocks
    would wait or one of 4 (what the budget lets a head take) would preempt L in vain."""
    core = _core(14, token_budget=15, prefix_caching=False, max_running=4)
    core.add(_seq("D1", [4, 5, 6], 20, priority=0))
    core.add(_seq("D2", [4, 5, 6], 20, priority=0))
    core.add(_seq("L", [7, 8, 9], 20, priority=5))
    _step(core)
    core.add(_seq("P", list(range(100, 140)), 4, priority=0))
    _step(core)
    assert _state(core) == {
        "D1": (4, 5, 23, 4, False),
        "D2": (4, 5, 23, 4, False),
        "P": (12, 40, 44, 12, True),
        "L": (4, 5, 23, 4, False),
    }
    assert core.workers[0].kv.num_free == 8
    assert _victims(core, _head(3)) == ["L"]
    head = _seq("H", list(range(1000, 1013)), 2, priority=1)  # 13 tokens: 4 blocks
    assert _victims(core, head) == []


def test_a_prompt_the_head_outranks_leaves_it_exactly_its_own_tokens() -> None:
    """Token budget 13. P (priority 3, below the head) prefills, 12 of 24 computed (its blocks
    full). A head of 13 tokens (4 blocks) outranks P: P's chunk leaves it its 13 tokens, so P
    takes max(0, 13 - 13) = 0 tokens and no block this step. L's going leaves 3 + 1 = 4 blocks:
    L alone. P's chunk taking the whole budget (or budget + the head's, or budget less a
    miscounted share), or at least 1 token, or a block for a chunk of none, takes room the
    head has, and P is preempted too, in vain."""
    core = _core(7, token_budget=13, prefix_caching=False, max_running=2)
    core.add(_seq("L", [7, 8, 9], 20, priority=5))
    _step(core)
    core.add(_seq("P", list(range(100, 124)), 4, priority=3))
    _step(core)
    assert _state(core) == {"P": (12, 24, 28, 12, True), "L": (4, 5, 23, 4, False)}
    assert core.workers[0].kv.num_free == 3
    head = _seq("H", list(range(1000, 1013)), 2, priority=1)
    assert _victims(core, head) == ["L"]
    # a head of 12 tokens (3 blocks) leaves P 1 token: to position 13, a 4th block; 3 left
    assert _victims(core, _head(3)) == ["L"]


def test_preempting_for_the_head_makes_the_room_the_step_then_uses() -> None:
    """End to end, the last case: L alone is preempted, the head is admitted in the same step
    beside P, and P's chunk leaves the head its tokens."""
    core = _core(7, token_budget=13, prefix_caching=False, max_running=2)
    core.add(low := _seq("L", [7, 8, 9], 20, priority=5))
    _step(core)
    core.add(p := _seq("P", list(range(100, 124)), 4, priority=3))
    _step(core)
    core.add(head := _seq("H", list(range(1000, 1013)), 2, priority=1))
    steps = core.schedule_all()
    assert low.preemptions == 1 and p.preemptions == 0 and core.preemptions == 1
    assert steps[0].ran() == {"H": 13}  # the head's whole prompt; P's chunk waits
    assert head.status is SeqStatus.RUNNING


# ---- the head's own blocks: its cached start, the victims' shared blocks ---------------------


def test_the_heads_cached_start_counts_in_positions_when_the_budget_cuts_its_chunk() -> None:
    """Token budget 8. The head has 4 cached blocks (16 positions) and 9 tokens more: its first
    chunk runs from 16 to 24, 2 blocks beyond its cached 4. The 2 free blocks, less the one L's
    next token takes, leave 1: L is preempted (its going leaves 3). The cached start read as
    16 / 4 = 1 position puts the chunk's end at 9, fewer blocks than the cache holds: the head
    would seem to fit, and L's going would not be asked for."""
    core = _core(8, token_budget=8)
    core.add(_seq("S", [*PREFIX, 1], 10, priority=-5))
    core.add(_seq("L", [7, 8, 9], 20, priority=5))
    for _ in range(4):
        _step(core)
    assert _state(core) == {"S": (18, 19, 27, 20, False), "L": (4, 5, 23, 4, False)}
    assert core.workers[0].kv.num_free == 2
    head = _seq("H", [*PREFIX, *range(50, 59)], 2, priority=1)
    assert len(core.workers[0].kv.hit(head)) == 4
    assert _victims(core, head) == ["L"]


def test_a_block_two_victims_share_is_freed_by_the_second_ones_going() -> None:
    """L1 and L2 (priority 5) share a cached 4-block prefix and hold 1 block each beside it; 6
    free. L2's going frees its own block; L1's then frees its own and the 4 shared ones: 12 for
    the head. Counted as held by one victim only, the shared blocks are never freed."""
    core = _core(12)
    core.add(_seq("L1", [*PREFIX, 1], 20, priority=5))
    _step(core)
    _step(core)  # L1's prompt blocks are cached
    core.add(_seq("L2", [*PREFIX, 2], 20, priority=5))
    _step(core)
    ws = core.workers[0]
    assert ws.kv.num_free == 6 and sorted(ws.kv.pool.refs)[-4:] == [2, 2, 2, 2]
    assert _victims(core, _head(7)) == ["L2"]
    assert _victims(core, _head(8)) == ["L2", "L1"]
    assert _victims(core, _head(12)) == ["L2", "L1"]
    assert _victims(core, _head(13)) == []


def test_the_heads_cached_blocks_nobody_holds_are_taken_from_the_free_ones() -> None:
    """X has finished: its 4 prompt blocks stay cached, held by nobody, counted free (6 free in
    all). A head starting from them needs 3 blocks more, and takes the 4 out of the free ones:
    6 - 4 = 2 is too little, and L's 2 blocks make 4. Counting the 4 as room preempts nobody."""
    core = _core(8)
    core.add(_seq("X", [*PREFIX, 1], 1, priority=0))
    core.add(_seq("L", [7, 8, 9], 20, priority=5))
    for _ in range(3):
        _step(core)
    assert "X" not in core.seqs and _state(core) == {"L": (5, 6, 23, 8, False)}
    assert core.workers[0].kv.num_free == 6
    fits = _seq("H", [*PREFIX, *range(50, 58)], 2, priority=1)  # 2 blocks more: no victim
    assert _victims(core, fits) == []
    head = _seq("H2", [*PREFIX, *range(50, 59)], 2, priority=1)  # 3 blocks more
    assert len(core.workers[0].kv.hit(head)) == 4
    assert _victims(core, head) == ["L"]


# ---- _displace: once per head ----------------------------------------------------------------


def test_a_head_preempts_on_one_worker_only_in_one_plan() -> None:
    """Two workers, each with R (priority 0, admitted paged, still growing) and L (priority
    5); then the KV policy changes live to reserve. The head (20 positions reserved, 5 blocks)
    preempts L on worker 0; it still waits there (a reservation waits beside the blocks R may
    still take), and is not asked again in the same plan: L on worker 1 runs on."""
    specs = [WorkerSpec(f"w{i}", num_blocks=8, block_size=4, max_context=4096) for i in range(2)]
    config = CoreConfig(queue_policy="priority", token_budget=64, prefix_caching=False)
    core = Scheduler(config, specs)
    core.add(_seq("R0", [1, 2, 3, 4], 12, priority=0))
    core.add(_seq("R1", [5, 6, 7, 8], 12, priority=0))
    core.add(l0 := _seq("L0", list(range(20, 28)), 4, priority=5))
    core.add(l1 := _seq("L1", list(range(30, 38)), 4, priority=5))
    _step(core)
    assert [[s.request_id for s in ws.running] for ws in core.workers] == [
        ["R0", "L0"],
        ["R1", "L1"],
    ]
    core.reconfigure(dataclasses.replace(core.config, policy=KvPolicy.RESERVE))
    core.add(head := _seq("H", [1, 2, 3, 4], 16, priority=1))
    _step(core)
    assert l0.preemptions == 1 and l1.preemptions == 0 and core.preemptions == 1
    assert head.status is SeqStatus.WAITING
    assert core.head_reason is not None and core.head_reason.value == "kv_reserved"


# ---- the service a step's drafts are charged -------------------------------------------------


def test_two_drafts_of_one_tenant_in_one_step_are_both_charged() -> None:
    """Token budget 8: a's draft of 5 and b's of 1, both of tenant t, fill the step (8 tokens,
    sampled service of weight 2): t is charged 16, not the last draft's 4 alone."""
    spec = {"speculative": Speculative.NGRAM, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    config = CoreConfig(
        queue_policy=QueuePolicy.FAIR,
        token_budget=8,
        speculative_length=DraftLength.FIXED,
        **spec,
    )
    core = Scheduler(config, [WorkerSpec("w0", 128, 4, 4096)])
    core.add(Sequence("a", [3, 5, 8, 3, 5], 40, tenancy=Tenancy(tenant="t")))
    core.add(Sequence("b", [4, 6, 9, 4, 6], 40, tenancy=Tenancy(tenant="t")))
    for _ in range(30):
        before = core.waiting.counters.get("t", 0.0)
        step = core.schedule(0)
        if len(step.drafts) == 2:
            break
        spec_sim.complete(core, step)
    else:
        raise AssertionError("never drafted both")
    assert [len(d.token_ids) for d in step.drafts] == [5, 1]
    assert not step.decodes and not step.chunks and step.num_tokens == 8
    assert core.waiting.counters["t"] - before == 16


# ---- FCFS: the head is the oldest unless one came back out of order --------------------------


class _Waiting:
    """A waiting request as FCFS reads it (its arrival), counting the reads."""

    def __init__(self, arrival: float) -> None:
        self._arrival, self.reads = arrival, 0

    @property
    def arrival(self) -> float:
        self.reads += 1
        return self._arrival


def test_fcfs_takes_its_head_for_the_oldest_without_looking_at_every_request() -> None:
    """Requests join in arrival order: the oldest is the head, read in O(1) (the oldest-wait
    gauge is read at every scrape): no arrival is read to find it."""
    q = FCFSRequestQueue()
    waiting = [_Waiting(float(i)) for i in range(5)]
    for w in waiting:
        q.add(w)  # type: ignore[arg-type]
    assert q.oldest() is waiting[0]
    assert sum(w.reads for w in waiting) == 0


def test_fcfs_a_request_back_with_the_heads_arrival_leaves_the_queue_in_order() -> None:
    """A preempted request that arrived at the head's own time (one clock tick) goes in front:
    the queue is still in arrival order, and the oldest is still taken to be the head."""
    q = FCFSRequestQueue()
    head, back = _Waiting(1.0), _Waiting(1.0)
    others = [_Waiting(2.0), _Waiting(3.0)]
    for w in (head, *others):
        q.add(w)  # type: ignore[arg-type]
    q.prepend(back)  # type: ignore[arg-type]
    for w in (head, back, *others):
        w.reads = 0
    assert q.oldest() is back
    assert sum(w.reads for w in (head, back, *others)) == 0


# ---- fair share -------------------------------------------------------------------------------


def _waiting(rid: str, arrival: float, tenant: str) -> Sequence:
    s = Sequence(rid, [1] * 4, 8, arrival=arrival, tenancy=Tenancy(tenant=tenant))
    s.status = SeqStatus.WAITING
    return s


def _running(rid: str, arrival: float, tenant: str) -> Sequence:
    s = _waiting(rid, arrival, tenant)
    s.status, s.max_planned = SeqStatus.RUNNING, 100
    return s


def test_fair_takes_no_place_from_a_tenant_that_holds_exactly_its_share() -> None:
    """4 places, tenants a (the head's) and b of weight 1: 2 each. b holds 2, its share and no
    more: nobody. Holding 3, b is over it: its newest goes."""
    q = FairRequestQueue()
    q.add(head := _waiting("a9", 50, "a"))
    q.charge("b", 10, 0)  # b served more than a: back in the queue, its request comes after
    b = [_running(f"b{i}", i, "b") for i in range(3)]
    assert q.victim(head, b[:2], 4) is None
    assert q.victim(head, b, 4) is b[2]


def test_fair_a_tenant_still_waiting_is_not_lifted_when_another_request_of_it_joins() -> None:
    """a has two requests waiting; one is admitted, one still waits; b (waiting) is then
    served 20. a's next request joins a tenant that never stopped waiting: a keeps its 0 (a
    lift to b's 20 would put b's request between a's)."""
    q = FairRequestQueue()
    q.add(_waiting("b0", 0, "b"))
    q.add(_waiting("a0", 1, "a"))  # lifted to b's 0, joined after b: a first
    q.add(_waiting("a1", 2, "a"))
    assert q.pop().request_id == "a0"
    q.charge("b", 20, 0)
    q.add(_waiting("a2", 3, "a"))
    assert q.counters == {"a": 0, "b": 20}
    assert [s.request_id for s in q] == ["a1", "a2", "b0"]


def test_fair_a_first_tenant_starts_from_zero_beside_one_that_only_runs() -> None:
    """After a live switch to fair, a tenant running since (charged, never waiting here) has
    a counter; nobody has stopped waiting yet, so a tenant that starts waiting starts from 0.
    (The running tenant is named XXXX: any name is one; this one is also what a mutated
    "nobody yet" sentinel would read.)"""
    q = FairRequestQueue()
    q.charge("XXXX", 30, 0)
    q.add(_waiting("a0", 0, "a"))
    assert q.counters == {"XXXX": 30, "a": 0}


def test_fair_victim_order_ranks_tenants_by_counter_then_the_last_to_join_first() -> None:
    """What `_displace` remembers a fruitless search by: the tenants in the order the counters
    rank them, a tie going to the tenant that started waiting last (as the head is chosen); a
    tenant only charged (running since a live switch) after those waiting on a tie."""
    q = FairRequestQueue()
    q.add(_waiting("a0", 0, "a"))
    q.add(_waiting("b0", 1, "b"))  # lifted to a's 0, joined after a
    assert q.victim_order() == ("b", "a")
    q.charge("b", 5, 0)
    assert q.victim_order() == ("a", "b")
    q.charge("c", 5, 0)
    assert q.victim_order() == ("a", "b", "c")
    q.charge("a", 8, 0)
    assert q.victim_order() == ("b", "c", "a")
