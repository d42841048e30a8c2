"""Preemption by priority counts the room the victims really leave (docs/queue-policies.md: "The
core preempts only when the victims' going really makes room"): a victim's blocks that another
request still holds (a shared cached prefix) free nothing, and the head's cached blocks need no
room, so no victim is preempted in vain and no more are preempted than the head needs."""

from __future__ import annotations

from dataclasses import replace

from llmcommon.tenancy import Tenancy
from scheduler_svc.config import CoreConfig, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.invariants import check_invariants
from scheduler_svc.sequence import Sequence


def _step(core: Scheduler) -> None:
    for step in core.schedule_all():
        tokens = [7 for w in step.chunks if w.sample] + [7] * len(step.decodes) * step.repeat
        core.complete(step, tokens)
    check_invariants(core)


def _seq(rid: str, prompt: list[int], max_tokens: int, priority: int) -> Sequence:
    return Sequence(rid, prompt, max_tokens, ignore_eos=True, tenancy=Tenancy(priority=priority))


def _core(num_blocks: int, **config) -> Scheduler:
    spec = WorkerSpec("w0", num_blocks=num_blocks, block_size=4, max_context=4096)
    return Scheduler(
        CoreConfig(queue_policy="priority", token_budget=64, decode_steps=1, **config), [spec]
    )


def test_a_victim_whose_blocks_another_request_shares_is_not_preempted_in_vain() -> None:
    core = _core(8)
    prefix = list(range(100, 116))  # 4 full blocks, cached and shared by L1 and L2
    l1 = _seq("L1", [*prefix, 7], 12, priority=-1)  # above the head: never its victim
    l2 = _seq("L2", [*prefix, 8], 5, priority=1)  # below the head, but frees 1 block only
    core.add(l1)
    _step(core)
    core.add(l2)
    _step(core)
    assert core.workers[0].kv.num_free == 2
    core.add(_seq("H", list(range(300, 320)), 4, priority=0))  # 5 blocks: L2's going leaves 3
    _step(core)
    assert core.preemptions == 0  # (it preempted L2, and H still waited for L1)
    assert core.head_reason is not None and core.head_reason.value == "kv_capacity"


def test_a_head_with_a_cache_hit_preempts_only_the_victims_it_needs() -> None:
    core = _core(10, max_running=3)
    prefix = list(range(100, 116))  # 4 full blocks, held by S
    core.add(_seq("S", [*prefix, 1], 20, priority=-5))
    core.add(_seq("L1", list(range(200, 207)), 20, priority=5))
    core.add(_seq("L2", list(range(300, 307)), 20, priority=5))
    _step(core)
    _step(core)  # S's prompt blocks are cached once its chunk has run
    ws = core.workers[0]
    assert len(ws.running) == 3 and ws.kv.num_free == 1
    head = _seq("H", [*prefix, 2, 3, 4], 2, priority=0)  # 4 blocks cached: needs 1 block, a place
    core.add(head)
    assert len(ws.kv.hit(head)) == 4
    _step(core)
    assert core.preemptions == 1  # L2 alone (a place and 2 blocks); L1 had been preempted too
    assert {s.request_id for s in ws.running} == {"S", "L1", "H"}


def test_the_blocks_the_running_decodes_take_in_the_step_are_not_room_for_the_head() -> None:
    core = _core(4, prefix_caching=False)
    r1 = _seq("R1", list(range(10, 18)), 4, priority=0)  # 2 blocks; its next token needs a 3rd
    low = _seq("L", list(range(20, 23)), 8, priority=1)  # 1 block, room for its next tokens
    core.add(r1)
    core.add(low)
    _step(core)
    assert core.workers[0].kv.num_free == 1
    core.add(_seq("H", list(range(30, 35)), 2, priority=0))  # 2 blocks
    _step(core)
    # L's block and the free one would be 2, but R1's next token takes one of them: L's going
    # would not let H in (before, L was preempted and H waited anyway)
    assert core.preemptions == 0 and low.preemptions == 0
    assert core.head_reason is not None and core.head_reason.value == "kv_capacity"


def test_a_decode_that_stays_takes_one_block_for_its_next_token() -> None:
    core = _core(6, prefix_caching=False, max_running=2)  # H waits for a running place
    core.add(_seq("R", list(range(10, 14)), 8, priority=0))  # a full block: its next takes one
    core.add(low := _seq("L", list(range(20, 23)), 8, priority=9))  # room in its block
    _step(core)
    assert core.workers[0].kv.num_free == 4
    core.add(head := _seq("H", list(range(30, 46)), 2, priority=0))  # 4 blocks
    _step(core)  # 4 free + L's 1 - R's next 1 = 4: L alone is enough
    assert low.preemptions == 1 and core.preemptions == 1 and head.admitted_at is not None


def test_under_reserve_the_head_needs_its_whole_reservation() -> None:
    core = _core(8, prefix_caching=False, policy="reserve")
    core.add(low := _seq("L", list(range(20, 23)), 5, priority=9))  # reserves 2 blocks
    core.add(_seq("M", list(range(40, 43)), 5, priority=9))  # 2 more
    _step(core)
    assert core.workers[0].kv.num_free == 4
    core.add(head := _seq("H", list(range(30, 33)), 17, priority=0))  # 20 positions: 5 blocks
    _step(core)
    assert core.preemptions == 1 and head.admitted_at is not None
    assert low.preemptions + core.seqs["M"].preemptions == 1


def _prefix_held_by_a_victim() -> Scheduler:
    """L (priority 9) alone holds a cached 4-block prefix; M (0) runs beside it; 1 block free;
    the running limit (2) is full."""
    core = _core(8, max_running=2)
    core.add(_seq("L", [*PREFIX, 1], 8, priority=9))
    core.add(_seq("M", list(range(200, 205)), 8, priority=0))
    _step(core)
    _step(core)  # L's prompt blocks are cached (readable once their step has run)
    assert core.workers[0].kv.num_free == 1
    return core


PREFIX = list(range(100, 116))


def test_the_heads_cached_blocks_a_victim_frees_are_taken_by_the_head_itself() -> None:
    core = _prefix_held_by_a_victim()
    ws = core.workers[0]
    # 4 cached + 2 new blocks: L's going frees its 5, of which the head takes back its 4
    fits = _seq("H", [*PREFIX, *range(50, 55)], 2, priority=0)
    core.add(fits)
    assert len(ws.kv.hit(fits)) == 4
    assert [v.request_id for v in core._victims(ws, fits)] == ["L"]
    core.abort("H")
    # 4 cached + 3 new: 1 free + 5 freed - 4 taken back = 2, too little: nobody
    too_long = _seq("H2", [*PREFIX, *range(50, 59)], 2, priority=0)
    core.add(too_long)
    assert core._victims(ws, too_long) == []
    _step(core)
    assert core.preemptions == 0


def test_a_running_prompt_chunk_that_takes_the_room_first_leaves_the_victim_running() -> None:
    """M (above the head) still has 9 prompt tokens to compute: in this step its chunk takes
    the 2 free blocks before the head is admitted. The 2 free and L's 1 would have made the 3
    blocks the head needs, but less M's 2 they make 1: L was preempted in vain, recomputed the
    step after, and the head waited all the same (tenants sweep; 7 such preemptions in 151
    random priority/fair workloads, 3 after: those left wait on the running limit)."""
    spec = WorkerSpec("w0", num_blocks=7, block_size=4, max_context=4096)
    config = CoreConfig(queue_policy="priority", token_budget=16, decode_steps=1)
    core = Scheduler(replace(config, prefix_caching=False), [spec])
    core.add(_seq("L", [5, 6], 10, priority=1))
    _step(core)
    core.add(_seq("M", list(range(100, 124)), 1, priority=-1))  # chunks of 15, then 9
    _step(core)
    ws = core.workers[0]
    assert ws.kv.num_free == 2 and core.seqs["M"].num_computed == 15
    core.add(_seq("H", list(range(300, 312)), 2, priority=0))  # 3 blocks
    _step(core)
    assert core.preemptions == 0 and core.seqs["L"].status.value == "running"
    assert core.head_reason is not None and core.head_reason.value == "kv_capacity"
    _step(core)  # M has finished: its blocks are free, and the head gets them
    assert core.seqs["H"].status.value == "running" and core.preemptions == 0
