"""Workers that join a running stack (registering with the scheduler) and leave it, with pools
and contexts of their own, under load: real processes, the tiny model in fp32."""

from __future__ import annotations

import signal

import pytest

from llmserve import client
from llmserve.ports import free_port
from tests.stack_checks import greedy_request, wait_for, wait_idle
from tests.stacks import running_stack, tiny_settings
from tests.streams import SteadyLoad, Streams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]


def workers(scheduler: str) -> dict[str, object]:
    return {w.name: w for w in client.status(scheduler).workers}


def test_a_worker_joins_under_load_takes_admissions_then_drains_and_leaves(tmp_path) -> None:
    """12 clients stream greedy requests one after another (4 run, the rest wait) for as long as
    it takes worker1 to join and run some of them: the load outlasts the join on any host."""
    settings = tiny_settings(workers=1, kv_capacity=2048, token_budget=64, max_running=4)
    n, max_tokens = 12, 200
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        expected = Streams(gw, [greedy_request(i, max_tokens) for i in range(n)]).join(240)
        expected_tokens = [o.tokens for o in expected]

        load = SteadyLoad(gw, lambda k: greedy_request(k % n, max_tokens), width=n, limit=2000)
        wait_for(lambda: client.status(sched).waiting > 0, 60, "requests wait (max_running 4)")
        # another pool and block size, a shorter context: welcome
        name = stack.join_worker(
            1, free_port(), "--kv-capacity", "1024", "--block-size", "8", "--max-context", "512"
        )
        joined = wait_for(lambda: workers(sched).get("worker1"), 60, "worker1 listed")
        assert (joined.block_size, joined.max_context, joined.capacity) == (8, 512, 1024)
        wait_for(lambda: ran_on_worker1(sched) or load.exhausted, 120, "worker1 takes admissions")
        assert ran_on_worker1(sched), "the load ended before worker1 took a request"
        outcomes = load.join(240)
        got = [(o.tokens, o.details) for o in outcomes]
        assert got == [(expected_tokens[k % n], "") for k in range(len(outcomes))]

        stack.procs[name].send_signal(signal.SIGTERM)  # it leaves: drains, exits 0, unlisted
        assert stack.procs[name].wait(60) == 0
        wait_for(lambda: "worker1" not in workers(sched), 30, "worker1 unlisted")
        wait_idle(sched)
        late = Streams(gw, [greedy_request(0, 20)]).join(60)[0]
        assert late.tokens == expected_tokens[0][:20]


def ran_on_worker1(scheduler: str) -> bool:
    """worker1 has run a step for a request it was given (steps never go down)."""
    worker1 = workers(scheduler).get("worker1")
    return worker1 is not None and worker1.steps > 0


def test_placement_by_free_positions_within_each_workers_context(tmp_path) -> None:
    """The joined worker1 has twice the KV but a context of 64: a short request goes there (more
    free positions), a 300-token prompt to worker0, the only one whose context holds it. (The
    gateway checks prompts against the largest context of the live workers.)"""
    settings = tiny_settings(workers=1, kv_capacity=2048, token_budget=512)
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        stack.join_worker(1, free_port(), "--kv-capacity", "4096", "--max-context", "64")
        wait_for(lambda: len(workers(sched)) == 2, 15, "two workers")
        short = client.make_request(prompt="hi", max_tokens=40, temperature=0.0, ignore_eos=True)
        long = client.make_request(
            prompt="word " * 300, max_tokens=300, temperature=0.0, ignore_eos=True
        )
        streams = Streams(gw, [short])
        wait_for(lambda: workers(sched)["worker1"].running == 1, 30, "short on worker1")
        late = Streams(gw, [long])
        wait_for(lambda: workers(sched)["worker0"].running == 1, 30, "long prompt on worker0")
        first, second = streams.join(120)[0], late.join(120)[0]
        assert len(second.tokens) == 300, second.details
        assert len(first.tokens) == 40, first.details
        wait_idle(sched)


def test_a_worker_behind_a_dns_name_is_discovered_and_joins(tmp_path) -> None:
    """The scheduler's --workers names dns:localhost:PORT (as it would a Kubernetes headless
    Service): a worker started later on that port, registering with no one, joins at the next
    lookup and takes admissions."""
    port = free_port()
    settings = tiny_settings(
        workers=1, discover=f"dns:localhost:{port}", discovery_interval=0.3, max_running=1
    )
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        assert [w.name for w in client.status(sched).workers] == ["worker0"]
        stack.join_worker(1, port, register=False)
        wait_for(lambda: "worker1" in workers(sched), 15, "worker1 discovered")
        streams = Streams(gw, [greedy_request(i, 60) for i in range(2)])  # one per worker
        wait_for(lambda: workers(sched)["worker1"].running == 1, 30, "worker1 takes one")
        assert all(len(o.tokens) == 60 for o in streams.join(60))
