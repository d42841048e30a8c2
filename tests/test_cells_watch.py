"""The gateway's watch over its cells (gateway/cells.py): no cell's check waits for another's, so
a hung cell (whose checks take the whole check timeout) does not slow the checks of the others."""

import asyncio
from types import SimpleNamespace

import grpc

from gateway import cells as cells_mod
from gateway.cells import Cells
from gateway.routing import RouterSettings

LIVE, HUNG = "127.0.0.1:1", "127.0.0.1:2"


class _Stub:
    def __init__(self) -> None:
        self.asked = 0

    async def Status(self, request, timeout=None, metadata=()):  # noqa: N802 (a stub's name)
        self.asked += 1
        return SimpleNamespace(waiting_tokens=0)


def _silent(timeout: float) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), "silent"
    )


def test_a_hung_cell_does_not_hold_up_the_checks_of_the_others(monkeypatch) -> None:
    asyncio.run(_hung_beside_live(monkeypatch))


async def _hung_beside_live(monkeypatch) -> None:
    hung_checks = []
    hung_channel = None

    async def check_health(channel, service="", timeout=1.0):
        if channel is hung_channel:  # answers nothing until the check's timeout
            hung_checks.append(timeout)
            await asyncio.sleep(timeout)
            raise _silent(timeout)
        return 1

    monkeypatch.setattr(cells_mod, "check_health", check_health)
    monkeypatch.setattr(cells_mod, "WATCH_PERIOD_S", 0.01)
    monkeypatch.setattr(cells_mod, "CHECK_TIMEOUT_S", 60.0)  # one hung check outlasts the test
    cells = Cells(f"{HUNG},{LIVE}", RouterSettings(), grpc.aio.insecure_channel, sessions=False)
    hung_channel = cells.cells[HUNG].channel
    live = cells.cells[LIVE].stub = _Stub()
    cells.cells[HUNG].stub = _Stub()
    watcher = asyncio.create_task(cells.watch())
    try:
        async with asyncio.timeout(30):
            while live.asked < 5:
                await asyncio.sleep(0.01)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    # the live cell was checked 5 times while the hung cell's first check was still unanswered,
    # and the hung cell had one check in flight, not one per period
    assert live.asked >= 5
    assert hung_checks == [60.0]
    assert cells.router.alive(LIVE)


def test_a_failing_check_does_not_end_the_watch(monkeypatch) -> None:
    asyncio.run(_failing_check(monkeypatch))


async def _failing_check(monkeypatch) -> None:
    calls = {"n": 0}

    async def check_health(channel, service="", timeout=1.0):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug in one check")
        return 1

    monkeypatch.setattr(cells_mod, "check_health", check_health)
    monkeypatch.setattr(cells_mod, "WATCH_PERIOD_S", 0.01)
    cells = Cells(LIVE, RouterSettings(), grpc.aio.insecure_channel, sessions=False)
    stub = cells.cells[LIVE].stub = _Stub()
    watcher = asyncio.create_task(cells.watch())
    try:
        async with asyncio.timeout(30):
            while stub.asked < 2:
                await asyncio.sleep(0.01)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    assert calls["n"] >= 3
