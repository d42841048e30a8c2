"""`llmserve up` keeps its stack up: a service that exits is started again (a killed worker's
requests meanwhile recomputed on the other, docs/reliability.md); a crash loop stops the
stack. It used to stop every service at the first exit, cutting the streams the other worker
was serving."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from llmserve import client
from llmserve.stack import Stack
from tests.stack_checks import wait_for
from tests.stacks import tiny_settings
from tests.test_up_orphans import alive, children_of, start_up

ROOT = Path(__file__).resolve().parent.parent


class Proc:
    """A Popen that has exited with `code` (None: runs)."""

    def __init__(self, code: int | None = None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


class Watched(Stack):
    """A stack whose services are `Proc`s: launch records the restart and starts a live one,
    unless `crash` says it dies again at once."""

    def __init__(self, crash: set[str] = frozenset()) -> None:
        super().__init__(tiny_settings(), Path("/nonexistent"))
        self.crash, self.launched = crash, []
        self.procs = {"worker0": Proc(-9), "worker1": Proc(), "gateway": Proc()}

    def launch(self, name: str, append: bool = False) -> Proc:
        assert append  # the log of the run before is kept
        self.launched.append(name)
        self.procs[name] = Proc(1 if name in self.crash else None)
        return self.procs[name]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0  # each look at a service one second later
        return self.now


def test_an_exited_service_is_started_again_and_a_crash_loop_ends_the_watch() -> None:
    said: list[str] = []
    stack = Watched(crash={"worker0"})
    why = stack.supervise(restarts=3, window=60, poll=0, clock=Clock(), say=said.append)
    assert stack.launched == ["worker0"] * 3  # the fourth exit within a minute: it gives up
    assert why == "worker0 exited with 1, 4 times in 60 s"
    assert said[0].startswith("worker0 exited with -9; starting it again (see ")
    assert [s.split(";")[0] for s in said[1:]] == ["worker0 exited with 1"] * 2


class Enough(Exception):
    pass


def test_exits_further_apart_than_the_window_are_restarted_every_time() -> None:
    stack = Watched(crash={"worker0"})
    launch = stack.launch

    def counted(name: str, append: bool = False) -> Proc:
        if len(stack.launched) == 6:
            raise Enough
        return launch(name, append)

    stack.launch = counted  # type: ignore[method-assign]
    ticks = iter(range(0, 10_000, 61))  # each exit 61 s after the one before
    with pytest.raises(Enough):
        stack.supervise(1, 60, 0, lambda: float(next(ticks)), lambda _: None)
    assert stack.launched == ["worker0"] * 6
    stack = Watched(crash={"worker0"})
    ticks = iter(range(0, 10_000, 30))  # 30 s apart: the second exit within a minute
    why = stack.supervise(1, 60, 0, lambda: float(next(ticks)), lambda _: None)
    assert (why, stack.launched) == ("worker0 exited with 1, 2 times in 60 s", ["worker0"])


def test_no_restarts_ends_the_watch_at_the_first_exit() -> None:
    stack = Watched()
    why = stack.supervise(restarts=0, poll=0, clock=Clock(), say=lambda _: None)
    assert (why, stack.launched) == ("worker0 exited with -9", [])


def worker_pid(services: list[int], name: str) -> int:
    for pid in services:
        try:
            args = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker_svc" in args and name.encode() in args:
            return pid
    raise LookupError(name)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_killed_worker_is_started_again_and_the_stack_serves_on(tmp_path) -> None:
    """Two workers; four long streams; worker1 killed with SIGKILL: every stream ends whole
    (those on worker1 recomputed on worker0), `up` says it starts worker1 again, the new
    worker1 runs, and the stack still serves; Ctrl-C then stops it all."""
    s = tiny_settings(workers=2)
    up = start_up(s, tmp_path, "--workers", "2")
    lines: list[str] = []
    services: list[int] = []
    try:
        assert up.stdout is not None
        for line in up.stdout:
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        else:
            pytest.fail(f"llmserve up exited early with {up.wait()}: {''.join(lines)}")
        reader = threading.Thread(target=lambda: lines.extend(up.stdout), daemon=True)
        reader.start()
        services += children_of(up.pid)
        request = client.make_request(prompt="Once upon", max_tokens=400, ignore_eos=True)
        counts: list[int] = []

        def one() -> None:
            replies = list(client.stream(s.gateway, request, timeout=300))
            counts.append(sum(len(r.delta.token_ids) for r in replies if r.HasField("delta")))

        streams = [threading.Thread(target=one) for _ in range(4)]
        for thread in streams:
            thread.start()
        first = worker_pid(services, "worker1")
        wait_for(lambda: (tmp_path / "worker1.log").stat().st_size > 0, 30, "worker1 up")
        os.kill(first, signal.SIGKILL)
        for thread in streams:
            thread.join(300)
        assert counts == [400] * 4
        wait_for(
            lambda: any("worker1 exited with -9; starting it again" in x for x in lines),
            30,
            "up restarts worker1",
        )
        wait_for(lambda: worker_pid(children_of(up.pid), "worker1") != first, 30, "a new worker1")
        services += children_of(up.pid)
        assert up.poll() is None
        short = client.make_request(prompt="Hello", max_tokens=5, ignore_eos=True)
        replies = list(client.stream(s.gateway, short, timeout=60))
        assert sum(len(r.delta.token_ids) for r in replies if r.HasField("delta")) == 5
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        reader.join(10)
        assert any(x.startswith("stopped: ") for x in lines), lines
    finally:
        if up.poll() is None:
            up.kill()
        for pid in services:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
