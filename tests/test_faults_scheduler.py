"""The scheduler's own faults, through real processes (the simulated model with a step floor,
so the streams are in flight when the fault strikes on any host; loopback): a scheduler
that was stopped does not blame its workers, and a restarted one serves with the workers that
answer while another listed one is down."""

from __future__ import annotations

import signal
import time

import pytest

from llmserve import client
from tests.stack_checks import greedy_request, stop_cleanly, wait_for, wait_idle
from tests.stacks import running_stack
from tests.streams import Streams
from tests.test_faults import BOUND, baseline, held_settings, kill9, streaming, worker_running

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]

HANG_FLOOR = 2.0
STOPPED_S = 6.0  # three hang floors, and more than a health check's timeout on top


def test_a_stopped_scheduler_fails_no_worker_and_every_stream_completes(tmp_path) -> None:
    """SIGSTOP the scheduler for 3 hang bounds under 20 streams on two healthy workers: by the
    wall clock every step answer is late when it runs again; by its own running time none is.
    No worker is failed, nothing is moved, every stream completes identical to an undisturbed
    run. (It failed both workers and every stream with "no live worker ... 0 live".)"""
    settings = held_settings(
        workers=2, kv_capacity=4096, token_budget=64, max_running=32,
        scheduler_flags=f"--hang-floor {HANG_FLOOR}",
    )  # fmt: skip
    n, max_tokens = 20, 200
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        streams, expected = streaming(gw, n, max_tokens)
        wait_for(lambda: worker_running(sched, 0) and worker_running(sched, 1), 10, "both run")
        scheduler = stack.procs["scheduler"]
        scheduler.send_signal(signal.SIGSTOP)
        try:
            time.sleep(STOPPED_S)  # the condition itself: the process does not run at all
        finally:
            scheduler.send_signal(signal.SIGCONT)
        outcomes = streams.join(120)
        assert [o.code for o in outcomes] == [None] * n, {o.details for o in outcomes}
        assert [o.tokens for o in outcomes] == expected
        assert sum(o.final.usage.preemptions for o in outcomes) == 0  # nothing was moved
        status = wait_idle(sched)
        assert [w.healthy for w in status.workers] == [True, True]
        print(f"\nscheduler SIGSTOPped {STOPPED_S:.0f} s under {n} streams: all complete, exact")
        stop_cleanly(stack)


def test_a_restarted_scheduler_serves_with_the_workers_that_answer(tmp_path) -> None:
    """kill -9 one of two workers, then kill -9 and restart the scheduler: it serves with the
    worker that answers (it waited up to 120 s for both, and every request the gateway held
    failed at the 30 s resubmit timeout); the other joins when it comes back."""
    settings = held_settings(workers=2, kv_capacity=4096, token_budget=64)
    n, max_tokens = 4, 200
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        streams, expected = streaming(gw, n, max_tokens)
        kill9(stack, "worker1")
        kill9(stack, "scheduler")
        killed = time.monotonic()
        stack.restart("scheduler", timeout=BOUND)
        serving = time.monotonic() - killed
        outcomes = streams.join(120)
        assert [o.code for o in outcomes] == [None] * n, [o.details for o in outcomes]
        assert [o.tokens for o in outcomes] == expected
        done = max(o.ended_at for o in outcomes) - killed
        print(f"\nscheduler restarted without worker1: SERVING after {serving:.1f} s, "
              f"{n} held streams complete and exact {done:.1f} s after the kill")  # fmt: skip
        assert [w.name for w in client.status(sched).workers if w.healthy] == ["worker0"]

        stack.restart("worker1")
        joined = lambda: sorted(w.name for w in client.status(sched).workers if w.healthy)  # noqa: E731
        wait_for(lambda: joined() == ["worker0", "worker1"], BOUND, "worker1 joins")
        streams = Streams(gw, [greedy_request(i, max_tokens) for i in range(6)])
        wait_for(lambda: worker_running(sched, 1), 30, "worker1 receives work")
        assert [o.tokens for o in streams.join(120)] == baseline(gw, 6, max_tokens)
        wait_idle(sched)
        stop_cleanly(stack)
