"""The worker service: Describe its pool; run one scheduler's step stream, executing each step
in the forward thread as soon as the one before it is done."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from llmcommon.unreadable import unreadable_message
from llmcommon.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.grammar import GrammarCache, TokenTable, model_tokenizer
from worker_svc.kernel_plan import describe_fields
from worker_svc.session import Session
from worker_svc.settings import WorkerSettings

log = logging.getLogger("worker")
DRIVERLESS_SECONDS = 5.0  # a drain stops waiting when no step came for this long
END = object()


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        settings: WorkerSettings,
        runner,
        model_name: str,
        forward: ThreadPoolExecutor | None = None,
    ) -> None:
        """`forward`: the one thread that runs the model (the one that loaded it, see
        `forward_thread`); a new one if not given."""
        self.settings = settings
        self.runner = runner
        self.model_name = model_name
        self.grammars = grammar_cache(settings.model, runner)
        self.session = Session(runner, runner.num_blocks, self.grammars)
        self.last_call = 0.0
        self.executor = forward or forward_thread()
        self.on_execute = None  # metrics hook: (shape, seconds, report), also for releases only
        self.end_stream = lambda: None  # ends the current step stream (when the worker stops)
        self.driver: str | None = None  # the peer whose step stream drives this worker now
        self.shown = threading.Lock()  # the metrics hook vs a stream's end
        self.instance = uuid.uuid4().hex  # this process, whatever address it is reached at

    async def drain(self) -> None:
        """On SIGTERM (health already NOT_SERVING, so the scheduler sends nothing new): keep
        executing until the scheduler has released every request held here, or time runs out."""
        deadline = time.monotonic() + self.settings.drain_timeout
        while self.session.items and time.monotonic() < deadline:
            if time.monotonic() - self.last_call > DRIVERLESS_SECONDS:
                break  # no scheduler drives these requests any more
            await asyncio.sleep(0.05)
        if self.session.items:
            log.warning("drain timed out with %d requests still held", len(self.session.items))
        self.end_stream()  # the scheduler sees this worker leave now, not after the grace

    def describe(self) -> worker_pb2.WorkerInfo:
        cfg, pool = self.runner.config, self.runner.pool
        return worker_pb2.WorkerInfo(
            name=self.settings.display_name,
            model=self.model_name,
            dtype=self.settings.dtype,
            block_size=self.runner.block_size,
            num_blocks=self.runner.num_blocks,
            capacity_positions=self.runner.num_blocks * self.runner.block_size,
            bytes_per_position=pool.bytes_per_position,
            pool_bytes=pool.pool_bytes,
            max_context=cfg.max_context,
            vocab_size=cfg.vocab_size,
            eos_token_ids=list(cfg.eos_token_ids),
            device=str(getattr(self.runner, "device", "cpu")),
            instance=self.instance,
            **describe_fields(self.runner),  # the kernels picked for this host (kernel_plan)
        )

    async def Describe(self, request, context):
        return self.describe()

    async def Steps(self, request_iterator, context):
        """Steps are queued on the one forward thread as they arrive, so step N+1 starts the
        moment N ends; results go back in order. One stream at a time: while one lives, another
        is refused (FAILED_PRECONDITION), so that no process can take the worker over silently.
        A new stream once the last has ended (a restarted scheduler: a killed one's connection
        is closed by its kernel, a hung one's by the keepalive) starts from nothing."""
        if self.driver is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, taken(self.driver))
        self.driver = driver = context.peer() or "a peer"
        with self.shown:
            self.session.closed = True
            session = self.session = Session(self.runner, self.runner.num_blocks, self.grammars)
        loop = asyncio.get_running_loop()
        results: asyncio.Queue = asyncio.Queue()

        def run(step: worker_pb2.Step) -> None:
            if session.closed:
                return
            result, shape, seconds = session.run(step)
            with self.shown:  # a stream that has ended shows nothing more (its KV is free)
                if self.on_execute is not None and not session.closed:
                    try:  # once per execution (a step may repeat its decodes)
                        for ran, took in session.executions or [(shape, seconds)]:
                            self.on_execute(ran, took, result.kv)
                    except Exception:  # metrics must never cost a step its answer
                        log.exception("metrics hook failed")
            loop.call_soon_threadsafe(results.put_nowait, result)

        unreadable: list[str] = []  # why the stream's next message could not be read

        async def read() -> None:
            try:
                async for step in request_iterator:
                    self.last_call = time.monotonic()
                    self.executor.submit(run, step)
            except Exception as err:  # noqa: BLE001 - an undecodable message: said, not swallowed
                unreadable.append(unreadable_message(err))
                log.error("step stream from %s: %s", driver, unreadable[0])
            finally:
                self.executor.submit(lambda: loop.call_soon_threadsafe(results.put_nowait, END))

        reader = asyncio.create_task(read())
        self.end_stream = lambda: results.put_nowait(END)
        try:
            while (result := await results.get()) is not END:
                yield result
            if unreadable:  # the steps before it were answered; the stream ends in error
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, unreadable[0])
        finally:
            reader.cancel()
            if self.driver is driver:
                self.driver = None
            with self.shown:
                session.closed = True
                if self.session is session:  # no scheduler drives these requests any more
                    self.session = Session(self.runner, self.runner.num_blocks, self.grammars)
                    self.report(self.session.report())

    def report(self, kv: worker_pb2.KvReport) -> None:
        """The pool as the metrics show it, also when no step runs (a stream ended)."""
        if self.on_execute is not None:
            self.on_execute(None, 0.0, kv)


def forward_thread() -> ThreadPoolExecutor:
    """The thread that runs every torch computation of the worker: loading, the kernel plan's
    measurements, the memory profile, and the steps. One thread: every thread that enters a
    parallel region gets an OpenMP team of its own, and a second team's threads slow the first
    one's regions for good (a one-row SmolLM2 decode on two threads of a two-vCPU host: 7 ms
    from one thread, 15 ms from a second one after the first had run; docs/benchmarks.md)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")


def grammar_cache(model: str, runner) -> GrammarCache | None:
    """Structured output's grammars, on the model's vocabulary (built at the first constrained
    request); none for the simulated model, which computes no logits to mask."""
    if model == "sim":
        return None
    cfg = runner.config
    vocab, eos = cfg.vocab_size, cfg.eos_token_ids
    return GrammarCache(TokenTable(lambda: model_tokenizer(model, vocab, eos)))


def taken(driver: str) -> str:
    return (
        f"this worker is driven by another scheduler's step stream (from {driver}); it takes a "
        "new one once that stream ends"
    )
