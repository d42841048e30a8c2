"""`llmserve up` with a bad configuration stops with one line saying what is wrong: a count
that starts nothing is refused before anything starts (not waited on for minutes), and a
service that exits at its start is named with its reason, without a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmserve.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
LLMSERVE = [sys.executable, "-c", "from llmserve.cli import main; main()"]


def up(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    gateway, scheduler, worker = free_ports(3)
    command = [*LLMSERVE, "up", "--model", "sim", "--log-dir", str(tmp_path)]
    command += ["--gateway-port", str(gateway), "--scheduler-port", str(scheduler)]
    command += ["--worker-base-port", str(worker), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)


def last_line(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("flag", ["--cells", "--workers"])
@pytest.mark.parametrize("count", ["0", "-1"])
def test_a_count_below_one_is_refused_before_anything_starts(flag, count, tmp_path) -> None:
    done = up(tmp_path, flag, count)
    assert done.returncode == 2
    assert f"{flag} must be >= 1" in last_line(done)
    assert "starting" not in done.stdout and not list(tmp_path.iterdir())


def test_a_setting_the_core_refuses_is_one_line(tmp_path) -> None:
    done = up(tmp_path, "--token-budget", "0")
    assert done.returncode == 2
    assert "token_budget must be 1 to" in last_line(done)


@pytest.mark.slow
def test_a_service_that_exits_at_its_start_is_named_with_its_reason(tmp_path) -> None:
    missing = str(tmp_path / "no-such-token")
    done = up(tmp_path / "logs", "--workers", "1", "--internal-token-file", missing)
    assert done.returncode == 1
    line = last_line(done)
    assert "exited with 1" in line and f"cannot read the internal token file {missing}" in line
