"""What a benchmark sends: request shapes and when they arrive (closed loop or open loop)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from llmcommon.tenancy import Tenancy
from llmserve.bench.prompts import ONE_WORD
from llmserve.bench.tokens import TextOf, TokenSource
from llmserve.bench.trace import TraceRow, TraceScale, load_trace, scale_trace


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    prompt_tokens: int
    output_tokens: int  # the output is forced to this length
    arrival_s: float | None = None  # open loop: seconds after the start; closed loop: None
    max_tokens: int = 0  # the request's max_tokens; 0 = output_tokens (exact)
    follows: int = -1  # >= 0: sent think_s after request `follows` finished (the next turn)
    think_s: float = 0.0
    turn: int = -1  # a conversation's turn (0 = its first), -1 outside conversations
    tenancy: Tenancy | None = None  # its tenant, priority and SLO class; None: the default

    @property
    def limit(self) -> int:
        return self.max_tokens or self.output_tokens


class Content(Protocol):
    """What requests say when it is more than `prompt_tokens` x one word (prefix caching needs
    content that repeats where the workload says so, and only there)."""

    @property
    def label(self) -> str:
        """What the prompts are made of, as every report states it."""
        ...

    def prompt_ids(self, spec: RequestSpec, history: list[int]) -> list[int]:
        """The prompt's token ids (simulation). `history`: the prompt and output ids of the
        request this one follows, [] when none."""
        ...

    def served_input(
        self, spec: RequestSpec, history: list[tuple[str, str]]
    ) -> str | list[tuple[str, str]]:
        """A prompt text or chat messages (real processes). `history`: the messages of the
        request this one follows with its answer as the last ("assistant", text); [] when none."""
        ...


class DistinctPrompts:
    """A length-only trace's prompts: each request its own token ids, from `source` keyed by
    its index, so a prefix cache finds nothing one request shares with another; with
    `shared_prefix` > 0 every prompt starts with the same that many tokens (a stated model of
    a shared system prompt, never the default)."""

    def __init__(
        self, source: TokenSource, text: TextOf | None = None, shared_prefix: int = 0
    ) -> None:
        if shared_prefix < 0:
            raise ValueError("shared_prefix must be >= 0")
        self.source = source
        self.text = text  # word-token ids -> text; None: the simulation only
        self.shared = source.ids("shared-prefix", n=shared_prefix)

    @property
    def label(self) -> str:
        own = f"distinct per request (length-only trace; seeded ids, seed {self.source.seed})"
        return f"a shared prefix of {len(self.shared)} tokens, then {own}" if self.shared else own

    def prompt_ids(self, spec: RequestSpec, history: list[int]) -> list[int]:
        shared = self.shared[: spec.prompt_tokens]
        rest = spec.prompt_tokens - len(shared)
        return shared + self.source.ids("request", spec.index, n=rest)

    def served_input(self, spec: RequestSpec, history: list[tuple[str, str]]) -> str:
        if self.text is None:
            raise RuntimeError("trace prompts for real processes need a text vocabulary")
        return self.text(self.prompt_ids(spec, []))


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: list[RequestSpec]
    concurrency: int = 0  # closed loop: this many clients; 0 = open loop (arrival_s)
    params: dict[str, Any] = field(default_factory=dict)  # stated in every report
    content: Content | None = None  # None: prompts of one repeated word

    @property
    def closed(self) -> bool:
        return self.concurrency > 0

    @property
    def roots(self) -> list[RequestSpec]:
        """The requests that follow none (the others are sent when the one before ends)."""
        return [r for r in self.requests if r.follows < 0]

    def followers(self) -> dict[int, RequestSpec]:
        return {r.follows: r for r in self.requests if r.follows >= 0}

    @property
    def prompts(self) -> str:
        """What the prompts are made of (a replay's figures mean nothing without it)."""
        return ONE_WORD if self.content is None else self.content.label

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    def describe(self) -> dict[str, Any]:
        loop = f"closed loop, {self.concurrency} clients" if self.closed else "open loop"
        return {
            "name": self.name,
            "loop": loop,
            "requests": len(self.requests),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prompts": self.prompts,
            **self.params,
        }


def fixed(num: int, prompt_tokens: int, output_tokens: int, concurrency: int) -> Workload:
    """`num` identical requests from `concurrency` clients, each sending the next when done."""
    specs = [RequestSpec(i, prompt_tokens, output_tokens) for i in range(num)]
    return Workload(
        f"fixed-{concurrency}x{prompt_tokens}+{output_tokens}",
        specs,
        concurrency,
        {"kind": "fixed", "prompt_len": prompt_tokens, "output_len": output_tokens},
    )


def poisson(
    num: int, rate: float, prompt_tokens: int, output_tokens: int, seed: int = 0
) -> Workload:
    """Open loop: exponential inter-arrival times at `rate` requests/s."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(seed)
    t, specs = 0.0, []
    for i in range(num):
        specs.append(RequestSpec(i, prompt_tokens, output_tokens, arrival_s=t))
        t += rng.expovariate(rate)
    return Workload(
        f"poisson-{rate:g}rps",
        specs,
        0,
        {
            "kind": "poisson",
            "rate_rps": rate,
            "seed": seed,
            "prompt_len": prompt_tokens,
            "output_len": output_tokens,
        },
    )


def from_trace(
    scale: TraceScale,
    rows: list[TraceRow] | None = None,
    concurrency: int = 0,
    max_tokens: int = 0,
    content: Content | None = None,
) -> Workload:
    """The trace's lengths, scaled; its own timestamps (open loop) or `concurrency` clients.
    `max_tokens` > output length emulates requests that stop early (end-of-sequence) under a
    larger max_tokens, which is what `reserve` reserves for. The trace has lengths only, so
    each request gets its own prompt content (`content`, default `DistinctPrompts` of seed 0)."""
    scaled = scale_trace(rows if rows is not None else load_trace(), scale)
    specs = [
        RequestSpec(
            i,
            r.prompt_tokens,
            r.output_tokens,
            None if concurrency else r.arrival_s,
            max(max_tokens, r.output_tokens) if max_tokens else 0,
        )
        for i, r in enumerate(scaled)
    ]
    params = {
        "kind": "trace",
        "length_scale": scale.length_scale,
        **timing(scale.time_scale, concurrency),
        "slice_start_s": scale.start_s,
        "slice_duration_s": scale.duration_s,
        "max_tokens": max_tokens or "exact (= output length)",
    }
    if scale.max_prompt_tokens or scale.max_output_tokens:
        params |= {
            "max_prompt_tokens": scale.max_prompt_tokens,
            "max_output_tokens": scale.max_output_tokens,
        }
    if not concurrency:
        params["span_s"] = round((specs[-1].arrival_s or 0.0) if specs else 0.0, 1)
    name = f"trace-len{scale.length_scale:g}-time{scale.time_scale:g}"
    if concurrency:
        name = f"trace-len{scale.length_scale:g}-c{concurrency}"
    return Workload(name, specs, concurrency, params, content or DistinctPrompts(TokenSource()))


def timing(time_scale: float, concurrency: int) -> dict[str, Any]:
    """A trace replay's time scale as its report states it: applied to the arrivals (open
    loop), or not applied (closed loop: clients send as soon as they are free)."""
    if concurrency:
        return {
            "time_scale": f"not applied (closed loop, {concurrency} clients: the trace's arrival "
            "times are ignored; --concurrency 0 replays them)"
        }
    return {"time_scale": time_scale, "load_factor": round(1.0 / time_scale, 4)}


def with_max_tokens(workload: Workload, max_tokens: int) -> Workload:
    specs = [replace(r, max_tokens=max(max_tokens, r.output_tokens)) for r in workload.requests]
    return replace(workload, requests=specs, params=workload.params | {"max_tokens": max_tokens})
