"""A scheduling configuration to compare: batching mode + KV policy."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Policy:
    """e.g. continuous+paged: `mode` continuous | static, `kv` paged | reserve."""

    mode: str
    kv: str
    prefix_caching: bool | None = None  # None: the scheduler's default

    @property
    def label(self) -> str:
        cache = "" if self.prefix_caching is None else f" cache {_on(self.prefix_caching)}"
        return f"{self.mode}+{self.kv}{cache}"

    def with_caching(self, on: bool | None) -> Policy:
        return replace(self, prefix_caching=on)

    @staticmethod
    def parse(text: str) -> Policy:
        mode, _, kv = text.partition("+")
        if mode not in ("continuous", "static") or kv not in ("paged", "reserve"):
            raise ValueError(f"policy {text!r}: want continuous|static + paged|reserve")
        return Policy(mode, kv)


def parse_policies(policies: str, caching: str = "") -> list[Policy]:
    """--policies (comma-separated), each once per --prefix-caching value."""
    return [
        Policy.parse(text.strip()).with_caching(on)
        for text in policies.split(",")
        for on in parse_caching(caching)
    ]


def parse_caching(text: str) -> list[bool | None]:
    """--prefix-caching: "" (the default), "on", "off" or "on,off" (both, same arrivals)."""
    if not text:
        return [None]
    values = {"on": True, "off": False}
    out = [values.get(v.strip()) for v in text.split(",")]
    if None in out:
        raise ValueError(f"--prefix-caching {text!r}: want on, off or on,off")
    return list(dict.fromkeys(out))


def _on(flag: bool) -> str:
    return "on" if flag else "off"
