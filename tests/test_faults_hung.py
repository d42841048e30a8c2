"""Workers that hang, stop, come back and die while draining, through real processes (the
simulated model, each step a floor of time, so the streams are in flight when the fault strikes
on any host; loopback): no request is left hanging, and one bad worker never stalls the rest."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from llmserve import client
from tests.stack_checks import generate, greedy_request, stop_cleanly, wait_for, wait_idle
from tests.stacks import running_stack, tiny_settings
from tests.streams import Streams
from tests.test_faults import BOUND, baseline, held_settings, kill9, worker_running

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]

HANG_FLOOR = 2.0  # --hang-floor for these stacks: a hung worker is failed after about this


def worker_state(scheduler: str, index: int) -> tuple[bool, bool] | None:
    """(healthy, draining) of worker<index>; None while it is not listed (it left)."""
    for w in client.status(scheduler).workers:
        if w.name == f"worker{index}":
            return w.healthy, w.draining
    return None


def test_a_hung_worker_is_failed_within_its_bound_and_stalls_no_one_else(tmp_path) -> None:
    """SIGSTOP one of two workers during 20 streams: the scheduler fails it within the hang
    bound, its requests are recomputed on the other (outputs identical), no stream waits long;
    after SIGCONT it rejoins clean and gets work again."""
    settings = held_settings(
        workers=2, kv_capacity=4096, token_budget=64, max_running=32,
        scheduler_flags=f"--hang-floor {HANG_FLOOR}",
    )  # fmt: skip
    n, max_tokens = 20, 200
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        expected = baseline(gw, n, max_tokens)
        streams = Streams(gw, [greedy_request(i, max_tokens) for i in range(n)])
        wait_for(lambda: streams.all_have(5), 60, "every stream has tokens")
        wait_for(lambda: worker_running(sched, 1), 10, "worker1 runs requests")
        worker1 = stack.procs["worker1"]
        worker1.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            wait_for(lambda: worker_state(sched, 1) == (False, False), HANG_FLOOR + BOUND, "failed")
            detected = time.monotonic() - stopped
            outcomes = streams.join(120)
        finally:
            worker1.send_signal(signal.SIGCONT)
        assert [o.tokens for o in outcomes] == expected, [o.details for o in outcomes]
        gap = max(o.longest_gap() for o in outcomes)
        moved = sum(o.final.usage.preemptions for o in outcomes)
        print(f"\nworker1 SIGSTOPped: failed after {detected:.1f} s, {moved} requests moved, "
              f"longest gap in any stream {gap:.1f} s")  # fmt: skip
        assert moved >= 1 and detected < HANG_FLOOR + BOUND
        assert gap < HANG_FLOOR + BOUND  # bounded by detection, not by --execute-timeout (120 s)
        wait_for(lambda: worker_state(sched, 1) == (True, False), BOUND, "worker1 back")
        streams = Streams(gw, [greedy_request(i, max_tokens) for i in range(n)])
        wait_for(lambda: worker_running(sched, 1), 30, "worker1 receives work again")
        assert [o.tokens for o in streams.join(120)] == expected
        wait_idle(sched)
        stop_cleanly(stack)


def test_a_worker_restarted_after_a_drain_takes_work_and_survives_the_other_dying(
    tmp_path,
) -> None:
    """SIGTERM one of two workers under load, start it again on the same port: it is healthy,
    not draining, and gets work; kill -9 the other: its requests finish on the restarted one."""
    settings = held_settings(workers=2, kv_capacity=4096, token_budget=64)
    n, max_tokens = 6, 200
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        expected = baseline(gw, n, max_tokens)
        streams = Streams(gw, [greedy_request(i, max_tokens) for i in range(n)])
        wait_for(lambda: streams.all_have(5), 60, "every stream has tokens")
        stack.procs["worker1"].send_signal(signal.SIGTERM)
        assert stack.procs["worker1"].wait(60) == 0
        stack.restart("worker1")
        wait_for(lambda: worker_state(sched, 1) == (True, False), BOUND, "worker1 back, live")
        assert [o.tokens for o in streams.join(120)] == expected

        streams = Streams(gw, [greedy_request(i, max_tokens) for i in range(n)])
        wait_for(lambda: streams.all_have(5), 60, "every stream has tokens")
        wait_for(lambda: worker_running(sched, 1), 10, "worker1 runs requests")
        kill9(stack, "worker0")
        outcomes = streams.join(120)
        assert [o.tokens for o in outcomes] == expected, [o.details for o in outcomes]
        wait_idle(sched)
        stop_cleanly(stack)


def test_requests_no_live_worker_can_take_fail_unavailable_instead_of_waiting(tmp_path) -> None:
    """One worker, two running and two waiting (running limit 2): SIGTERM it. The two running
    finish on it as it drains; the two waiting can never be placed and end at once with
    UNAVAILABLE; so do new requests."""
    settings = held_settings(kv_capacity=4096, token_budget=64, max_running=2)
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        expected = baseline(gw, 4, 300)
        streams = Streams(gw, [greedy_request(i, 300) for i in range(4)])
        wait_for(lambda: client.status(sched).waiting == 2, 60, "two requests wait")
        stack.procs["worker0"].send_signal(signal.SIGTERM)
        sent = time.monotonic()
        outcomes = streams.join(120)
        done = [i for i, o in enumerate(outcomes) if o.final is not None]
        assert len(done) == 2 and all(outcomes[i].tokens == expected[i] for i in done)
        for o in (o for o in outcomes if o.final is None):
            assert o.code is grpc.StatusCode.UNAVAILABLE and "no live worker" in o.details
            assert o.ended_at - sent < BOUND
        with pytest.raises(grpc.RpcError) as err:
            generate(gw, greedy_request(9, 4), timeout=BOUND)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert client.status(sched).waiting == 0


def test_a_worker_killed_while_draining_is_shown_failed_and_its_requests_move(tmp_path) -> None:
    settings = held_settings(workers=2, kv_capacity=4096, token_budget=64)
    n, max_tokens = 6, 400
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        expected = baseline(gw, n, max_tokens)
        streams = Streams(gw, [greedy_request(i, max_tokens) for i in range(n)])
        wait_for(lambda: streams.all_have(5), 60, "every stream has tokens")
        wait_for(lambda: worker_running(sched, 1), 10, "worker1 runs requests")
        stack.procs["worker1"].send_signal(signal.SIGTERM)
        wait_for(lambda: worker_state(sched, 1) == (True, True), 10, "worker1 draining")
        kill9(stack, "worker1")
        wait_for(lambda: worker_state(sched, 1) == (False, True), BOUND, "worker1 shown failed")
        outcomes = streams.join(120)
        assert [o.tokens for o in outcomes] == expected, [o.details for o in outcomes]
        wait_idle(sched)
        stop_cleanly(stack)


def test_sigterm_lets_a_stream_longer_than_ten_seconds_finish(tmp_path) -> None:
    """The drain used to end after 10 s, failing longer streams with UNAVAILABLE; the default is
    now 60 s (--drain-timeout). A simulated 25 ms step makes a 480-token stream last ~12 s."""
    settings = tiny_settings(model="sim", sim_step_ms=25.0, kv_capacity=4096)
    with running_stack(settings, tmp_path) as stack:
        streams = Streams(settings.gateway, [greedy_request(0, 480)])
        wait_for(lambda: streams.all_have(5), 60, "the stream has tokens")
        scheduler = stack.procs["scheduler"]
        scheduler.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        [outcome] = streams.join(90)
        assert outcome.code is None and len(outcome.tokens) == 480, outcome.details
        assert scheduler.wait(30) == 0
        took = time.monotonic() - sent
        print(f"\nscheduler SIGTERM: a 480-token stream finished {took:.1f} s later; exit 0")
        assert took > 10.0  # it outlived the old grace
