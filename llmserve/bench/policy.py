"""A scheduling configuration to compare: batching mode + KV policy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Policy:
    """e.g. continuous+paged: `mode` continuous | static, `kv` paged | reserve."""

    mode: str
    kv: str

    @property
    def label(self) -> str:
        return f"{self.mode}+{self.kv}"

    @staticmethod
    def parse(text: str) -> Policy:
        mode, _, kv = text.partition("+")
        if mode not in ("continuous", "static") or kv not in ("paged", "reserve"):
            raise ValueError(f"policy {text!r}: want continuous|static + paged|reserve")
        return Policy(mode, kv)
