"""Cells down together, and a gateway whose first cell is down, through real processes (the
simulated model, each step a floor of time; loopback): held streams wait for a cell to come back
as a single-scheduler gateway waits for its scheduler, and nothing the gateway reports or needs
at start depends on the first cell it lists."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from llmserve import client
from llmserve.ports import free_port
from tests.stack_checks import generate, greedy_request, wait_for
from tests.stacks import running_stack
from tests.test_cells_stack import routed, two_cells
from tests.test_faults import held_settings, kill9, streaming

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]


def cells_up(gateway: str) -> list[bool]:
    return [c.up for c in client.gateway_status(gateway).cells]


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


def test_with_every_cell_down_held_streams_wait_for_one_to_come_back(tmp_path, monkeypatch) -> None:
    """kill -9 both cells' schedulers under 6 streams: while neither answers, every stream is
    held (none ends); one cell started again takes them all, and they end whole and exact.
    (They failed within a second with "no cell answers", or INTERNAL.) The gateway waits up to
    120 s here, not 30: a slow host's restart must not end them."""
    monkeypatch.setenv("LLMSERVE_GATEWAY_RESUBMIT_TIMEOUT", "120")
    settings = two_cells()
    n, max_tokens = 6, 300
    with running_stack(settings, tmp_path) as stack:
        gw = settings.gateway
        streams, expected = streaming(gw, n, max_tokens)
        kill9(stack, "scheduler")
        kill9(stack, "scheduler1")
        wait_for(lambda: cells_up(gw) == [False, False], 15, "both cells shown down")
        assert [o.ended_at for o in streams.outcomes] == [None] * n, [
            o.details for o in streams.outcomes
        ]
        stack.restart("scheduler")
        outcomes = streams.join(120)
        assert [o.code for o in outcomes] == [None] * n, {o.details for o in outcomes}
        assert [o.tokens for o in outcomes] == expected


def test_a_gateway_whose_first_cell_is_down_serves_reports_and_starts(tmp_path) -> None:
    """Cell 0's scheduler killed: HTTP /health stays 200 and `status` shows cell 0 down while
    cell 1 serves. A new gateway listing a dead address first, then both cells (cell 0 down),
    starts and serves through cell 1. (/health said 503, status failed, and such a gateway
    never served: it waited on its first cell for 180 s, then exited.)"""
    settings = two_cells(http_port=free_port())
    with running_stack(settings, tmp_path) as stack:
        gw = settings.gateway
        kill9(stack, "scheduler")
        wait_for(lambda: cells_up(gw) == [False, True], 15, "cell 0 shown down")
        assert health(f"http://127.0.0.1:{settings.http_port}/health") == 200
        tokens, _ = generate(gw, greedy_request(1, 8))
        assert len(tokens) == 8

        port, dead = free_port(), free_port()
        cells = [f"127.0.0.1:{dead}", settings.cell_scheduler(0), settings.cell_scheduler(1)]
        log = (tmp_path / "gateway2.log").open("w")
        other = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--port", str(port), "--cells", ",".join(cells)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            target = f"127.0.0.1:{port}"

            def serves() -> bool:
                assert other.poll() is None, (tmp_path / "gateway2.log").read_text()
                try:
                    return len(generate(target, greedy_request(2, 8), timeout=5)[0]) == 8
                except Exception:  # not listening yet, or no live cell known yet
                    return False

            started = time.monotonic()
            wait_for(serves, 60, "the second gateway serves", period=0.5)
            print(f"\na gateway whose first two cells are down serves after "
                  f"{time.monotonic() - started:.1f} s")  # fmt: skip
            wait_for(lambda: cells_up(target) == [False, False, True], 15, "its cells' table")
        finally:
            other.terminate()
            other.wait(30)


def test_a_cell_whose_worker_dies_is_routed_around_and_its_streams_move(tmp_path) -> None:
    """Round-robin over two cells of one worker each, 6 streams; kill -9 cell 1's worker and
    leave it down. Its streams move to cell 0 and end whole and exact; new requests go to cell
    0; the cell takes traffic again once its worker is back. (They had waited in cell 1 for the
    worker to come back, then failed UNAVAILABLE "no live worker can hold this request" while
    cell 0 served, and new requests kept going to cell 1 to fail the same way. Here the
    scheduler waits 600 s for a worker: only a move ends them.)"""
    settings = two_cells(router="round-robin", scheduler_flags="--worker-return-timeout 600")
    n, max_tokens = 6, 300
    with running_stack(settings, tmp_path) as stack:
        gw = settings.gateway
        streams, expected = streaming(gw, n, max_tokens)
        kill9(stack, "worker1")
        outcomes = streams.join(120)
        assert [o.code for o in outcomes] == [None] * n, {o.details for o in outcomes}
        assert [o.tokens for o in outcomes] == expected
        assert cells_up(gw) == [True, False]
        cell0 = settings.cell_scheduler(0)
        assert {routed(gw, greedy_request(i, 4))[0] for i in range(4)} == {cell0}
        stack.restart("worker1")
        wait_for(lambda: cells_up(gw) == [True, True], 60, "cell 1 takes traffic again")
        assert len({routed(gw, greedy_request(i, 4))[0] for i in range(4)}) == 2


def test_one_scheduler_listed_under_two_names_is_one_cell(tmp_path) -> None:
    """--cells 127.0.0.1:p,localhost:p: the second address reaches the first's scheduler (its
    Status's instance), so it is routed around for good and every request goes to one cell.
    (It had been a second cell, up, splitting one scheduler's load and cache in the router.)"""
    settings = held_settings(kv_capacity=4096)
    with running_stack(settings, tmp_path):
        port = free_port()
        first = settings.scheduler
        second = "localhost:" + first.split(":")[1]
        log = (tmp_path / "gateway2.log").open("w")
        other = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--port", str(port), "--cells", f"{first},{second}",
             "--router", "round-robin"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            target = f"127.0.0.1:{port}"
            wait_for(lambda: _cells_up(target) == [True, False], 60, "the alias routed around")
            assert {routed(target, greedy_request(i, 4))[0] for i in range(4)} == {first}
            assert "one scheduler at two addresses" in (tmp_path / "gateway2.log").read_text()
        finally:
            other.terminate()
            other.wait(30)


def _cells_up(target: str) -> list[bool] | None:
    try:
        return cells_up(target)
    except Exception:  # not listening yet
        return None


def test_a_cell_whose_worker_drains_finishes_its_streams_there_and_takes_no_new_one(
    tmp_path,
) -> None:
    """SIGTERM cell 1's worker under 6 streams (round-robin): it drains, so its cell has no
    live worker and is routed around, but its streams are not moved: the draining worker
    finishes them, whole and exact, and new requests go to cell 0 meanwhile."""
    settings = two_cells(router="round-robin")
    n, max_tokens = 6, 300
    with running_stack(settings, tmp_path) as stack:
        gw = settings.gateway
        streams, expected = streaming(gw, n, max_tokens)
        stack.procs["worker1"].send_signal(signal.SIGTERM)
        wait_for(lambda: cells_up(gw) == [True, False], 30, "cell 1 routed around")
        cell0 = settings.cell_scheduler(0)
        assert {routed(gw, greedy_request(i, 4))[0] for i in range(4)} == {cell0}
        outcomes = streams.join(120)
        assert [o.code for o in outcomes] == [None] * n, {o.details for o in outcomes}
        assert [o.tokens for o in outcomes] == expected
        assert "resubmitting" not in stack.log("gateway").read_text()
        assert stack.procs["worker1"].wait(60) == 0
