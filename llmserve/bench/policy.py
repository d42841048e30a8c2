"""A scheduling configuration to compare: batching mode + KV policy."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace

from llmserve.bench.errors import BenchError
from scheduler_svc.config import QueuePolicy

DEFAULT_POLICIES = "continuous+paged,continuous+reserve,static+reserve"  # bench serve's


@dataclass(frozen=True, slots=True)
class Policy:
    """e.g. continuous+paged: `mode` continuous | static, `kv` paged | reserve. The parsers
    below raise BenchError (a ValueError) naming the bad text: `llmserve` prints one line."""

    mode: str
    kv: str
    prefix_caching: bool | None = None  # None: the scheduler's default
    queue: str = ""  # the waiting queue's ordering (fcfs, priority, fair, deadline); "": default

    @property
    def label(self) -> str:
        cache = "" if self.prefix_caching is None else f" cache {_on(self.prefix_caching)}"
        queue = f" {self.queue}" if self.queue else ""
        return f"{self.mode}+{self.kv}{cache}{queue}"

    def with_caching(self, on: bool | None) -> Policy:
        return replace(self, prefix_caching=on)

    @staticmethod
    def parse(text: str) -> Policy:
        mode, _, kv = text.partition("+")
        if mode not in ("continuous", "static") or kv not in ("paged", "reserve"):
            raise BenchError(f"policy {text!r}: want continuous|static + paged|reserve")
        return Policy(mode, kv)


def parse_policies(policies: str, caching: str = "", queues: str = "") -> list[Policy]:
    """--policies (comma-separated), each once per --prefix-caching value and per
    --queue-policies ordering."""
    return [
        replace(Policy.parse(text.strip()).with_caching(on), queue=queue)
        for text in policies.split(",")
        for on in parse_caching(caching)
        for queue in parse_queues(queues)
    ]


def parse_queues(text: str) -> list[str]:
    """--queue-policies: "" (the core's default) or comma-separated orderings."""
    if not text:
        return [""]
    known = [q.value for q in QueuePolicy]
    out = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in out if v not in known]
    if unknown or not out:
        raise BenchError(f"--queue-policies {text!r}: want one or more of {', '.join(known)}")
    return list(dict.fromkeys(out))


def parse_caching(text: str) -> list[bool | None]:
    """--prefix-caching: "" (the default), "on", "off" or "on,off" (both, same arrivals)."""
    if not text:
        return [None]
    values = {"on": True, "off": False}
    out = [values.get(v.strip()) for v in text.split(",")]
    if None in out:
        raise BenchError(f"--prefix-caching {text!r}: want on, off or on,off")
    return list(dict.fromkeys(out))


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def checked_text(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type that checks its text with `parse` and keeps the text (read again later
    with the other flags): `parse`'s ValueError becomes argparse's one-line error."""

    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text

    return check


# comma-separated mode+kv, and comma-separated queue orderings
policy_list = checked_text(parse_policies)
queue_list = checked_text(parse_queues)
