"""The cells a gateway routes to: one connection (and Session stream) per cell's scheduler, the
router (gateway/routing/) that picks one per request, and each cell's health and load, asked
every WATCH_PERIOD_S: a cell whose connection is closed (dead), or that has answered no check for
--scheduler-timeout (hung), is routed around until it answers again, when it is taken to have
restarted with an empty cache; a hung cell's held requests are moved to other cells at once.

--cells lists host:port addresses; a name that resolves to several addresses (a headless
Service) is one cell per address, resolved again at every check, so that cells that join take
traffic and cells that leave are dropped."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from gateway.routing import Route, Router, RouterSettings, prompt_keys
from gateway.scheduler_session import SchedulerSession, SessionCall
from gateway.scheduler_watch import SilenceBound, Verdict
from llmcommon.health import check_health
from llmcommon.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("gateway")
WATCH_PERIOD_S = 1.0
CHECK_TIMEOUT_S = 2.0


@dataclass(slots=True)
class Cell:
    address: str
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    session: SchedulerSession | None
    routed: dict[str, int] = field(default_factory=dict)  # reason -> routes
    silence: SilenceBound | None = None  # how long it has answered no health check
    instance: str = ""  # its scheduler's, from its last Status


def cell_addresses(text: str) -> list[str]:
    """--cells: host:port entries, each name resolved to its addresses (one cell each)."""
    out: list[str] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        host, _, port = entry.rpartition(":")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (socket.gaierror, ValueError):
            out.append(entry)  # (not resolvable now: tried, and routed around, as a dead cell)
            continue
        found = sorted({f"{info[4][0]}:{port}" for info in infos if info[0] == socket.AF_INET})
        out += found if len(found) > 1 else [entry]
    return list(dict.fromkeys(out))


class Cells:
    def __init__(
        self,
        spec: str,
        settings: RouterSettings,
        channel_of,
        sessions: bool,
        hung_after: float = 5.0,
    ) -> None:
        """`channel_of(address)`: the gRPC channel to a scheduler (with the internal token).
        A cell silent for `hung_after` seconds (its connection open) is hung: routed around,
        and `on_hung(address)` moves the requests it holds. A cell whose scheduler answers with
        no live worker (`workerless`) is routed around while another cell has one, and, with
        none running at all, has its requests moved the same way."""
        self.spec, self.channel_of, self.sessions = spec, channel_of, sessions
        self.hung_after = hung_after
        self.on_hung: Callable[[str], None] | None = None
        self.workerless: set[str] = set()  # answering, no live worker: taken only as a last resort
        self.aliases: set[str] = set()  # another cell's scheduler at another address: never taken
        self.cells: dict[str, Cell] = {}
        self.router = Router([], settings)
        for address in cell_addresses(spec):
            self._join(address)

    def __len__(self) -> int:
        return len(self.cells)

    def first(self) -> Cell:
        return next(iter(self.cells.values()))

    async def Status(self, request, timeout=None, metadata=()):  # noqa: N802 (a stub's name)
        """A scheduler's Status for what the gateway asks of its scheduler (start-up, HTTP
        /health, `status`, the workers followed): the first cell in the router's live ones
        that answers with a worker, else the first that answers, else the first cell's error.
        With the cells as a SchedulerStub's Status, none of that depends on one cell."""
        order = sorted(self.cells.values(), key=lambda c: not self.router.alive(c.address))
        fallback, first_err = None, None
        for cell in order:
            try:
                reply = await cell.stub.Status(request, timeout=timeout, metadata=metadata)
            except grpc.aio.AioRpcError as err:
                first_err = first_err or err
                continue
            if reply.max_context > 0:
                return reply
            fallback = fallback or reply
        if fallback is not None:
            return fallback
        assert first_err is not None
        raise first_err

    async def refusals(self) -> list[str]:
        """The cells that refuse this gateway's internal token now, each with its message."""

        async def refused(cell: Cell) -> str | None:
            try:
                await cell.stub.Status(scheduler_pb2.StatusRequest(), timeout=CHECK_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:
                if err.code() is grpc.StatusCode.UNAUTHENTICATED:
                    return f"cell {cell.address}: {err.details()}"
            return None

        found = await asyncio.gather(*(refused(c) for c in self.cells.values()))
        return [r for r in found if r is not None]

    def keys_of(self, prompt_ids: list[int], salt: bytes) -> list[int]:
        s = self.router.settings
        return prompt_keys(prompt_ids, s.block_size, salt, s.max_prompt_blocks)

    def place(
        self,
        submit: scheduler_pb2.SubmitRequest,
        keys: list[int],
        session: str,
        timeout: float | None,
        exclude: frozenset[str] = frozenset(),
    ) -> tuple[grpc.aio.UnaryStreamCall | SessionCall, Route] | None:
        """The request sent to the cell the router picks (None: no live cell but `exclude`)."""
        prompt = len(submit.prompt_token_ids) + len(submit.resume_token_ids)
        output = max(1, submit.sampling.max_tokens - len(submit.resume_token_ids))
        route = self.router.route(keys, prompt, output, session, exclude)
        if route is None:  # every cell with a live worker is down: one whose may come back
            route = self._last_resort(keys, prompt, output, session, exclude)
        if route is None:
            return None
        cell = self.cells[route.cell]
        cell.routed[route.reason.value] = cell.routed.get(route.reason.value, 0) + 1
        if cell.session is not None:
            return cell.session.submit(submit, timeout), route
        return cell.stub.Submit(submit, timeout=timeout), route

    def _last_resort(self, keys, prompt, output, session, exclude) -> Route | None:
        """A route among the workerless cells (their schedulers wait for a worker to come
        back, as a single scheduler's requests do), when no other cell is live."""
        spare = [a for a in self.workerless - exclude if a in self.cells]
        for address in spare:
            self.router.set_alive(address, True)
        try:
            return self.router.route(keys, prompt, output, session, exclude) if spare else None
        finally:
            for address in spare:
                self.router.set_alive(address, False)

    def lost(self, route: Route) -> None:
        """The cell of `route` broke a request's stream: routed around until it answers."""
        self.router.done(route)
        if route.cell in self.cells and self.router.alive(route.cell):
            log.warning("cell %s lost: routed around until it answers", route.cell)
            self.router.set_alive(route.cell, False)

    async def statuses(self) -> list[scheduler_pb2.CellStatus]:
        """Every cell as this gateway sees it, with its scheduler's own figures (`status`
        across cells)."""
        return list(await asyncio.gather(*(self._status(c) for c in self.cells.values())))

    async def _status(self, cell: Cell) -> scheduler_pb2.CellStatus:
        up = self.router.alive(cell.address)
        out = scheduler_pb2.CellStatus(
            address=cell.address, up=up, load=self.router.load(cell.address), routed=cell.routed
        )
        if up or cell.address in self.workerless:
            try:
                reply = await cell.stub.Status(
                    scheduler_pb2.StatusRequest(), timeout=CHECK_TIMEOUT_S
                )
            except grpc.aio.AioRpcError:
                return out
            out.waiting, out.running = reply.waiting, reply.running
            out.prompt_tokens, out.hit_tokens = reply.prompt_tokens, reply.hit_tokens
        return out

    async def watch(self, on_change=None) -> None:
        """Every WATCH_PERIOD_S: each cell's health and load; cells that joined or left. Each
        cell has at most one check in flight, and no cell's check waits for another's: a hung
        cell's check takes CHECK_TIMEOUT_S while the others are checked every period."""
        checks: dict[str, asyncio.Task] = {}
        try:
            while True:
                await asyncio.sleep(WATCH_PERIOD_S)
                for cell in list(self.cells.values()):
                    running = checks.get(cell.address)
                    if running is None or running.done():
                        checks[cell.address] = asyncio.create_task(self._checked(cell))
                self._resolve()
                if on_change is not None:
                    on_change()
        finally:
            for task in checks.values():
                task.cancel()

    async def _checked(self, cell: Cell) -> None:
        try:
            await self._check(cell)
        except Exception:  # (a check's own failure must not end the watch of the others)
            log.exception("checking cell %s", cell.address)

    async def _check(self, cell: Cell) -> None:
        asked = cell.silence.clock()  # type: ignore[union-attr]  # silence counts from the ask
        try:
            await check_health(cell.channel, timeout=CHECK_TIMEOUT_S)
            status = await cell.stub.Status(scheduler_pb2.StatusRequest(), timeout=CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            silent = err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            verdict = cell.silence.observe(silent, asked)  # type: ignore[union-attr]
            hung = verdict is not Verdict.ANSWERS
            if self.router.alive(cell.address) and (hung or not silent):
                if err.code() is grpc.StatusCode.UNAUTHENTICATED:
                    log.error("cell %s refuses this gateway: %s: routed around", cell.address,
                              err.details())  # fmt: skip
                else:
                    why = "answers nothing (hung?)" if hung else "is down"
                    log.warning("cell %s %s: routed around", cell.address, why)
                self.router.set_alive(cell.address, False)
                if hung and self.on_hung is not None:
                    self.on_hung(cell.address)
            return
        cell.silence.observe(False)  # type: ignore[union-attr]
        if self._alias(cell, status.instance) or self._without_workers(cell.address, status):
            return
        if not self.router.alive(cell.address):
            log.info(
                "cell %s answers again: it takes traffic (its cache taken as empty)", cell.address
            )
            self.router.restarted(cell.address)
            self.router.set_alive(cell.address, True)
        # the prompt tokens waiting there: beyond this gateway's own, other gateways' requests
        self.router.report_load(cell.address, float(status.waiting_tokens))

    def _alias(self, cell: Cell, instance: str) -> bool:
        """True if `cell` is a scheduler another cell already reaches (another spelling of its
        address, a name beside its IP): routed around for good, so that the router does not
        split one scheduler's load and cache over two cells."""
        cell.instance = instance
        twin = next(
            (c for c in self.cells.values() if c is not cell and instance and c.instance == instance
             and c.address not in self.aliases),
            None,
        )  # fmt: skip
        if twin is None:
            if cell.address in self.aliases:  # (its address now reaches another scheduler)
                self.aliases.discard(cell.address)
                log.info("cell %s is a scheduler of its own now", cell.address)
            return False
        if cell.address not in self.aliases:
            self.aliases.add(cell.address)
            log.warning("cell %s is the scheduler of cell %s (one scheduler at two addresses): "
                        "routed around", cell.address, twin.address)  # fmt: skip
        self.router.set_alive(cell.address, False)
        return True

    def _without_workers(self, address: str, status: scheduler_pb2.StatusReply) -> bool:
        """The cell answers: True if it has no live worker now (routed around; with none
        running at all and another cell live, its requests move there: a worker gone past the
        scheduler's return wait had failed them, UNAVAILABLE, while other cells served)."""
        takes = any(w.healthy and not w.draining for w in status.workers)
        if takes:
            if address in self.workerless:
                self.workerless.discard(address)
                log.info("cell %s has a live worker again: it takes traffic", address)
                self.router.restarted(address)  # (the workers' caches went with them)
                self.router.set_alive(address, True)
            return False
        if address not in self.workerless:
            self.workerless.add(address)
            log.warning("cell %s has no live worker: routed around", address)
            self.router.set_alive(address, False)
        others = self.router.alive_mask & ~(1 << self.router.slots[address])
        if others and not any(w.healthy for w in status.workers) and self.on_hung is not None:
            self.on_hung(address)
        return True

    def _resolve(self) -> None:
        if not any(c.isalpha() for c in self.spec.replace("localhost", "")):
            return  # addresses only: nothing to resolve
        now = set(cell_addresses(self.spec))
        for address in now - set(self.cells):
            log.info("cell %s joined", address)
            self._join(address)
        for address in set(self.cells) - now:
            log.info("cell %s left", address)
            self.workerless.discard(address)
            self.router.set_alive(address, False)

    def _join(self, address: str) -> None:
        channel = self.channel_of(address)
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        session = SchedulerSession(stub) if self.sessions else None
        silence = SilenceBound(self.hung_after, self.hung_after)
        self.cells[address] = Cell(address, channel, stub, session, silence=silence)
        self.router.add_cell(address)
