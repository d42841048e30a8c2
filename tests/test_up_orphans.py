"""`llmserve up` killed with SIGKILL (no chance to stop its children) leaves no service behind:
each child asked the kernel for SIGTERM on its parent's death when it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack_checks import wait_for
from tests.stacks import tiny_settings

ROOT = Path(__file__).resolve().parent.parent


def children_of(pid: int) -> list[int]:
    """Direct children of a process, from /proc (Linux)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid:  # field 4 of stat: the parent pid
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait() is missing


def start_up(s, log_dir: Path, *extra: str) -> subprocess.Popen:
    """`llmserve up` of the tiny model on `s`'s ports, through the console script as a user
    runs it; its output (stderr too) on its stdout, as text."""
    cli = Path(sys.executable).parent / "llmserve"
    command = [str(cli), "up", "--model", "tiny", "--dtype", "fp32", *extra]
    command += ["--gateway-port", str(s.gateway_port), "--scheduler-port", str(s.scheduler_port)]
    command += ["--worker-base-port", str(s.worker_base_port), "--threads", "1"]
    command += ["--log-dir", str(log_dir)]
    return subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_services_exit_when_llmserve_up_is_killed(tmp_path) -> None:
    up = start_up(tiny_settings(), tmp_path)
    services: list[int] = []
    try:
        assert up.stdout is not None
        for line in up.stdout:  # the stack is up once it says how to stop it
            if "Ctrl-C stops everything" in line:
                break
        else:
            pytest.fail(f"llmserve up exited early with {up.wait()}")
        services += children_of(up.pid)
        assert len(services) == 3, services  # gateway, scheduler, worker0
        os.kill(up.pid, signal.SIGKILL)
        assert up.wait(10) == -signal.SIGKILL
        wait_for(lambda: not any(alive(p) for p in services), 20, "every service exited")
    finally:
        if up.poll() is None:
            up.kill()
        for pid in services:  # on failure, leave nothing running
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
