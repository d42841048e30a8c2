"""The load generator: streams requests to the public Gateway API (grpc.aio), closed or open loop.

Every request asks for `ignore_eos` and `max_tokens` = its output length, so outputs have exactly
the length the workload says (with `max_tokens` above the output length, the client stops reading
after the output length, as if the model had ended there, and the call is cancelled).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from llmserve import client
from llmserve.bench.prompts import prompt_text
from llmserve.bench.records import RequestRecord
from llmserve.bench.workload import RequestSpec, Workload
from llmserve.server import CHANNEL_OPTIONS
from llmserve.v1 import gateway_pb2_grpc

OnDone = Callable[[RequestRecord], None]


class LoadGenerator:
    def __init__(self, target: str, timeout_s: float | None = None, temperature: float = 0.0):
        self.target = target
        self.timeout_s = timeout_s
        self.temperature = temperature

    async def run(
        self, workload: Workload, t0: float, on_done: OnDone | None = None
    ) -> list[RequestRecord]:
        """Send the whole workload; `t0` (time.perf_counter) is the run's zero."""
        async with grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            if workload.closed:
                return await self._closed(stub, workload, t0, on_done)
            return await self._open(stub, workload, t0, on_done)

    async def _closed(
        self, stub, workload: Workload, t0: float, on_done: OnDone | None
    ) -> list[RequestRecord]:
        pending = iter(workload.requests)
        records: list[RequestRecord] = []

        async def client_loop() -> None:
            for spec in pending:  # shared iterator: each client takes the next request
                record = await self.one(stub, spec, time.perf_counter() - t0, t0)
                records.append(record)
                if on_done:
                    on_done(record)

        await asyncio.gather(*(client_loop() for _ in range(workload.concurrency)))
        return sorted(records, key=lambda r: r.index)

    async def _open(
        self, stub, workload: Workload, t0: float, on_done: OnDone | None
    ) -> list[RequestRecord]:
        tasks = []
        for spec in sorted(workload.requests, key=lambda r: r.arrival_s or 0.0):
            due = spec.arrival_s or 0.0
            delay = t0 + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self.one(stub, spec, due, t0))
            if on_done:
                task.add_done_callback(lambda t: on_done(t.result()))
            tasks.append(task)
        return sorted(await asyncio.gather(*tasks), key=lambda r: r.index)

    async def one(self, stub, spec: RequestSpec, scheduled_s: float, t0: float) -> RequestRecord:
        record = RequestRecord(spec.index, spec.prompt_tokens, spec.output_tokens, scheduled_s)
        request = client.make_request(
            prompt=prompt_text(spec.prompt_tokens),
            max_tokens=spec.limit,
            temperature=self.temperature,
            ignore_eos=True,
            request_id=f"bench-{spec.index}",
        )
        record.sent_s = time.perf_counter() - t0
        last: float | None = None
        call = stub.Generate(request, timeout=self.timeout_s)
        try:
            async for message in call:
                now = time.perf_counter() - t0
                if message.HasField("final"):
                    final = message.final
                    record.finish = client.FINISH_NAMES[final.finish_reason]
                    record.queue_time_s = final.usage.queue_time_s
                    record.preemptions = final.usage.preemptions
                    record.error = final.error
                    break
                n = len(message.delta.token_ids)
                if not n:
                    continue
                if last is None:
                    record.first_token_s = now
                else:
                    record.token_gaps.append(now - last)
                record.token_gaps.extend([0.0] * (n - 1))  # tokens that came in one message
                last = now
                record.completion_tokens += n
                if spec.limit > spec.output_tokens <= record.completion_tokens:
                    record.finish = "client_stop"  # the workload's length: stop reading here
                    call.cancel()
                    break
        except grpc.aio.AioRpcError as err:
            record.error = f"{err.code().name}: {err.details()}"
        record.end_s = time.perf_counter() - t0
        return record
