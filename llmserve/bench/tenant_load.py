"""Two clients of one stack through real gRPC, for `bench tenants`: a chat client sending short
chats one after another, and a batch client keeping many long requests in flight, each with its
own API key (its own tenant). What each one saw: the chats' times to first token, the batch's
tokens received."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from llmcommon.v1 import gateway_pb2_grpc
from llmserve.client import channel, make_request

WORD = " a"  # one token of SmolLM2's vocabulary (llmserve/bench/prompts.py)


@dataclass(frozen=True, slots=True)
class Client:
    """One tenant's load: `concurrency` requests in flight, each `prompt` tokens (about: a
    distinct prefix keeps the prefix cache from sharing them) and `output` tokens out."""

    api_key: str
    concurrency: int
    prompt: int
    output: int
    priority: int | None = None
    label: str = ""


@dataclass(slots=True)
class Seen:
    """What one client saw over a phase."""

    ttft: list[float] = field(default_factory=list)  # of requests that got a first token
    tokens: int = 0  # tokens received within the phase
    finished: int = 0
    errors: list[str] = field(default_factory=list)
    unanswered: int = 0  # requests still without a first token when the phase ended
    lock: threading.Lock = field(default_factory=threading.Lock)


def _prompt(label: str, index: int, tokens: int) -> str:
    head = f"{label} request {index}:"
    return head + WORD * max(1, tokens - len(head.split()) - 3)


def run_phase(target: str, clients: list[Client], seconds: float) -> list[Seen]:
    """Every client's load for `seconds` (the batch first, the others a second later so they
    arrive beside it); requests still running at the end are cancelled."""
    stop = threading.Event()
    seen = [Seen() for _ in clients]
    calls: set = set()
    calls_lock = threading.Lock()
    counter = iter(range(10**9))
    with channel(target) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        def loop(client: Client, out: Seen, delay: float) -> None:
            if stop.wait(delay):
                return
            while not stop.is_set():
                index = next(counter)
                request = make_request(
                    prompt=_prompt(client.label, index, client.prompt),
                    max_tokens=client.output,
                    temperature=0.0,
                    ignore_eos=True,
                )
                if client.priority is not None:
                    request.priority = client.priority
                sent, first = time.monotonic(), None
                call = stub.Generate(
                    request, metadata=[("authorization", f"Bearer {client.api_key}")]
                )
                with calls_lock:
                    calls.add(call)
                try:
                    for message in call:
                        if message.HasField("delta") and message.delta.token_ids:
                            if first is None:
                                first = time.monotonic()
                                with out.lock:
                                    out.ttft.append(first - sent)
                            if not stop.is_set():
                                with out.lock:
                                    out.tokens += len(message.delta.token_ids)
                    with out.lock:
                        out.finished += 1
                except grpc.RpcError as err:
                    if not stop.is_set():
                        with out.lock:
                            out.errors.append(f"{err.code().name}: {err.details()}")
                        stop.wait(0.5)
                finally:
                    with calls_lock:
                        calls.discard(call)
                if first is None and stop.is_set():
                    with out.lock:
                        out.unanswered += 1

        threads = [
            threading.Thread(target=loop, args=(c, s, 0.0 if i == 0 else 1.0), daemon=True)
            for i, (c, s) in enumerate(zip(clients, seen, strict=True))
            for _ in range(c.concurrency)
        ]
        for t in threads:
            t.start()
        stop.wait(seconds)
        stop.set()
        with calls_lock:
            for call in list(calls):
                call.cancel()
        for t in threads:
            t.join(30)
    return seen
