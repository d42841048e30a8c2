"""Polls the scheduler's Status during a run: KV written / reserved / capacity, queue, stalls."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from llmcommon.admin_auth import admin_metadata
from llmcommon.auth import internal_token
from llmcommon.server import CHANNEL_OPTIONS, internal_channel
from llmcommon.v1 import gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from llmserve.bench.errors import StatusUnavailable
from llmserve.bench.records import StatusSample
from scheduler_svc.output import Snapshot

COUNTERS = [
    "steps",
    "admitted",
    "finished",
    "preemptions",
    "executed_steps",
    "step_seconds",
    "forward_seconds",
    "core_seconds",
]


PREFIX_COUNTERS = ["prompt_tokens", "hit_tokens", "evictions"]  # per worker, cumulative


def sample_of(reply: scheduler_pb2.StatusReply | Snapshot, t: float) -> StatusSample:
    """From the Status RPC's reply or, in the simulation, the core's own snapshot (same names)."""
    return StatusSample(
        t=t,
        waiting=reply.waiting,
        running=reply.running,
        kv_capacity=sum(w.capacity for w in reply.workers),
        kv_written=sum(w.written for w in reply.workers),
        kv_reserved_unwritten=sum(w.reserved_unwritten for w in reply.workers),
        finished=reply.finished,
        preemptions=reply.preemptions,
        stalls=dict(reply.stalls),
        head_wait_reason=reply.head_wait_reason,
        cached_blocks=sum(getattr(w, "cached_blocks", 0) for w in reply.workers),
        evictable_blocks=sum(getattr(w, "evictable_blocks", 0) for w in reply.workers),
    )


def prefix_counters(workers) -> dict[str, int]:
    """The workers' prefix-cache counters summed (`cache_prompt_tokens`, `cache_hit_tokens`,
    `cache_evictions`), where the scheduler reports them; {} where it does not."""
    if not workers:
        return {}
    return {
        f"cache_{name}": sum(getattr(w, name) for w in workers)
        for name in PREFIX_COUNTERS
        if all(hasattr(w, name) for w in workers)
    }


def counters_of(reply: scheduler_pb2.StatusReply) -> dict[str, Any]:
    out: dict[str, Any] = {k: getattr(reply, k) for k in COUNTERS}
    out["stalls"] = dict(reply.stalls)
    out["refused"] = dict(reply.refused)
    out["policy"], out["mode"] = reply.policy, reply.mode
    if reply.cache_figures_withheld:  # the gateway's to an ordinary client: 0s, not the cache's
        return out
    return out | prefix_counters(reply.workers)


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What happened between two Status replies (counters only grow)."""
    out = {k: after[k] - before[k] for k in COUNTERS}
    for key in ("stalls", "refused"):
        out[key] = {
            r: n - before[key].get(r, 0) for r, n in after[key].items() if n - before[key].get(r, 0)
        }
    out["policy"], out["mode"] = after["policy"], after["mode"]
    for key in after:
        if key.startswith("cache_") and key in before:
            out[key] = after[key] - before[key]
    return out


class StatusPoller:
    """Samples a scheduler's Status: from the scheduler at `target`, or, with `via_gateway`,
    from the gateway at `target`, which passes its scheduler's on (with `admin_key`, when
    given: the operator's call). `flag` names the option that chose `target`, for errors."""

    def __init__(
        self,
        target: str,
        interval_s: float = 0.25,
        via_gateway: bool = False,
        admin_key: str = "",
        flag: str = "",
    ) -> None:
        self.target = target
        self.interval_s = interval_s
        self.via_gateway = via_gateway
        self.flag = flag
        self.samples: list[StatusSample] = []
        self.metadata = admin_metadata(admin_key) or None
        if via_gateway:
            self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
            self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        else:
            # a stack started by a benchmark inherits $LLMSERVE_INTERNAL_TOKEN: send it when set
            self.channel = internal_channel(target, internal_token())
            self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)

    async def status(self) -> scheduler_pb2.StatusReply:
        return await self.stub.Status(
            scheduler_pb2.StatusRequest(), timeout=5.0, metadata=self.metadata
        )

    async def first_status(self) -> scheduler_pb2.StatusReply:
        """The first sample: its failure, StatusUnavailable, says where it asked and why."""
        try:
            return await self.status()
        except grpc.aio.AioRpcError as err:
            raise StatusUnavailable(err.code(), self._failure(err)) from None

    def _failure(self, err: grpc.aio.AioRpcError) -> str:
        who = "the gateway" if self.via_gateway else "the scheduler"
        flag = f" ({self.flag})" if self.flag else ""
        text = f"{who}'s Status at {self.target}{flag}: {err.details()}"
        if err.code() is grpc.StatusCode.UNIMPLEMENTED:
            text += (
                " (is it the gateway? --target takes the gateway's address)"
                if self.via_gateway
                else " (is it the scheduler? --status-target takes the scheduler's address; "
                "leave it out to ask the gateway at --target)"
            )
        return text

    async def poll(self, t0: float, stop: asyncio.Event) -> None:
        """Sample every `interval_s` until `stop` is set (and once more after)."""
        while True:
            try:
                reply = await self.status()
                self.samples.append(sample_of(reply, time.perf_counter() - t0))
            except grpc.aio.AioRpcError:
                pass  # a missed sample is not worth failing a benchmark for
            if stop.is_set():
                return
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass

    async def close(self) -> None:
        await self.channel.close()
