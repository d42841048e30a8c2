"""Faults through real processes (loopback): workers and the scheduler killed with SIGKILL and
restarted, every service stopped with SIGTERM, a request that breaks the model. A fault must
strike streams in flight: those tests run the simulated model, each step STEP_FLOOR_MS or more
(held_settings), so a stream outlasts the test's own steps on any host; the tiny model may end
300 tokens in a tenth of a second on a fast one.

Every accepted request must end properly: with its full output (identical to an undisturbed
greedy run) when a worker survives, or with UNAVAILABLE within a bounded time when none does.
"""

from __future__ import annotations

import math
import signal
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmcommon.server import CHANNEL_OPTIONS
from llmcommon.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from llmserve import client
from llmserve.stack import StackSettings
from tests.stack_checks import (
    generate,
    greedy_request,
    stop_cleanly,
    wait_for,
    wait_idle,
)
from tests.stacks import free_run, running_stack, tiny_settings
from tests.streams import Streams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]

LENGTH = common_pb2.FINISH_REASON_LENGTH
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
BOUND = 15.0  # seconds: generous bound on "at once" after a fault, on a loaded 2-core machine
STEP_FLOOR_MS = 10.0  # held_settings: a 200-token stream lasts 2 s or more on any host


def held_settings(**overrides) -> StackSettings:
    """A stack on the simulated model (deterministic greedy tokens, a request recomputed
    elsewhere samples the same ones), each step STEP_FLOOR_MS or more."""
    return tiny_settings(model="sim", sim_step_ms=STEP_FLOOR_MS, **overrides)


def baseline(target: str, n: int, max_tokens: int) -> list[list[int]]:
    streams = Streams(target, [greedy_request(i, max_tokens) for i in range(n)])
    outcomes = streams.join(120)
    assert all(o.final is not None for o in outcomes), [o.details for o in outcomes]
    return [o.tokens for o in outcomes]


def streaming(target: str, n: int, max_tokens: int) -> tuple[Streams, list[list[int]]]:
    """An undisturbed run's tokens (`baseline`), then the same n greedy streams started again
    and each past its first tokens: (the streams, what each should come to)."""
    expected = baseline(target, n, max_tokens)
    streams = Streams(target, [greedy_request(i, max_tokens) for i in range(n)])
    wait_for(lambda: streams.all_have(3), 60, "every stream has tokens")
    return streams, expected


def kill9(stack, name: str) -> None:
    """SIGKILL one process and reap it (its sockets close a little before it can be reaped)."""
    stack.procs[name].kill()
    assert stack.procs[name].wait(10) == -signal.SIGKILL


def served(target: str, request) -> list[int] | None:
    """The request's tokens, or None while the stack answers UNAVAILABLE (anything else fails)."""
    try:
        return generate(target, request, timeout=10)[0]
    except grpc.RpcError as err:
        assert err.code() is UNAVAILABLE, err
        return None


def worker_running(scheduler: str, index: int) -> bool:
    return client.status(scheduler).workers[index].running > 0


def worker_healthy(scheduler: str, index: int) -> bool:
    return client.status(scheduler).workers[index].healthy


def test_killed_worker_requests_finish_on_the_survivor_unchanged(tmp_path) -> None:
    settings = held_settings(workers=2, kv_capacity=4096, block_size=16, token_budget=64)
    n, max_tokens = 6, 300
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        expected = baseline(gw, n, max_tokens)

        streams = Streams(gw, [greedy_request(i, max_tokens) for i in range(n)])
        wait_for(lambda: streams.all_have(5), 60, "every stream has tokens")
        wait_for(lambda: worker_running(sched, 0), 10, "worker0 runs requests")
        kill9(stack, "worker0")
        outcomes = streams.join(120)

        assert [o.code for o in outcomes] == [None] * n, [o.details for o in outcomes]
        assert [o.tokens for o in outcomes] == expected  # nothing lost, nothing repeated
        assert all(o.final.finish_reason == LENGTH for o in outcomes)
        moved = sum(o.final.usage.preemptions for o in outcomes)
        assert moved >= 1  # worker0's requests were recomputed on worker1
        status = wait_idle(sched)
        assert [w.healthy for w in status.workers] == [False, True]
        print(f"\nworker0 killed: {moved} requests recomputed on worker1, all {n} outputs exact")

        # the same command line on the same port: worker0 registers again and receives work
        stack.restart("worker0")
        restarted = time.monotonic()
        wait_for(lambda: worker_healthy(sched, 0), BOUND, "scheduler takes worker0 back")
        print(f"worker0 back in the scheduler {time.monotonic() - restarted:.1f} s after SERVING")
        streams = Streams(gw, [greedy_request(i, max_tokens) for i in range(n)])
        wait_for(lambda: worker_running(sched, 0), 30, "worker0 receives work again")
        outcomes = streams.join(120)
        assert [o.tokens for o in outcomes] == expected
        wait_idle(sched)
        stop_cleanly(stack)


def test_the_single_worker_killed_and_restarted_loses_no_stream(tmp_path) -> None:
    """kill -9 of the only worker mid-stream, started again on its port: the requests wait for
    it (--worker-return-timeout, 30 s by default), are recomputed there and end whole, exact.
    (They failed at once with "no live worker ... 0 live".)"""
    settings = held_settings(workers=1, kv_capacity=2048, token_budget=64)
    n, max_tokens = 3, 300
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        streams, expected = streaming(gw, n, max_tokens)
        kill9(stack, "worker0")
        wait_for(lambda: not worker_healthy(sched, 0), BOUND, "worker0 shown failed")
        late = Streams(gw, [greedy_request(n, max_tokens)])  # queued meanwhile, not refused
        stack.restart("worker0")
        outcomes = streams.join(120) + late.join(120)
        assert [o.code for o in outcomes] == [None] * (n + 1), [o.details for o in outcomes]
        assert [o.tokens for o in outcomes[:n]] == expected
        assert sum(o.final.usage.preemptions for o in outcomes[:n]) >= 1  # they were recomputed
        wait_idle(sched)
        stop_cleanly(stack)


def test_single_worker_death_gives_unavailable_then_recovers(tmp_path) -> None:
    """The only worker killed and not back within --worker-return-timeout: its requests end
    with UNAVAILABLE after that bound, new ones are refused at once; back, it serves."""
    wait = 2.0
    settings = held_settings(
        workers=1, kv_capacity=2048, token_budget=64,
        scheduler_flags=f"--worker-return-timeout {wait}",
    )  # fmt: skip
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        streams = Streams(gw, [greedy_request(i, 1000) for i in range(3)])
        wait_for(lambda: streams.all_have(3), 60, "every stream has tokens")
        killed = time.monotonic()
        kill9(stack, "worker0")
        outcomes = streams.join(wait + BOUND + 5)
        for o in outcomes:
            assert o.code is UNAVAILABLE and f"none back within {wait:g} s" in o.details, (
                o.code, o.details,
            )  # fmt: skip
            assert wait <= o.ended_at - killed < wait + BOUND
        waited = max(o.ended_at for o in outcomes) - killed
        print(f"\nsingle worker killed: 3 streams got UNAVAILABLE {waited:.2f} s after SIGKILL")

        # while it is down: refused at once, nothing held
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            generate(gw, greedy_request(9, 4), timeout=BOUND * 2)
        assert err.value.code() is UNAVAILABLE and "worker" in err.value.details()
        assert time.monotonic() - started < BOUND
        status = wait_idle(sched)
        assert not status.workers[0].healthy

        # back: new requests succeed again
        stack.restart("worker0")
        back = time.monotonic()
        request = greedy_request(1, 8)
        wait_for(lambda: served(gw, request), BOUND, "a request succeeds", period=0.2)
        print(f"worker restarted: requests succeed {time.monotonic() - back:.1f} s after SERVING")
        wait_idle(sched)
        stop_cleanly(stack)


def test_scheduler_kill_and_restart_loses_no_request_the_gateway_holds(tmp_path) -> None:
    """kill -9 of the scheduler mid-stream: new requests are refused at once with UNAVAILABLE
    while it is down; the streams in flight wait, and once it is back the gateway resubmits
    them with the tokens already streamed: each client sees its whole output, no gap, no
    duplicate. The worker's view resets when the new scheduler connects (KV back to 0)."""
    settings = held_settings(
        workers=1, kv_capacity=2048, token_budget=64, metrics_base_port=free_run(3)
    )
    n, max_tokens = 3, 300
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        streams, expected = streaming(gw, n, max_tokens)
        kill9(stack, "scheduler")
        with pytest.raises(grpc.RpcError) as err:  # down: refused, not hung
            generate(gw, greedy_request(1, 4), timeout=BOUND)
        assert err.value.code() is UNAVAILABLE and "scheduler" in err.value.details()
        # The condition itself, not a wait for one: the scheduler stays down 2 s, so the
        # gateway's reconnect backoff grows to its 1 s cap meanwhile (200 ms, x1.6 each try); a
        # slow host only keeps it down longer, which --resubmit-timeout (30 s) bounds.
        time.sleep(2)
        stack.restart("scheduler")
        outcomes = streams.join(120)
        assert [o.code for o in outcomes] == [None] * n, [o.details for o in outcomes]
        assert [o.tokens for o in outcomes] == expected  # nothing lost, nothing repeated
        assert all(o.final.finish_reason == LENGTH for o in outcomes)
        print(f"\nscheduler killed and restarted: {n} streams complete and exact")
        status = wait_idle(sched)
        assert status.finished == n  # the restarted scheduler finished all three
        assert metric(settings.metrics_port(0), "llmserve_gateway_resubmissions_total") == n
        assert generate(gw, greedy_request(0, 40))[0] == expected[0][:40]
        stop_cleanly(stack)


def health_watch(target: str):
    channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    return channel, watch


def test_sigterm_drains_the_gateway_and_the_scheduler(tmp_path) -> None:
    settings = held_settings(workers=1, kv_capacity=2048, token_budget=64)
    n, max_tokens = 3, 200
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        expected = baseline(gw, n, max_tokens)
        for name, target in (("scheduler", sched), ("gateway", gw)):
            if name == "gateway":  # the scheduler went first: bring it back
                stack.restart("scheduler")
                ready = greedy_request(0, 4)
                wait_for(lambda r=ready: served(gw, r), BOUND, "the gateway serves again", 0.2)
            channel, watch = health_watch(target)
            streams = Streams(gw, [greedy_request(i, max_tokens) for i in range(n)])
            wait_for(lambda s=streams: s.all_have(3), 60, "every stream has tokens")
            proc = stack.procs[name]
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            statuses = [r.status for r in watch]  # the stream ends when the server stops
            assert statuses == [health_pb2.HealthCheckResponse.NOT_SERVING]
            with pytest.raises(grpc.RpcError) as err:  # new requests are refused
                generate(gw, greedy_request(7, 4), timeout=BOUND)
            assert err.value.code() is UNAVAILABLE
            outcomes = streams.join(60)
            assert [o.tokens for o in outcomes] == expected, [o.details for o in outcomes]
            assert all(o.ended_at > sent for o in outcomes)  # they were in flight at SIGTERM
            assert proc.wait(30) == 0
            took = time.monotonic() - sent
            channel.close()
            print(f"\n{name} SIGTERM: {n} in-flight streams completed; exit 0 after {took:.1f} s")
            assert took < 10.0  # the grace period; the Watch stream did not hold it open
        stop_cleanly(stack)


def test_sigterm_worker_drains_its_requests_and_exits_zero(tmp_path) -> None:
    """SIGTERM on a worker: health NOT_SERVING, the scheduler stops placing requests there, the
    worker finishes the ones it holds (no move, no recompute) and exits 0; new requests go to
    the other worker."""
    settings = held_settings(workers=2, kv_capacity=4096, token_budget=64)
    n, max_tokens = 6, 300
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        expected = baseline(gw, n, max_tokens)
        streams = Streams(gw, [greedy_request(i, max_tokens) for i in range(n)])
        wait_for(lambda: streams.all_have(5), 60, "every stream has tokens")
        wait_for(lambda: worker_running(sched, 1), 10, "worker1 runs requests")
        stack.procs["worker1"].send_signal(signal.SIGTERM)
        wait_for(lambda: client.status(sched).workers[1].draining, 10, "worker1 draining")
        late = generate(gw, greedy_request(0, 20))[0]  # placed on worker0 while worker1 drains
        outcomes = streams.join(120)
        assert [o.tokens for o in outcomes] == expected, [o.details for o in outcomes]
        assert all(o.final.usage.preemptions == 0 for o in outcomes)  # nothing was moved
        assert late == expected[0][:20]
        assert stack.procs["worker1"].wait(30) == 0
        wait_idle(sched)
        stop_cleanly(stack)


def test_sigterm_single_worker_finishes_in_flight_then_exits_zero(tmp_path) -> None:
    settings = held_settings(kv_capacity=4096, token_budget=64)
    with running_stack(settings, tmp_path) as stack:
        gw = settings.gateway
        expected = baseline(gw, 3, 200)
        streams = Streams(gw, [greedy_request(i, 200) for i in range(3)])
        wait_for(lambda: streams.all_have(5), 60, "every stream has tokens")
        stack.procs["worker0"].send_signal(signal.SIGTERM)
        outcomes = streams.join(120)
        assert [o.tokens for o in outcomes] == expected, [o.details for o in outcomes]
        assert stack.procs["worker0"].wait(30) == 0


def describe(worker: str) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(worker, options=CHANNEL_OPTIONS) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Describe(
            worker_pb2.DescribeRequest(), timeout=10
        )


def test_bad_requests_sent_to_the_scheduler_directly_are_refused_and_harm_no_one(
    tmp_path,
) -> None:
    """The scheduler is a service like any other: a token id outside the vocabulary or a NaN
    temperature (the gateway refuses both) used to fail every request of the batch they
    joined. Now they are refused with INVALID_ARGUMENT while 10 streams run undisturbed."""
    settings = tiny_settings(workers=2, kv_capacity=2048, token_budget=64)
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        expected = baseline(gw, 10, 40)
        streams = Streams(gw, [greedy_request(i, 40) for i in range(10)])
        vocab = describe(f"127.0.0.1:{settings.worker_base_port}").vocab_size
        bad = {
            "outside the vocabulary": dict(prompt_token_ids=[1, vocab], max_tokens=4),
            "temperature": dict(prompt_token_ids=[1, 2], max_tokens=4, temperature=math.nan),
            "top_p": dict(prompt_token_ids=[1, 2], max_tokens=4, top_p=math.inf),
            "resumed tokens": dict(prompt_token_ids=[1], max_tokens=2, resume_token_ids=[3, 4]),
        }
        with grpc.insecure_channel(sched, options=CHANNEL_OPTIONS) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            for words, fields in bad.items():
                prompt, resume = fields.pop("prompt_token_ids"), fields.pop("resume_token_ids", [])
                request = scheduler_pb2.SubmitRequest(
                    prompt_token_ids=prompt,
                    resume_token_ids=resume,
                    sampling=common_pb2.SamplingParams(**fields),
                )
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Submit(request, timeout=30))
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert words in err.value.details()
        outcomes = streams.join(120)
        assert [o.tokens for o in outcomes] == expected, [o.details for o in outcomes]
        status = wait_idle(sched)
        assert all(w.healthy for w in status.workers)
        stop_cleanly(stack)


def metric(metrics_port: int, name: str) -> float:
    """The value of a metric without labels (or with one series only) on a service's page."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    [line] = [x for x in text.splitlines() if x.startswith(name)]
    return float(line.split()[-1])


def worker_written(metrics_port: int) -> float:
    return metric(metrics_port, "llmserve_worker_kv_written_positions")


def test_a_worker_shows_its_kv_free_once_its_scheduler_is_gone(tmp_path) -> None:
    """The worker's requests belong to the scheduler's stream: when that stream ends (the
    scheduler was killed), its KV is free at once, not at the next step of a new scheduler."""
    settings = held_settings(kv_capacity=2048, token_budget=64, metrics_base_port=free_run(3))
    with running_stack(settings, tmp_path) as stack:
        port = settings.metrics_port(2)
        streams = Streams(settings.gateway, [greedy_request(i, 1000) for i in range(3)])
        wait_for(lambda: worker_written(port) > 0, 60, "the worker holds KV")
        kill9(stack, "scheduler")
        wait_for(lambda: worker_written(port) == 0, BOUND, "the worker's KV shown free")
        stack.restart("scheduler")
        assert [o.code for o in streams.join(120)] == [None] * 3
        stop_cleanly(stack)
