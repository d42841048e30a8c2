"""`llmserve bench serve --target GATEWAY` samples the Status of that gateway's scheduler (asked
through the gateway, as `llmserve status` does), not a fixed 127.0.0.1:50052; an explicit
--status-target still works, and when it cannot be reached the error names it. With the admin
key, `bench serve` and `llmserve status` get the prefix-cache figures through the gateway."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmserve.ports import free_port
from tests.stacks import running_stack, tiny_settings

ROOT = Path(__file__).resolve().parent.parent
LLMSERVE = [sys.executable, "-c", "from llmserve.cli import main; main()"]
KV_CAPACITY = 2032  # unlike any default: the report's KV capacity is this stack's
WORKLOAD = ["--requests", "3", "--concurrency", "1", "--prompt-tokens", "8", "--output-tokens",
            "4", "--baselines", "none", "--no-progress", "--poll", "0.05"]  # fmt: skip


ADMIN_KEY = "admin-key-of-the-test-0123456789"


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("key") / "admin-key"
    path.write_text(ADMIN_KEY + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory, key_file):
    settings = tiny_settings(
        model="sim", kv_capacity=KV_CAPACITY, block_size=16, admin_key_file=str(key_file)
    )
    with running_stack(settings, tmp_path_factory.mktemp("logs")) as s:
        yield s


def bench_serve(out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LLMSERVE, "bench", "serve", *WORKLOAD, "--out", str(out), *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def served_run(out: Path) -> dict:
    (run,) = json.loads((out / "serve.json").read_text())["runs"]
    return run


@pytest.mark.slow
def test_bench_serve_target_samples_that_gateways_scheduler_unless_told_otherwise(
    stack, tmp_path
) -> None:
    done = bench_serve(tmp_path / "default", "--target", stack.settings.gateway)
    assert done.returncode == 0, done.stderr
    assert "50052" not in done.stderr + done.stdout
    run = served_run(tmp_path / "default")
    assert run["ok"] == run["requests"] == 3
    assert run["kv"]["capacity"] == KV_CAPACITY and run["kv"]["samples"] >= 2
    # through the gateway, without the operator's key, the cache figures are withheld: the
    # report falls back on the clients' counts, not a hit rate of 0 from withheld zeros
    assert run["prefix"]["source"] == "clients" and run["prefix"]["hit_tokens"] is None

    flags = ["--target", stack.settings.gateway, "--status-target", stack.settings.scheduler]
    done = bench_serve(tmp_path / "explicit", *flags)
    assert done.returncode == 0, done.stderr
    run = served_run(tmp_path / "explicit")
    assert run["kv"]["capacity"] == KV_CAPACITY
    assert run["prefix"]["source"] == "scheduler"  # the scheduler's own figures


@pytest.mark.slow
def test_an_unreachable_status_target_is_one_line_naming_the_flag(stack, tmp_path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    done = bench_serve(tmp_path, "--target", stack.settings.gateway, "--status-target", dead)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "--status-target" in line and dead in line, line
    # the gateway's address given as the scheduler's: what to do instead
    flags = ["--status-target", stack.settings.gateway]
    done = bench_serve(tmp_path, "--target", stack.settings.gateway, *flags)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "UNIMPLEMENTED" in line and "--status-target takes the scheduler's" in line, line


@pytest.mark.slow
def test_the_admin_key_brings_the_cache_figures_through_the_gateway(
    stack, key_file, tmp_path
) -> None:
    """bench serve --target with --admin-key-file (no --status-target), and llmserve status
    --admin-key-file (no --explain): the key goes with the Status call."""
    flags = ["--target", stack.settings.gateway, "--admin-key-file", str(key_file)]
    done = bench_serve(tmp_path, *flags)
    assert done.returncode == 0, done.stderr
    assert served_run(tmp_path)["prefix"]["source"] == "scheduler"
    status = subprocess.run(
        [*LLMSERVE, "status", "--json", *flags], cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    s = json.loads(status.stdout)
    assert not s["cache_figures_withheld"] and s["prompt_tokens"] > 0, s
    assert "hit_tokens" in s["workers"][0]
