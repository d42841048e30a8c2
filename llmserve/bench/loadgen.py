"""The load generator: streams requests to the public Gateway API (grpc.aio), closed or open loop.

Every request asks for `ignore_eos` and `max_tokens` = its output length, so outputs have exactly
the length the workload says (with `max_tokens` above the output length, the client stops reading
after the output length, as if the model had ended there, and the call is cancelled).

A request's clock starts when it is due (open loop) or handed to a client (closed loop), after
its prompt text is built: TTFT and end-to-end times hold the server and the sending only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from llmcommon.server import CHANNEL_OPTIONS
from llmcommon.v1 import gateway_pb2_grpc
from llmserve import client
from llmserve.bench.errors import BenchError
from llmserve.bench.prompts import prompt_text
from llmserve.bench.records import RequestRecord
from llmserve.bench.workload import RequestSpec, Workload

OnDone = Callable[[RequestRecord], None]
Sent = str | list[tuple[str, str]]  # a prompt's text, or chat messages
WARMUP_TIMEOUT_S = 300.0  # the warm-up's deadline per request when --timeout is not given
# prompts' text is built here, one at a time, in order: off the event loop, so that a long
# prompt does not hold up reading the answers under way
_BUILDER = ThreadPoolExecutor(1, thread_name_prefix="bench-prompts")


def deadline_error(timeout_s: float | None) -> str:
    return f"DEADLINE_EXCEEDED: not finished {timeout_s:g} s after sending"


class LoadGenerator:
    def __init__(self, target: str, timeout_s: float | None = None, temperature: float = 0.0):
        self.target = target
        self.timeout_s = timeout_s
        self.temperature = temperature
        self._ready: dict[int, Sent] = {}  # inputs built before the run's clock (prepare)

    async def run(
        self, workload: Workload, t0: float, on_done: OnDone | None = None
    ) -> list[RequestRecord]:
        """Send the whole workload; `t0` (time.perf_counter) is the run's zero."""
        async with grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            if workload.closed:
                return await self._closed(stub, workload, t0, on_done)
            return await self._open(stub, workload, t0, on_done)

    async def warm_up(self, workload: Workload, requests: int) -> None:
        """`requests` short requests at once, each of the workload's first prompt length, each
        with the run's deadline (--timeout) or else WARMUP_TIMEOUT_S: a server that does not
        answer any of them in that time is an error, not a hang."""
        if requests:
            first = workload.requests[0]
            specs = [RequestSpec(-1 - i, first.prompt_tokens, 4) for i in range(requests)]
            deadline = self.timeout_s
            self.timeout_s = deadline or WARMUP_TIMEOUT_S
            try:
                warmup = Workload("warmup", specs, concurrency=requests)
                records = await self.run(warmup, time.perf_counter())
            finally:
                self.timeout_s = deadline
            if deadline is None and all(r.error.startswith("DEADLINE") for r in records):
                raise BenchError(
                    f"{self.target}: no warm-up request answered within {WARMUP_TIMEOUT_S:g} s "
                    "(give --timeout S to measure such a server's requests as failures)"
                )

    def prepare(self, workload: Workload) -> None:
        """Build the inputs of the open loop's requests due at its start, before its clock
        starts (later ones are built while the loop waits for them)."""
        if not workload.closed:
            self._ready = {
                spec.index: self._input(workload, spec, [])
                for spec in workload.roots
                if not spec.arrival_s
            }

    async def _closed(
        self, stub, workload: Workload, t0: float, on_done: OnDone | None
    ) -> list[RequestRecord]:
        pending = iter(workload.roots)
        followers = workload.followers()
        records: list[RequestRecord] = []

        async def client_loop() -> None:
            for spec in pending:  # shared iterator: each client takes the next request
                sent = await self._build(workload, spec, [])
                scheduled = time.perf_counter() - t0
                chain = (spec, sent, scheduled)
                await self._chain(stub, workload, followers, chain, t0, records, on_done)

        await asyncio.gather(*(client_loop() for _ in range(workload.concurrency)))
        return sorted(records, key=lambda r: r.index)

    async def _open(
        self, stub, workload: Workload, t0: float, on_done: OnDone | None
    ) -> list[RequestRecord]:
        followers = workload.followers()
        records: list[RequestRecord] = []
        tasks = []
        for spec in sorted(workload.roots, key=lambda r: r.arrival_s or 0.0):
            due = spec.arrival_s or 0.0
            sent = self._ready.pop(spec.index, None) or await self._build(workload, spec, [])
            delay = t0 + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            chain = self._chain(stub, workload, followers, (spec, sent, due), t0, records, on_done)
            tasks.append(asyncio.create_task(chain))
        await asyncio.gather(*tasks)
        return sorted(records, key=lambda r: r.index)

    async def _chain(
        self,
        stub,
        workload: Workload,
        followers: dict[int, RequestSpec],
        first: tuple[RequestSpec, Sent, float],
        t0: float,
        records: list[RequestRecord],
        on_done: OnDone | None,
    ) -> None:
        """`first` (its spec, input and scheduled time), then the requests that follow it (a
        conversation's turns), each a think time after the answer before it ended, with that
        answer in its history (built before the think time)."""
        next_spec, sent, scheduled_s = first
        while True:
            answer: list[str] = []
            record = await self.one(stub, next_spec, scheduled_s, t0, sent, answer)
            records.append(record)
            if on_done:
                on_done(record)
            follower = followers.get(next_spec.index)
            if follower is None:
                return
            if not record.ok:
                for rest in _chain_from(follower, followers):
                    records.append(_not_sent(rest, record))
                return
            history = [*_as_messages(sent), ("assistant", "".join(answer))]
            next_spec, sent = follower, await self._build(workload, follower, history)
            await asyncio.sleep(next_spec.think_s)
            scheduled_s = time.perf_counter() - t0

    async def _build(
        self, workload: Workload, spec: RequestSpec, history: list[tuple[str, str]]
    ) -> Sent:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_BUILDER, self._input, workload, spec, history)

    @staticmethod
    def _input(workload: Workload, spec: RequestSpec, history: list[tuple[str, str]]) -> Sent:
        if workload.content is None:
            return prompt_text(spec.prompt_tokens)
        return workload.content.served_input(spec, history)

    async def one(
        self,
        stub,
        spec: RequestSpec,
        scheduled_s: float,
        t0: float,
        sent: Sent | None = None,
        answer: list[str] | None = None,
    ) -> RequestRecord:
        """One request: `sent` is its prompt text or chat messages (default: the spec's length
        of one word); the text of its deltas is appended to `answer` when given."""
        record = RequestRecord(
            spec.index, spec.prompt_tokens, spec.output_tokens, scheduled_s, turn=spec.turn
        )
        sent = prompt_text(spec.prompt_tokens) if sent is None else sent
        await self._stream(stub, Call(spec, sent, record, t0, answer))
        record.end_s = time.perf_counter() - t0
        return record

    async def _stream(self, stub, call: Call) -> None:
        """Sends the request and fills in its record from the stream of its answer."""
        spec, sent, record, answer = call.spec, call.sent, call.record, call.answer
        request = client.make_request(
            prompt=sent if isinstance(sent, str) else None,
            messages=None if isinstance(sent, str) else sent,
            max_tokens=spec.limit,
            temperature=self.temperature,
            ignore_eos=True,
            request_id=f"bench-{spec.index}",
        )
        record.sent_s = call.now()
        grpc_call = stub.Generate(request, timeout=self.timeout_s)  # from the sending
        try:
            async for message in grpc_call:
                now = call.now()
                if message.HasField("final"):
                    final = message.final
                    record.finish = client.FINISH_NAMES[final.finish_reason]
                    record.queue_time_s = final.usage.queue_time_s
                    record.preemptions = final.usage.preemptions
                    record.error = final.error
                    if final.usage.prompt_tokens:  # a chat's, with its template
                        record.prompt_tokens = final.usage.prompt_tokens
                    break
                n = len(message.delta.token_ids)
                if answer is not None:
                    answer.append(message.delta.text)
                if spec.limit > spec.output_tokens:  # a run's tokens past the length go unread
                    n = min(n, spec.output_tokens - record.completion_tokens)
                if not n:
                    continue
                record.took(n, now)
                if spec.limit > spec.output_tokens <= record.completion_tokens:
                    record.finish = "client_stop"  # the workload's length: stop reading here
                    grpc_call.cancel()
                    break
        except grpc.aio.AioRpcError as err:
            record.error = f"{err.code().name}: {err.details()}"


@dataclass(frozen=True, slots=True)
class Call:
    """One request under way: what it sends, its record, and where its answer's text goes."""

    spec: RequestSpec
    sent: Sent
    record: RequestRecord
    t0: float  # time.perf_counter() at the run's zero
    answer: list[str] | None = None

    def now(self) -> float:
        return time.perf_counter() - self.t0


def _as_messages(sent: Sent) -> list[tuple[str, str]]:
    return [("user", sent)] if isinstance(sent, str) else list(sent)


def _chain_from(spec: RequestSpec, followers: dict[int, RequestSpec]) -> list[RequestSpec]:
    out = [spec]
    while out[-1].index in followers:
        out.append(followers[out[-1].index])
    return out


def _not_sent(spec: RequestSpec, failed: RequestRecord) -> RequestRecord:
    """A turn never sent because an earlier one of its conversation failed."""
    record = RequestRecord(
        spec.index, spec.prompt_tokens, spec.output_tokens, failed.end_s or 0.0, turn=spec.turn
    )
    record.error = f"not sent: request {failed.index} before it failed ({failed.error})"
    return record
