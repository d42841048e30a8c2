"""Load through real processes (tiny model, loopback): queue limits, deadlines while queued, a soak
at about twice capacity, and cancellations at random moments. Every request is accounted for and
the KV comes back to zero.

LLMSERVE_SOAK_SECONDS lengthens the soak (default 60).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from llmcommon.server import CHANNEL_OPTIONS
from llmcommon.v1 import common_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from llmserve import client
from tests.stack_checks import (
    generate,
    greedy_request,
    stack_rss,
    stop_cleanly,
    wait_for,
    wait_idle,
)
from tests.stacks import running_stack, tiny_settings
from tests.streams import Held, Streams

pytestmark = pytest.mark.usefixtures("hang_guard")
SOAK_SECONDS = float(os.environ.get("LLMSERVE_SOAK_SECONDS", "60"))
BOUND = 15.0  # seconds: a generous bound on "at once" on a loaded 2-core machine
SIM_STEP_MS = 20.0
WORDS = "the cat sat on a mat and then it ran far away to see what the dog was up to".split()


def waiting(scheduler: str) -> int:
    return client.status(scheduler).waiting


def running(scheduler: str) -> int:
    return client.status(scheduler).running


def expect_code(target: str, request, timeout: float) -> tuple[grpc.StatusCode, str, float]:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        generate(target, request, timeout=timeout)
    return err.value.code(), err.value.details() or "", time.monotonic() - started


def blocking_settings(**overrides):
    """A stack on the simulated model whose every step takes at least SIM_STEP_MS: a Blocker's
    1900 tokens last 38 s or more on any host (the tiny model may run them in 2 s on a fast one,
    ending before the test has seen what it waits for)."""
    return tiny_settings(model="sim", sim_step_ms=SIM_STEP_MS, **overrides)


class Blocker(Held):
    """A long request holding the only running slot until cancelled (on a blocking_settings
    stack)."""

    def __init__(self, target: str) -> None:
        super().__init__(target, greedy_request(0, 1900))


def test_queue_token_limit_refuses_at_once(tmp_path) -> None:
    settings = blocking_settings(max_running=1, max_queued_requests=10, max_queued_tokens=60)
    prompt = " ".join(WORDS[:12])  # about 13 tokens
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        blocker = Blocker(gw)
        assert blocker.streaming.wait(BOUND), "the blocker never ran"
        small = client.make_request(prompt=prompt, max_tokens=4, ignore_eos=True)
        queued = Streams(gw, [small] * 3, timeout=BOUND * 4)  # they wait as long as it runs
        wait_for(lambda: waiting(sched) == 3, BOUND, "three requests wait")
        code, details, took = expect_code(gw, client.make_request(prompt=prompt * 3), BOUND)
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "prompt tokens" in details
        assert took < 5.0
        blocker.cancel()
        assert [len(o.tokens) for o in queued.join(BOUND * 4)] == [4, 4, 4]  # then they ran
        wait_idle(sched)
        stop_cleanly(stack)


def watch_queue(scheduler: str, seen: list[int], seconds: float = 5.0) -> None:
    """Note (in `seen`) whether a request waits in the scheduler's queue within `seconds`."""
    deadline = time.monotonic() + seconds
    while not seen and time.monotonic() < deadline:
        if waiting(scheduler):
            seen.append(1)
        time.sleep(0.01)


def test_deadline_while_queued_frees_everything(tmp_path) -> None:
    settings = blocking_settings(max_running=1, max_queued_requests=1, kv_capacity=2048)
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        for i in range(3):  # the one queue slot is freed every time, or the next is refused
            blocker = Blocker(gw)  # a fresh one each time: it outlasts the deadline
            assert blocker.streaming.wait(BOUND), "the blocker never ran"
            seen: list[int] = []
            watcher = threading.Thread(target=watch_queue, args=(sched, seen))
            watcher.start()
            code, details, took = expect_code(gw, greedy_request(i + 1, 8), timeout=2.0)
            watcher.join()
            assert code is grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)
            assert seen, "the request never waited in the scheduler's queue"
            assert 1.9 < took < 2.0 + BOUND
            wait_for(lambda: waiting(sched) == 0, BOUND, "the expired request left the queue")
            assert running(sched) == 1  # the blocker still runs: the request expired waiting
            blocker.cancel()
            wait_idle(sched)  # all KV free: the expired request held none
        stop_cleanly(stack)


# ---- soak ---------------------------------------------------------------------------------------


class Soak:
    """Open-loop arrivals; each request completes, is refused, is cancelled or expires."""

    def __init__(self, target: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.pool = ThreadPoolExecutor(max_workers=48)
        self.lock = threading.Lock()
        self.sent = 0
        self.outcomes: Counter[str] = Counter()
        self.errors: list[str] = []

    def request(self):
        words = [self.rng.choice(WORDS) for _ in range(self.rng.randint(3, 40))]
        max_tokens = self.rng.randint(4, 40)
        return client.make_request(prompt=" ".join(words), max_tokens=max_tokens, ignore_eos=True)

    def send(self, kind: str) -> None:
        request = self.request()
        cancel_after = self.rng.uniform(0.0, 0.5) if kind == "cancel" else None
        timeout = self.rng.uniform(0.05, 1.0) if kind == "deadline" else 120.0
        with self.lock:
            self.sent += 1
        self.pool.submit(self._one, request, cancel_after, timeout)

    def _one(self, request, cancel_after: float | None, timeout: float) -> None:
        call = self.stub.Generate(request, timeout=timeout)
        timer = threading.Timer(cancel_after, call.cancel) if cancel_after is not None else None
        if timer:
            timer.start()
        try:
            final = [m for m in call][-1].final
            outcome = "completed" if final.finish_reason == common_pb2.FINISH_REASON_LENGTH else ""
        except grpc.RpcError as err:
            outcome = {
                grpc.StatusCode.RESOURCE_EXHAUSTED: "refused",
                grpc.StatusCode.CANCELLED: "cancelled",
                grpc.StatusCode.DEADLINE_EXCEEDED: "expired",
            }.get(err.code(), "")
            if not outcome:
                with self.lock:
                    self.errors.append(f"{err.code()}: {err.details()}")
        finally:
            if timer:
                timer.cancel()
        with self.lock:
            self.outcomes[outcome or "other"] += 1

    def run(self, rate: float, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            kind = self.rng.choices(["plain", "cancel", "deadline"], [0.7, 0.15, 0.15])[0]
            self.send(kind)
            time.sleep(self.rng.expovariate(rate))

    def finish(self, timeout: float) -> None:
        self.pool.shutdown(wait=True, cancel_futures=False)
        self.channel.close()


def measure_capacity(target: str, concurrency: int, seconds: float = 6.0) -> float:
    """Completed requests per second with `concurrency` clients back to back (the soak's mix)."""
    soak = Soak(target, seed=1)
    done: list[int] = []
    end = time.monotonic() + seconds

    def client_loop() -> None:
        while time.monotonic() < end:
            generate(target, soak.request(), timeout=60)
            done.append(1)

    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    soak.finish(10)
    return len(done) / (time.monotonic() - started)


@pytest.mark.slow
@pytest.mark.hang_seconds(SOAK_SECONDS + 300)
def test_soak_at_twice_capacity_accounts_for_every_request(tmp_path) -> None:
    seconds = SOAK_SECONDS
    settings = tiny_settings(  # a KV pool small enough that requests get preempted
        max_running=4, kv_capacity=256, token_budget=64, max_queued_requests=8
    )
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        capacity = measure_capacity(gw, concurrency=settings.max_running)
        wait_idle(sched)
        rss_before = stack_rss(stack)
        rate = 2 * capacity  # no cap: below capacity (a fast host) nothing would be refused
        soak = Soak(gw, seed=6)
        soak.run(rate, seconds)
        soak.finish(BOUND * 4)
        status = wait_idle(sched, timeout=BOUND * 2)
        rss_after = stack_rss(stack)

        counted = sum(soak.outcomes.values())
        print(
            f"\nsoak {seconds:.0f} s at {rate:.1f} req/s (capacity {capacity:.1f} req/s): "
            f"sent {soak.sent}, {dict(soak.outcomes)}; scheduler: admitted {status.admitted}, "
            f"finished {status.finished}, preemptions {status.preemptions}"
        )
        for name in rss_before:
            print(f"  {name}: VmRSS {rss_before[name] // 1024} -> {rss_after[name] // 1024} MiB")
        assert not soak.errors, soak.errors[:5]
        assert soak.outcomes["other"] == 0
        assert counted == soak.sent  # completed + refused + cancelled + expired = sent
        assert soak.outcomes["completed"] > 0 and soak.outcomes["refused"] > 0
        for name, before in rss_before.items():  # flat, with generous slack
            assert rss_after[name] <= before * 1.25 + 48 * 1024, (name, before, rss_after[name])
        assert status.running == 0 and status.waiting == 0
        assert all(w.written == 0 and w.reserved_unwritten == 0 for w in status.workers)
        stop_cleanly(stack)
        assert "checking the core's invariants" in stack.log("scheduler").read_text()


# ---- cancellations ------------------------------------------------------------------------------


class Cancelled:
    """One request submitted straight to the scheduler and cancelled at a random moment of a
    random phase: queued (after 0-50 ms), prefill (0-30 ms after its admission; prompts of up to
    900 tokens take 100+ executions at a budget of 8) or decode (after 1-100 tokens). It records
    the phase it was in as the client saw it when cancelled."""

    def __init__(self, stub, rid: str, rng: random.Random, by_rpc: bool) -> None:
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(4, 900))]
        self.request = scheduler_pb2.SubmitRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True),
        )
        self.stub, self.rid, self.by_rpc = stub, rid, by_rpc
        self.target = rng.choice(["queued", "prefill", "decode"])
        self.delay = rng.uniform(0.0, 0.05 if self.target == "queued" else 0.03)
        self.after_tokens = rng.randint(1, 100)
        self.phase = "queued"
        self.cancelled_in = ""
        self.finish = None
        self.code = None

    def run(self) -> None:
        call = self.stub.Submit(self.request, timeout=120)
        timers = []

        def cancel_soon() -> None:
            timers.append(threading.Timer(self.delay, self.cancel, args=(call,)))
            timers[-1].start()

        if self.target == "queued":
            cancel_soon()
        tokens = 0
        try:
            for event in call:
                if event.admitted:
                    self.phase = "prefill"
                    if self.target == "prefill":
                        cancel_soon()
                if event.token_ids:
                    self.phase = "decode"
                    tokens += len(event.token_ids)
                    if self.target == "decode" and tokens >= self.after_tokens and not timers:
                        timers.append(None)
                        self.cancel(call)
                if event.finish_reason:
                    self.finish = event.finish_reason
        except grpc.RpcError as err:
            self.code = err.code()
        for timer in timers:
            if timer is not None:
                timer.join()

    def cancel(self, call) -> None:
        if self.finish is not None:
            return  # it finished first
        phase = self.phase
        if self.by_rpc:
            cancel = scheduler_pb2.CancelRequest(request_id=self.rid)
            if not self.stub.Cancel(cancel, timeout=10).found:
                return  # it finished first
        else:
            call.cancel()
        self.cancelled_in = phase


@pytest.mark.slow
def test_hundred_cancellations_at_random_moments_free_all_kv(tmp_path) -> None:
    settings = tiny_settings(
        max_running=3, token_budget=8, kv_capacity=4096, block_size=16, max_queued_requests=100
    )
    rng = random.Random(100)
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        with grpc.insecure_channel(sched, options=CHANNEL_OPTIONS) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            requests = [Cancelled(stub, f"c{i}", rng, by_rpc=i % 2 == 0) for i in range(100)]
            for wave in range(0, 100, 10):  # ten at a time: more than run, so some queue
                threads = [threading.Thread(target=r.run) for r in requests[wave : wave + 10]]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(60)
                assert not any(t.is_alive() for t in threads)
        phases = Counter(r.cancelled_in or "finished first" for r in requests)
        for r in requests:  # every stream ended: cancelled (by Cancel or by going away) or done
            ended = (r.finish, r.code)
            assert ended in (
                (common_pb2.FINISH_REASON_CANCELLED, None),
                (common_pb2.FINISH_REASON_LENGTH, None),
                (None, grpc.StatusCode.CANCELLED),
            ), (r.rid, ended)
        status = wait_idle(sched)

        # the same through the gateway: the client goes away at a random moment
        gone = Counter()
        for i in range(20):
            with grpc.insecure_channel(gw, options=CHANNEL_OPTIONS) as channel:
                call = gateway_pb2_grpc.GatewayStub(channel).Generate(
                    greedy_request(i, 300), timeout=60
                )
                threading.Timer(rng.uniform(0.0, 0.4), call.cancel).start()
                got = 0
                try:
                    for m in call:
                        got += len(m.delta.token_ids)
                    gone["finished first"] += 1
                except grpc.RpcError as err:
                    assert err.code() is grpc.StatusCode.CANCELLED
                    gone["before a token" if got == 0 else "while decoding"] += 1
        status = wait_idle(sched)
        print(f"\n100 cancellations via the scheduler, by phase: {dict(phases)}")
        print(f"20 client disconnects via the gateway: {dict(gone)}")
        assert all(phases[p] >= 5 for p in ("queued", "prefill", "decode")), phases
        assert status.running == 0 and status.waiting == 0
        assert all(w.written == 0 and w.free == w.capacity for w in status.workers)
        stop_cleanly(stack)
