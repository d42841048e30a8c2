"""The seed's four figures, with its own numbers, on the scheduler core."""

from __future__ import annotations

from scheduler_svc.config import BatchMode, CoreConfig, KvPolicy, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.reasons import StallReason
from tests.sim import check_invariants, ran, seq, step


def make(capacity: int = 24, **cfg) -> Scheduler:
    return Scheduler(CoreConfig(**cfg), [WorkerSpec("w0", capacity, 1, 4096)])


def first_execution_of(core: Scheduler, rid: str, limit: int = 10) -> int:
    for execution in range(1, limit + 1):
        if rid in ran(step(core)):
            return execution
    raise AssertionError(f"{rid} never ran")


def figure1(mode: BatchMode) -> int:
    """A and B in decode, at most 2 running; A finishes in execution 1, then C arrives."""
    core = make(capacity=100, max_running=2, mode=mode)
    core.add(seq("A", 3, max_tokens=2))
    core.add(seq("B", 3, max_tokens=4))
    step(core)  # both prefill: now both are in decode
    assert ran(step(core)) == {"A": 1, "B": 1}  # execution 1: A's last token
    core.add(seq("C", 3, max_tokens=4))
    return first_execution_of(core, "C") + 1  # counted from execution 2


def test_figure1_static_batching_starts_c_in_execution_4() -> None:
    assert figure1(BatchMode.STATIC) == 4


def test_figure1_continuous_batching_starts_c_in_execution_2() -> None:
    assert figure1(BatchMode.CONTINUOUS) == 2


def test_figure1_static_stall_reason_is_static_batch() -> None:
    core = make(capacity=100, max_running=2, mode=BatchMode.STATIC)
    core.add(seq("A", 3, max_tokens=2))
    core.add(seq("B", 3, max_tokens=4))
    step(core)
    step(core)
    core.add(seq("C", 3, max_tokens=4))
    assert ran(step(core)) == {"B": 1}
    assert core.snapshot().head_wait_reason == "static_batch"


def test_figure2_b_decodes_with_c_prefill_and_d_waits() -> None:
    core = make(capacity=100, max_running=2)
    core.add(seq("A", 3, max_tokens=1))  # A stops after its first token
    core.add(seq("B", 3, max_tokens=5))
    step(core)  # A finishes, B continues
    core.add(seq("C", 6, max_tokens=5))
    core.add(seq("D", 4, max_tokens=5))
    assert ran(step(core)) == {"B": 1, "C": 6}
    snap = core.snapshot()
    assert snap.waiting == 1 and snap.head_wait_reason == StallReason.MAX_RUNNING.value
    assert [s.request_id for s in core.waiting] == ["D"]


def b_with_six_positions_then_c(policy: KvPolicy) -> Scheduler:
    """B holds KV for 6 positions and is in decode; C (6 prompt tokens) waits."""
    core = make(capacity=24, token_budget=8, policy=policy)
    core.add(seq("B", 6, max_tokens=14))  # reserve: 6 + 14 = 20 positions
    step(core)
    core.add(seq("C", 6, max_tokens=6))
    return core


def test_figure3_budget_8_processes_1_plus_6_and_writes_13_of_24() -> None:
    core = b_with_six_positions_then_c(KvPolicy.PAGED)
    assert core.snapshot().workers[0].written == 6
    processed = ran(step(core))
    assert processed == {"B": 1, "C": 6} and sum(processed.values()) == 7 <= 8
    kv = core.snapshot().workers[0]
    assert (kv.written, kv.capacity) == (13, 24)
    check_invariants(core)


def test_figure4_reserve_makes_c_wait_with_kv_reserved() -> None:
    core = b_with_six_positions_then_c(KvPolicy.RESERVE)
    kv = core.snapshot().workers[0]
    assert (kv.written, kv.reserved_unwritten, kv.free) == (6, 14, 4)
    assert ran(step(core)) == {"B": 1}
    snap = core.snapshot()
    assert snap.head_wait_reason == "kv_reserved"
    assert snap.stalls == {"kv_reserved": 1}
    assert snap.workers[0].written == 7  # far below the capacity of 24
    check_invariants(core)


def test_figure4_paged_admits_c() -> None:
    core = b_with_six_positions_then_c(KvPolicy.PAGED)
    assert ran(step(core)) == {"B": 1, "C": 6}
    snap = core.snapshot()
    assert snap.head_wait_reason == "" and snap.stalls == {}
    check_invariants(core)


def test_kv_capacity_reason_when_the_data_itself_does_not_fit() -> None:
    core = make(capacity=24, token_budget=32, policy=KvPolicy.RESERVE)
    core.add(seq("B", 20, max_tokens=2))
    step(core)
    core.add(seq("C", 6, max_tokens=1))
    assert "C" not in ran(step(core))
    assert core.snapshot().head_wait_reason == "kv_capacity"


def test_token_budget_reason_without_chunked_prefill() -> None:
    core = make(capacity=100, token_budget=8, chunked_prefill=False)
    core.add(seq("B", 6, max_tokens=5))
    step(core)
    core.add(seq("C", 8, max_tokens=5))
    assert ran(step(core)) == {"B": 1}
    assert core.snapshot().head_wait_reason == "token_budget"
