"""The worker set under supervision: workers join (listed in --workers, registered, or found by
dns: discovery), fail, come back and leave; each live one has a step loop.

The supervisor is handed its collaborators: the core, the settings, the scheduler's running
clock, the step loops (a list it keeps, the service wakes them), a factory of loops, where the
core's outputs go and whom to tell of a join. It never sees the service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable

import grpc

from scheduler_svc.core import Scheduler
from scheduler_svc.run_clock import RunClock
from scheduler_svc.sequence import SeqStatus
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.worker_client import BadWorker, WorkerClient, join_problem
from scheduler_svc.worker_loop import WorkerLoop

log = logging.getLogger("scheduler")
FORGET_AFTER_S = 30.0  # a registered worker unreachable this long leaves the stack

NewLoop = Callable[[int, WorkerClient], WorkerLoop]  # a step loop for worker `index`


class TokenMismatch(Exception):
    """A worker refused the scheduler's internal token."""


class Supervisor:
    def __init__(
        self,
        core: Scheduler,
        settings: SchedulerSettings,
        clock: RunClock,
        loops: list[WorkerLoop | None],
        new_loop: NewLoop,
        dispatch: Callable[[list], None],
        joined: Callable[[str], None],
        token: str = "",
        absent: list[WorkerClient] | None = None,
    ) -> None:
        self.core = core
        self.settings = settings
        self.clock = clock  # the scheduler's own running time: how long a worker was silent
        self.loops = loops  # one per worker index; None until it runs
        self.new_loop = new_loop
        self.dispatch = dispatch  # the core's outputs to the request streams
        self.joined = joined  # (worker name) when a worker joins
        self.token = token  # the internal token, sent to the workers that join
        self.clients: list[WorkerClient] = []
        self.absent = list(absent or [])  # in --workers, not answering yet: see join_absent
        self.eos_ids: frozenset[int] = frozenset()
        self.started = False
        self.refused_addresses: set[str] = set()  # workers that described what no one can use

    def join(self, client: WorkerClient) -> int:
        """A described worker joins the stack and gets admissions from its first step."""
        index = self.core.add_worker(client.spec())
        self.clients.append(client)
        self.loops.append(None)
        if not self.eos_ids and client.info is not None:
            self.eos_ids = frozenset(client.info.eos_token_ids)
        self.joined(client.spec().name)
        if self.started:
            self.start_loop(index)
        return index

    def start(self) -> None:
        """Every live worker's step loop runs; a worker that joins from now on gets its own."""
        self.started = True
        for index, ws in enumerate(self.core.workers):
            if ws.healthy:
                self.start_loop(index)

    def start_loop(self, index: int) -> None:
        loop = self.loops[index] = self.new_loop(index, self.clients[index])
        loop.start()
        self.wake_all()

    def wake_all(self) -> None:
        for loop in self.loops:
            if loop is not None:
                loop.wake.set()

    def worker_lost(self, index: int, err: BaseException) -> None:
        """Its stream ended. Holding nothing, a drained worker, or one that joined by itself,
        has left (it is welcome back); otherwise it failed: its requests are recomputed
        elsewhere, and a fixed --workers address stays listed, unhealthy, until it returns."""
        ws = self.core.workers[index]
        if not any(s.status is SeqStatus.RUNNING for s in ws.running) and (
            ws.draining or not self.clients[index].static
        ):
            log.info("worker %s has left (%s)", ws.spec.name, err)
            self.core.remove_worker(index)
        else:
            log.error("worker %s failed: %s; re-queueing its requests", ws.spec.name, err)
            self.core.fail_worker(index)
        self.clients[index].unreachable_since = time.monotonic()
        self.workers_changed()

    def workers_changed(self) -> None:
        """The live workers changed: what none of them can hold fails now (no loop may be left
        to notice); the rest may have a new place."""
        self.dispatch(self.core.fail_unplaceable())
        self.wake_all()

    def vocab_size(self) -> int:
        """Token ids must be below every live worker's vocabulary (0 = none has said)."""
        workers = zip(self.clients, self.core.workers, strict=True)
        sizes = [
            c.info.vocab_size for c, ws in workers if not ws.gone and c.info and c.info.vocab_size
        ]
        return min(sizes, default=0)

    # ---- watching: health, absent workers, dns names ---------------------------------------

    async def watch_workers(self, period: float = 0.25) -> None:
        """Drain a worker whose health turns NOT_SERVING (it is stopping); bring a failed or
        departed worker back once it answers Describe again (a replacement may bring another
        pool); forget a registered one that stays away."""
        while True:
            await asyncio.sleep(period)
            watched = (self.watch(i) for i in range(len(self.core.workers)))
            await asyncio.gather(*watched, *map(self.join_absent, list(self.absent)))
            if self.core.waiting and any(not (w.healthy or w.gone) for w in self.core.workers):
                self.dispatch(self.core.fail_unplaceable())  # waited long enough for them

    async def join_absent(self, client: WorkerClient) -> None:
        """A worker of --workers that did not answer at the start joins once it does."""
        try:
            await client.describe(timeout=1.0)
        except grpc.aio.AioRpcError:
            return
        self.absent.remove(client)
        problem = self.settings.capacity_problem(client.info.capacity_positions)
        if not problem and (joining := self.join_problem(client)):
            problem = f"describes {joining}"
        if problem or any(c.target == client.target for c in self.clients):
            log.error("worker %s %s: it stays out", client.target, problem or "joined already")
            await client.close()
            return
        log.info("worker %s joined: %s", client.target, str(client.info).replace("\n", " "))
        self.join(client)

    async def watch(self, index: int) -> None:
        """One worker's health: a live one that says NOT_SERVING drains; one that does not
        answer for longer than its hang bound is failed (a hung process keeps its stream open);
        a failed or departed one is brought back when it answers again."""
        ws, client = self.core.workers[index], self.clients[index]
        if not ws.healthy:
            if not ws.gone or client.static:  # a registered worker comes back by registering
                await self.try_restore(index)
            return
        serving = await client.serving()
        now = self.clock.now()  # silence counts only while the scheduler itself runs
        if serving is None:
            client.silent_since = client.silent_since or now
            loop = self.loops[index]
            if loop is not None and now - client.silent_since > loop.hang_bound():
                loop.fail(f"no answer to health checks for {now - client.silent_since:.1f} s")
            return
        client.silent_since = None
        if serving is False and not ws.draining:
            log.info("worker %s is stopping: draining it", ws.spec.name)
            self.core.drain_worker(index)
            self.workers_changed()

    async def discover(self) -> None:
        """Resolve each dns: name again and again; an address not seen before joins. (An
        address that disappears is a worker that left: its stream ends, see worker_lost.)"""
        loop = asyncio.get_running_loop()
        while True:
            for host, port in self.settings.dns_names:
                try:
                    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                except OSError as err:
                    log.warning("cannot resolve %s: %s", host, err)
                    continue
                for info in infos:
                    ip = info[4][0]
                    with contextlib.suppress(TokenMismatch, BadWorker):  # logged; it stays out
                        await self.add_address(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
            await asyncio.sleep(self.settings.discovery_interval)

    # ---- joining and coming back -------------------------------------------------------------

    async def add_address(self, address: str) -> bool:
        """Describe the worker at `address` and let it join; False if it is known already or
        does not answer. A departed one that answers again comes back."""
        for index, client in enumerate(self.clients):
            if client.target == address:
                if self.core.workers[index].gone:
                    await self.try_restore(index)
                return False
        client = WorkerClient(address, static=False, token=self.token)
        try:
            await client.describe(timeout=5.0)
        except grpc.aio.AioRpcError as err:
            await client.close()
            if err.code() is grpc.StatusCode.UNAUTHENTICATED:
                log.error("worker %s refuses this scheduler's internal token", address)
                raise TokenMismatch(address) from None
            if isinstance(err, BadWorker):
                self._refused(address, err)
                raise
            log.debug("worker %s does not answer: %s", address, err.code().name)
            return False
        if any(c.target == address for c in self.clients):  # joined while we described it
            await client.close()
            return False
        problem = self.join_problem(client)
        if problem:
            await client.close()
            bad = BadWorker(address, problem)
            self._refused(address, bad)
            raise bad
        log.info("worker %s joined: %s", address, str(client.info).replace("\n", " "))
        self.join(client)
        return True

    def join_problem(self, client: WorkerClient, but: int | None = None) -> str:
        """Why a described worker cannot join (or, as entry `but`, come back) beside the others
        (join_problem; "" if it can)."""
        assert client.info is not None
        pairs = enumerate(zip(self.clients, self.core.workers, strict=True))
        joined = [
            (c.target, c.info, not w.gone) for i, (c, w) in pairs if c.info is not None and i != but
        ]
        return join_problem(client.info, joined)

    def _refused(self, address: str, bad: BadWorker) -> None:
        """Logged once an address as an error (the worker registers again every 2 s)."""
        level = logging.DEBUG if address in self.refused_addresses else logging.ERROR
        self.refused_addresses.add(address)
        log.log(level, "%s", bad.details())

    async def try_restore(self, index: int) -> None:
        ws, client = self.core.workers[index], self.clients[index]
        try:
            await client.describe(timeout=1.0)
        except grpc.aio.AioRpcError:
            since = client.unreachable_since or time.monotonic()
            if not client.static and not ws.gone and time.monotonic() - since > FORGET_AFTER_S:
                log.info("worker %s stayed away: it leaves the stack", ws.spec.name)
                self.core.remove_worker(index)
            return
        if await client.serving() is not True:
            return  # answering, but not (yet, or any more) taking work
        problem = self.join_problem(client, but=index)
        if problem:  # e.g. it came back, and joined, at another spelling of its address
            self._refused(client.target, BadWorker(client.target, problem))
            return
        log.info("worker %s is back", ws.spec.name)
        self.core.restore_worker(index, client.spec())
        client.unreachable_since = client.silent_since = None
        self.start_loop(index)
