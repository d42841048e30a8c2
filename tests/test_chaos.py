"""Chaos: under steady load, random workers and the scheduler are SIGKILLed, SIGSTOPped and
SIGCONTed (the scheduler for longer than its hang floor), and SIGTERMed, then restarted (never
all workers at once). Every accepted request
must end with its full output, identical to an undisturbed fp32 run (no gap, no duplicate), or
with an explicit error; a request that has streamed tokens never fails (whatever breaks, it is
recomputed or resubmitted); KV returns to 0."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter

import grpc
import pytest

from llmcommon.v1 import common_pb2
from llmserve import client
from tests.stack_checks import greedy_request, stop_cleanly, wait_idle
from tests.stacks import running_stack, tiny_settings
from tests.test_faults import baseline

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("hang_guard"),
    pytest.mark.hang_seconds(600),
]

WORKERS, PROMPTS, MAX_TOKENS, CLIENTS = 3, 12, 48, 6
LENGTH = common_pb2.FINISH_REASON_LENGTH
ROUNDS = 2  # every kind of fault this many times, in a random order
SEED = 12


class Load:
    """CLIENTS threads, each streaming one request after another until told to stop."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.stop = threading.Event()
        self.results: list[tuple[int, list[int], object, grpc.StatusCode | None, str]] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(c,)) for c in range(CLIENTS)]
        for t in self.threads:
            t.start()

    def run(self, c: int) -> None:
        n = c
        while not self.stop.is_set():
            i, tokens, final, code, details = n % PROMPTS, [], None, None, ""
            try:
                for m in client.stream(self.target, greedy_request(i, MAX_TOKENS), timeout=120):
                    if m.HasField("final"):
                        final = m.final
                    else:
                        tokens.extend(m.delta.token_ids)
            except grpc.RpcError as err:
                code, details = err.code(), err.details() or ""
                time.sleep(0.2)  # a client backs off after an error
            with self.lock:
                self.results.append((i, tokens, final, code, details))
            n += CLIENTS

    def join(self, timeout: float) -> None:
        self.stop.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a client stream hangs"


KINDS = ["kill", "stop", "term", "kill-scheduler", "term-scheduler", "stop-scheduler"]
SCHEDULER_STOP_S = (3.0, 8.0)  # beyond its --hang-floor 2: every answer is late by the wall


def disturb(stack, rng: random.Random, kind: str) -> str:
    """One fault, and the repair that follows it; returns what was done."""
    worker = f"worker{rng.randrange(WORKERS)}"
    name = "scheduler" if kind.endswith("scheduler") else worker
    proc = stack.procs[name]
    if kind.startswith("kill"):
        proc.kill()
        proc.wait(10)
        time.sleep(rng.uniform(0.2, 1.5))
        stack.restart(name)
    elif kind.startswith("term"):
        proc.send_signal(signal.SIGTERM)
        proc.wait(90)
        stack.restart(name)
    else:
        proc.send_signal(signal.SIGSTOP)
        time.sleep(rng.uniform(*SCHEDULER_STOP_S) if name == "scheduler" else rng.uniform(1.0, 4.0))
        proc.send_signal(signal.SIGCONT)
    return f"{kind} {name if name == worker else ''}".strip()


def test_chaos_every_request_ends_whole_or_with_an_error_and_kv_returns_to_zero(tmp_path) -> None:
    settings = tiny_settings(
        workers=WORKERS, kv_capacity=4096, token_budget=64,
        scheduler_flags="--hang-floor 2",
    )  # fmt: skip
    rng = random.Random(SEED)
    with running_stack(settings, tmp_path) as stack:
        gw, sched = settings.gateway, settings.scheduler
        expected = baseline(gw, PROMPTS, MAX_TOKENS)
        load = Load(gw)
        faults: Counter[str] = Counter()
        kinds = KINDS * ROUNDS
        rng.shuffle(kinds)
        started = time.monotonic()
        try:
            for kind in kinds:
                time.sleep(rng.uniform(1.0, 3.0))
                faults[disturb(stack, rng, kind)] += 1
        finally:
            for proc in stack.procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
            load.join(150)
        codes: Counter[str] = Counter()
        why: Counter[str] = Counter()
        for i, tokens, final, code, details in load.results:
            if code is None:
                assert tokens == expected[i], f"prompt {i}: not the undisturbed run's output"
                assert final is not None and final.finish_reason == LENGTH
                codes["complete"] += 1
            else:
                assert tokens == expected[i][: len(tokens)], (
                    f"prompt {i}: {code} after wrong tokens"
                )
                assert details, f"prompt {i}: {code} without a message"
                assert not tokens, f"prompt {i}: {code} after {len(tokens)} tokens: {details}"
                codes[code.name] += 1
                why[details[:70]] += 1
        wait_idle(sched, timeout=60)  # every request ended and its KV is free
        total = len(load.results)
        took = time.monotonic() - started
        print(f"\nchaos {took:.0f} s: {sum(faults.values())} faults {dict(faults)}; "
              f"{total} requests: {dict(codes)}; errors: {dict(why)}")  # fmt: skip
        assert codes["complete"] >= total * 0.5
        stop_cleanly(stack)
