"""Clients of the public Gateway API, used by the CLI: `Client` and `AsyncClient` (generate,
stream, status), and the functions beneath them (make_request, stream, status, channel).
With the admin key, `Client` also reads and changes the live settings (get_settings,
set_settings) and explains the head of the queue (explain, status(explain=True)).

    from llmserve import Client

    with Client("127.0.0.1:50051") as llm:
        print(llm.generate("The capital of France is", max_tokens=8).text)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from llmcommon.admin_auth import admin_metadata
from llmcommon.auth import token_metadata
from llmcommon.server import CHANNEL_OPTIONS
from llmcommon.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

ADMIN_TIMEOUT_S = 30.0  # an explanation plans copies of the core a few dozen times
FINISH_NAMES = {
    common_pb2.FINISH_REASON_UNSPECIFIED: "unspecified",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
    common_pb2.FINISH_REASON_ERROR: "error",
}


# the integer fields of a request, as the wire carries them: protobuf refuses a value outside
# (a bare "Value out of range"); make_request names the keyword instead
UINT32_MAX, UINT64_MAX = 2**32 - 1, 2**64 - 1
INT_RANGES = {
    "max_tokens": (0, UINT32_MAX),
    "top_k": (0, UINT32_MAX),
    "seed": (0, UINT64_MAX),
    "n": (0, UINT32_MAX),
    "priority": (-(2**31), 2**31 - 1),
}


def int_range_problem(name: str, value: int) -> str | None:
    """Why `value` cannot be sent as `name` (one of INT_RANGES), or None."""
    low, high = INT_RANGES[name]
    if low <= value <= high:
        return None
    return f"{value} is out of range: want a whole number from {low} to {high}"


def check_target(target: str) -> str:
    """`target` when each port in it (HOST:PORT, [V6]:PORT, dns:///HOST:PORT, ipv4:A:P,B:P) is 1 to
    65535; ValueError naming it if not: gRPC would wrap a larger port silently (127.0.0.1:85136
    reaches port 19600). An address without a numeric port (unix:PATH, a host alone) passes."""
    scheme, colon, rest = target.partition(":")
    if colon and scheme in ("dns", "ipv4", "ipv6"):
        addresses = rest.rsplit("/", 1)[-1].split(",")  # dns://AUTHORITY/HOST:PORT as well
    elif colon and scheme in ("unix", "unix-abstract", "vsock"):
        return target
    else:
        addresses = [target]
    for address in addresses:
        host, colon, port = address.rpartition(":")
        if not colon or not port.isdigit() or (":" in host and not host.endswith("]")):
            continue  # no port, or an IPv6 address without brackets (no port either)
        if not 1 <= int(port) <= 65535:
            raise ValueError(f"{target!r}: the port {port} is outside 1 to 65535")
    return target


def make_request(
    prompt: str | None = None,
    messages: list[tuple[str, str]] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    stop: list[str] | None = None,
    ignore_eos: bool = False,
    request_id: str = "",
    n: int | None = None,
    priority: int | None = None,
    slo_class: str = "",
) -> gateway_pb2.GenerateRequest:
    """`priority`: vLLM's (lower is served first; None: the API key's default); `slo_class`: a
    class of the gateway's --slo-classes ("": the key's default). ValueError naming the
    keyword for an integer the wire cannot carry (INT_RANGES)."""
    given = {"max_tokens": max_tokens, "top_k": top_k, "seed": seed, "n": n, "priority": priority}
    for name, value in given.items():
        problem = None if value is None else int_range_problem(name, value)
        if problem is not None:
            raise ValueError(f"{name}: {problem}")
    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        top_p=top_p,
        top_k=top_k,
        stop=stop or [],
        ignore_eos=ignore_eos,
    )
    request = gateway_pb2.GenerateRequest(
        request_id=request_id, sampling=sampling, n=n, priority=priority, slo_class=slo_class
    )
    if messages is not None:
        request.chat.messages.extend(
            gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages
        )
    else:
        request.prompt = prompt or ""
    return request


def channel(target: str, tls_ca: str = "", aio: bool = False):
    """A channel to `target` (grpc's, or grpc.aio's); TLS when a CA certificate file is given.
    ValueError for a port outside 1 to 65535 (check_target); OSError for a CA file that cannot
    be read."""
    check_target(target)
    kind = grpc.aio if aio else grpc
    if tls_ca:
        with open(tls_ca, "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        return kind.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
    return kind.insecure_channel(target, options=CHANNEL_OPTIONS)


def stream(
    target: str,
    request: gateway_pb2.GenerateRequest,
    timeout: float | None = None,
    api_key: str = "",
    tls_ca: str = "",
) -> Iterator[gateway_pb2.GenerateResponse]:
    with channel(target, tls_ca) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        yield from stub.Generate(request, timeout=timeout, metadata=_key_metadata(api_key))


def _key_metadata(api_key: str) -> list[tuple[str, str]] | None:
    return [("authorization", f"Bearer {api_key}")] if api_key else None


def status(target: str, timeout: float = 5.0, token: str = "") -> scheduler_pb2.StatusReply:
    """The scheduler's Status; `token` is the internal token, when the stack has one."""
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        request = scheduler_pb2.StatusRequest()
        return stub.Status(request, timeout=timeout, metadata=token_metadata(token))


def gateway_status(
    target: str, timeout: float = 5.0, api_key: str = "", tls_ca: str = ""
) -> scheduler_pb2.StatusReply:
    """The scheduler's Status, asked through the gateway (with the gateway's API key)."""
    with channel(target, tls_ca) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        request = scheduler_pb2.StatusRequest()
        return stub.Status(request, timeout=timeout, metadata=_key_metadata(api_key))


def usage_dict(usage: common_pb2.Usage) -> dict[str, float | int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "queue_time_s": round(usage.queue_time_s, 4),
        "time_to_first_token_s": round(usage.time_to_first_token_s, 4),
        "total_time_s": round(usage.total_time_s, 4),
        "preemptions": usage.preemptions,
        "cached_tokens": usage.cached_tokens,
    }


# ---- the class-based clients -----------------------------------------------------------------

Messages = Iterable[tuple[str, str] | dict[str, str]]


@dataclass(frozen=True, slots=True)
class Completion:
    request_id: str
    text: str
    finish_reason: str  # stop | length | cancelled | error
    usage: dict[str, float | int]  # usage_dict's keys


def chat_request(
    prompt: str | None = None,
    *,
    messages: Messages | None = None,
    system: str | None = None,
    **sampling: Any,
) -> gateway_pb2.GenerateRequest:
    """A request from a prompt (raw text), or a chat: `messages` as (role, content) pairs or
    {"role", "content"} dicts, or `system` and `prompt` as a system and a user message."""
    pairs = [(m["role"], m["content"]) if isinstance(m, dict) else m for m in messages or []]
    if system is not None:
        pairs = [("system", system), *pairs, *([("user", prompt)] if prompt is not None else [])]
    if pairs:
        return make_request(messages=pairs, **sampling)
    return make_request(prompt=prompt, **sampling)


# what the gateway withholds from an ordinary client's Status (gateway/service.py,
# withhold_cache_figures): they would tell it whether another client's prompt starts like its own
CACHE_FIGURES = ("cached_blocks", "evictable_blocks", "evictions", "prompt_tokens", "hit_tokens")
TOTAL_CACHE_FIGURES = ("prompt_tokens", "hit_tokens", "evictions")  # of the reply and each cell


def cell_dict(cell: scheduler_pb2.CellStatus, withheld: bool = False) -> dict:
    """One cell of a gateway with --cells, as plain data (without the cache figures where they
    were withheld)."""
    keys = ["address", "up", "load", "waiting", "running", "prompt_tokens", "hit_tokens"]
    keys = [k for k in keys if not (withheld and k in TOTAL_CACHE_FIGURES)]
    return {k: getattr(cell, k) for k in keys} | {"routed": dict(cell.routed)}


def status_dict(reply: scheduler_pb2.StatusReply) -> dict:
    """The Status reply as plain data (what `llmserve status --json` prints). Where the reply
    says `cache_figures_withheld`, the prefix-cache figures are left out (in total, per worker
    and per cell): the wire reads them as 0, which is not what the cache did."""
    keys = [
        "policy",
        "mode",
        "token_budget",
        "max_running",
        "block_size",
        "chunked_prefill",
        "model",
        "max_context",
        "steps",
        "waiting",
        "waiting_tokens",
        "running",
        "head_wait_reason",
        "admitted",
        "finished",
        "preemptions",
        "oldest_wait_s",
        "overlap",
        "prefix_caching",
        "prompt_tokens",
        "hit_tokens",
        "evictions",
        "cache_figures_withheld",
        "step_time_budget_ms",
        "step_time_window",
        "decode_steps",
        "run_steps",
        "decode_runs",
        "loop_overhead_ms",
        "arrivals_per_s",
        "speculative",
        "num_speculative_tokens",
        "speculative_length",
        "spec_drafts",
        "spec_draft_tokens",
        "spec_accepted_tokens",
        "explanation_withheld",
    ]
    out = {k: getattr(reply, k) for k in keys}
    withheld = reply.cache_figures_withheld
    if withheld:  # withheld figures read as 0 on the wire: leave them out, not report 0
        out = {k: v for k, v in out.items() if k not in TOTAL_CACHE_FIGURES}
    out["explanation"] = explanation_dict(reply.explanation)
    out["stalls"] = dict(reply.stalls)
    out["refused"] = dict(reply.refused)
    out["cells"] = [cell_dict(c, withheld) for c in reply.cells]
    out["spec_potential"] = {
        p.proposer: {
            "requests": p.requests, "tokens": p.tokens, "steps": p.steps,
            "draft_tokens": p.draft_tokens, "accepted_tokens": p.accepted_tokens,
            "step_seconds": p.step_seconds, "plain_seconds": p.plain_seconds,
        }
        for p in reply.spec_potential
    }  # fmt: skip
    out["spec_potential_skipped"] = reply.spec_potential_skipped
    out["workers"] = [worker_dict(w, withheld) for w in reply.workers]
    return out


def worker_dict(w: scheduler_pb2.WorkerKv, withheld: bool = False) -> dict:
    """One worker of a Status reply as plain data; without the prefix-cache figures (CACHE_FIGURES)
    where the gateway withheld them."""
    out = {
        "name": w.name,
        "capacity": w.capacity,
        "written": w.written,
        "reserved_unwritten": w.reserved_unwritten,
        "free": w.free,
        "running": w.running,
        "healthy": w.healthy,
        "draining": w.draining,
        "address": w.address,
        "block_size": w.block_size,
        "max_context": w.max_context,
        "steps": w.steps,
        "stalls": dict(w.stalls),
        "forward_seconds": w.forward_seconds,
        "step_bytes": w.step_bytes,
        "cached_blocks": w.cached_blocks,
        "evictable_blocks": w.evictable_blocks,
        "evictions": w.evictions,
        "prompt_tokens": w.prompt_tokens,
        "hit_tokens": w.hit_tokens,
        "kernels": w.kernels,
        "step_time_error_p50": w.step_time_error_p50,
        "step_time_error_p90": w.step_time_error_p90,
        "step_time_error_steps": w.step_time_error_steps,
        "last_predicted_seconds": w.last_predicted_seconds,
        "last_forward_seconds": w.last_forward_seconds,
    }
    return {k: v for k, v in out.items() if k not in CACHE_FIGURES} if withheld else out


def explanation_dict(e: scheduler_pb2.HeadExplanation) -> dict | None:
    """The head's explanation as plain data; None when nobody waits (or none was asked)."""
    if not e.request_id:
        return None
    nested = {"workers", "head_standing", "oldest", "ahead"}
    out: dict[str, Any] = {
        f.name: getattr(e, f.name) for f in e.DESCRIPTOR.fields if f.name not in nested
    }

    def standing(s: scheduler_pb2.QueueStanding) -> dict:
        return {"request_id": s.request_id, "wait_s": s.wait_s, "standing": dict(s.standing)}

    out["head_standing"] = standing(e.head_standing) if e.HasField("head_standing") else None
    out["oldest"] = standing(e.oldest) if e.HasField("oldest") else None
    out["ahead"] = [standing(s) for s in e.ahead]
    out["workers"] = [
        {
            "name": w.name,
            "free": w.free,
            "written": w.written,
            "reserved_unwritten": w.reserved_unwritten,
            "running": w.running,
            "holders": [(h.request_id, h.unwritten) for h in w.holders],
        }
        for w in e.workers
    ]
    return out


@dataclass(frozen=True, slots=True)
class SettingsChange:
    changed: dict[str, tuple[str, str]]  # name -> (old, new), of those that changed
    steps: int  # the scheduler's steps when the change applied
    stalls: dict[str, int]  # and its stall counts then


class _Collect:
    """Text and the final message of one streamed generation."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.final: gateway_pb2.Final | None = None

    def add(self, message: gateway_pb2.GenerateResponse) -> str | None:
        if message.HasField("delta"):
            self.text.append(message.delta.text)
            return message.delta.text
        self.final = message.final
        return None

    def completion(self) -> Completion:
        final = self.final or gateway_pb2.Final()
        return Completion(
            request_id=final.request_id,
            text="".join(self.text),
            finish_reason=FINISH_NAMES[final.finish_reason],
            usage=usage_dict(final.usage),
        )


class _Connection:
    """What both clients hold: a channel to the gateway, its stub, the API key's metadata and
    each call's deadline (s)."""

    AIO = False

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        api_key: str = "",
        tls_ca: str = "",
        timeout: float | None = None,
        admin_key: str = "",
    ) -> None:
        self._channel = channel(target, tls_ca, aio=self.AIO)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._admin = scheduler_pb2_grpc.AdminStub(self._channel)
        self._gateway_admin = gateway_pb2_grpc.GatewayAdminStub(self._channel)
        self._metadata = _key_metadata(api_key)
        self._admin_metadata = [*(self._metadata or ()), *admin_metadata(admin_key)]
        self.timeout = timeout


class Client(_Connection):
    """The gateway's API, blocking. Sampling keywords are make_request's (max_tokens,
    temperature, seed, top_p, top_k, stop, ignore_eos); `timeout` is each call's deadline (s)."""

    def generate(
        self,
        prompt: str | None = None,
        *,
        on_text: Callable[[str], object] | None = None,
        **request: Any,
    ) -> Completion:
        """The whole completion; `on_text` sees each piece of text as it arrives."""
        collect = _Collect()
        for message in self._stub.Generate(
            chat_request(prompt, **request), timeout=self.timeout, metadata=self._metadata
        ):
            text = collect.add(message)
            if text is not None and on_text is not None:
                on_text(text)
        return collect.completion()

    def stream(self, prompt: str | None = None, **request: Any) -> Iterator[str]:
        """The completion's text, piece by piece."""
        for message in self._stub.Generate(
            chat_request(prompt, **request), timeout=self.timeout, metadata=self._metadata
        ):
            if message.HasField("delta"):
                yield message.delta.text

    def status(self, explain: bool = False) -> dict:
        """The scheduler's snapshot (status_dict), through the gateway; with `explain` (and
        the admin key) the head's explanation too. The admin key, when this client has one,
        goes with every Status call: it is the operator asking (the prefix-cache figures)."""
        reply = self._stub.Status(
            scheduler_pb2.StatusRequest(explain=explain),
            timeout=self.timeout or (ADMIN_TIMEOUT_S if explain else 5.0),
            metadata=self._admin_metadata or None,
        )
        return status_dict(reply)

    def get_settings(self) -> dict[str, str]:
        """Every live setting and its value (the admin key's)."""
        reply = self._admin.GetSettings(scheduler_pb2.GetSettingsRequest(), **self._admin_call(5.0))
        return {s.name: s.value for s in reply.settings}

    def set_settings(self, changes: dict[str, str]) -> dict[str, tuple[str, str]]:
        """Change live settings, all or nothing (INVALID_ARGUMENT naming a bad one): name ->
        (old, new) of those that changed."""
        return self.change_settings(changes).changed

    def change_settings(self, changes: dict[str, str]) -> SettingsChange:
        """`set_settings`, with the scheduler's step and stall counts as the change applied."""
        request = scheduler_pb2.SetSettingsRequest(
            changes=[scheduler_pb2.Setting(name=k, value=str(v)) for k, v in changes.items()]
        )
        reply = self._admin.SetSettings(request, **self._admin_call(5.0))
        return SettingsChange(
            changed={c.name: (c.old_value, c.new_value) for c in reply.changed},
            steps=reply.steps,
            stalls=dict(reply.stalls),
        )

    def explain(self) -> dict | None:
        """What would admit the head of the queue (explanation_dict); None if nobody waits."""
        reply = self._admin.Explain(
            scheduler_pb2.ExplainRequest(), **self._admin_call(ADMIN_TIMEOUT_S)
        )
        return explanation_dict(reply)

    def reload_keys(self) -> str:
        """The gateway's API keys read again (its --api-keys-file), as SIGHUP does; the keys in
        force now, as the gateway logs them. A bad file: FAILED_PRECONDITION, the old keys stay."""
        request = gateway_pb2.ReloadKeysRequest()
        return self._gateway_admin.ReloadKeys(request, **self._admin_call(5.0)).summary

    def _admin_call(self, timeout: float) -> dict[str, Any]:
        return {"timeout": self.timeout or timeout, "metadata": self._admin_metadata}

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Connection):
    """Client's API for asyncio: `await generate(...)`, `async for text in stream(...)`,
    `await status()`; `async with AsyncClient(...) as llm:` closes its channel."""

    AIO = True

    async def generate(self, prompt: str | None = None, **request: Any) -> Completion:
        collect = _Collect()
        call = self._stub.Generate(
            chat_request(prompt, **request), timeout=self.timeout, metadata=self._metadata
        )
        async for message in call:
            collect.add(message)
        return collect.completion()

    async def stream(self, prompt: str | None = None, **request: Any) -> AsyncIterator[str]:
        call = self._stub.Generate(
            chat_request(prompt, **request), timeout=self.timeout, metadata=self._metadata
        )
        async for message in call:
            if message.HasField("delta"):
                yield message.delta.text

    async def status(self) -> dict:
        reply = await self._stub.Status(
            scheduler_pb2.StatusRequest(),
            timeout=self.timeout or 5.0,
            metadata=self._admin_metadata or None,  # with the admin key, when given: Client's
        )
        return status_dict(reply)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
