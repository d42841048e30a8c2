"""The gateway's API keys and the tenant each names: the `--api-keys-file` table, or the single
`--api-key-file` key as the one tenant `default`, or no key at all. Pure: no grpc.

A line of the file is `KEY TENANT [weight=W] [top_priority=P] [priority=P] [slo_class=NAME]
[max_queued=N] [max_queued_tokens=N]`; `#` starts a comment. KEY is the key itself or
`sha256:<64 hex digits>`, its digest. A tenant's weight and queue limits are the tenant's (stated
on any of its lines, they hold for all its keys); priorities and class are each key's. Only
digests are kept in memory, and a key sent by a client
is compared with every one in constant time (docs/tenants.md).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from llmcommon.tenancy import (
    DEFAULT_TENANT,
    PRIORITY_MAX,
    PRIORITY_MIN,
    SloClass,
    TenancyError,
    valid_name,
)

__all__ = ["ApiKeys", "KeyEntry", "KeysFileError", "digest_of", "load_api_keys", "parse_api_keys"]

DIGEST_PREFIX = "sha256:"
# a comment: `#` at a line's start or after a space (a key may hold `#`, as a shell word may)
COMMENT = re.compile(r"(?:^|\s)#")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_INTS = ("top_priority", "priority", "max_queued", "max_queued_tokens")
TENANT_OPTIONS = ("weight", "max_queued", "max_queued_tokens")  # the tenant's, on any of its lines


class KeysFileError(TenancyError):
    """A keys file that cannot be taken: the message names the file and the line."""


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """What one API key may do: its tenant and that tenant's share, the priorities it may ask
    for, its defaults and its own queue limits (0 = none beyond the gateway's total)."""

    tenant: str = DEFAULT_TENANT
    weight: float = 1.0
    top_priority: int = 0  # the lowest (first-served) priority it may ask for
    priority: int = 0  # its requests' priority when they name none
    slo_class: str = ""  # its requests' class when they name none ("" = none)
    max_queued: int = 0
    max_queued_tokens: int = 0
    cache_tenant: bytes = b""  # its share of the prefix cache (gateway/auth.py cache_salt)


def digest_of(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The keys a gateway takes. `required` False: every request is the default tenant's."""

    def __init__(self, entries: Mapping[bytes, KeyEntry], required: bool = True) -> None:
        self.entries = dict(entries)  # sha256 digest -> entry
        self.required = required
        self.open_entry = KeyEntry()

    @classmethod
    def single(cls, key: str, cache_tenant: bytes = b"") -> ApiKeys:
        """The one key of --api-key-file (or $LLMSERVE_API_KEY); "" = no key."""
        if not key:
            return cls({}, required=False)
        return cls({digest_of(key): KeyEntry(cache_tenant=cache_tenant)})

    def entry(self, key: str) -> KeyEntry | None:
        """The entry of the key a client sent, or None. Every digest is compared, each in
        constant time, so the time taken says nothing of which key is near."""
        if not self.required:
            return self.open_entry
        given, found = digest_of(key), None
        for digest, entry in self.entries.items():
            if hmac.compare_digest(given, digest):
                found = entry
        return found

    @property
    def tenants(self) -> dict[str, KeyEntry]:
        """Each tenant's first entry (its weight is the same on every line)."""
        out: dict[str, KeyEntry] = {}
        for entry in [*self.entries.values(), *([] if self.required else [self.open_entry])]:
            out.setdefault(entry.tenant, entry)
        return out


def load_api_keys(path: str, classes: Mapping[str, SloClass]) -> ApiKeys:
    """The keys file at `path`; KeysFileError naming the file (and line) when it cannot be read
    or taken."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise KeysFileError(f"cannot read the API keys file {path}: {err}") from None
    return parse_api_keys(text, path, classes)


def parse_api_keys(text: str, source: str, classes: Mapping[str, SloClass]) -> ApiKeys:
    """Each line's key and entry. A tenant's weight and queue limits are the tenant's: stated
    on any of its lines, they hold for all of them, and two lines may not disagree."""
    entries: dict[bytes, KeyEntry] = {}
    shared: dict[str, dict[str, tuple[object, int]]] = {}  # tenant -> option -> (value, line)
    for number, raw in enumerate(text.splitlines(), start=1):
        line = COMMENT.split(raw, 1)[0].strip()
        if not line:
            continue
        try:
            digest, entry, given = _line(line, classes)
            if digest in entries:
                raise TenancyError("this key is given on an earlier line too")
            _share(shared.setdefault(entry.tenant, {}), given, number, entry.tenant)
        except TenancyError as err:
            raise KeysFileError(f"{source} line {number}: {err}") from None
        entries[digest] = entry
    if not entries:
        raise KeysFileError(f"{source} holds no key: write `KEY TENANT` lines into it")
    tenant_options = {t: {k: v for k, (v, _) in options.items()} for t, options in shared.items()}
    return ApiKeys({d: replace(e, **tenant_options[e.tenant]) for d, e in entries.items()})


def _share(seen: dict[str, tuple[object, int]], given: dict, number: int, tenant: str) -> None:
    for name in TENANT_OPTIONS:
        if name not in given:
            continue
        value, first = seen.setdefault(name, (given[name], number))
        if value != given[name]:
            raise TenancyError(
                f"tenant {tenant!r} has {name}={value} on line {first}: a tenant's weight and "
                "queue limits hold for all its keys"
            )


def _line(line: str, classes: Mapping[str, SloClass]) -> tuple[bytes, KeyEntry, dict]:
    key, *rest = line.split()
    if not rest:
        raise TenancyError("expected `KEY TENANT [name=value ...]`")
    tenant, options = rest[0], rest[1:]
    if not valid_name(tenant):
        raise TenancyError(
            f"tenant {tenant!r}: letters, digits and _ . - only, up to 64 characters"
        )
    given = _options(options)
    entry = replace(KeyEntry(tenant=tenant, cache_tenant=_cache_tenant(tenant)), **given)
    if entry.priority < entry.top_priority:
        raise TenancyError(
            f"priority={entry.priority} is below top_priority={entry.top_priority}: a key's "
            "default must be a priority it may ask for"
        )
    if entry.slo_class and entry.slo_class not in classes:
        known = ", ".join(classes) or "none: --slo-classes is empty"
        raise TenancyError(f"slo_class={entry.slo_class} is not an --slo-classes class ({known})")
    return _digest(key), entry, given


def _options(options: Iterable[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for option in options:
        name, sep, value = option.partition("=")
        if not sep or name not in ("weight", "slo_class", *_INTS):
            raise TenancyError(
                f"{option!r} is not one of weight=, top_priority=, priority=, slo_class=, "
                "max_queued=, max_queued_tokens="
            )
        if name in out:
            raise TenancyError(f"{name}= is given twice")
        out[name] = _value(name, value)
    return out


def _value(name: str, value: str) -> object:
    if name == "slo_class":
        return value
    if name == "weight":
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise TenancyError(f"weight={value}: a number > 0")
        return weight
    try:
        number = int(value)
    except ValueError:
        raise TenancyError(f"{name}={value}: an integer") from None
    if name.startswith("max_") and number < 0:
        raise TenancyError(f"{name}={value}: 0 (no limit of its own) or more")
    if not PRIORITY_MIN <= number <= PRIORITY_MAX:
        raise TenancyError(f"{name}={value}: from {PRIORITY_MIN} to {PRIORITY_MAX}")
    return number


def _digest(key: str) -> bytes:
    if key.startswith(DIGEST_PREFIX):
        hexdigits = key[len(DIGEST_PREFIX) :].lower()
        if not _HEX64.match(hexdigits):
            raise TenancyError("sha256: must be followed by 64 hex digits (sha256sum's)")
        return bytes.fromhex(hexdigits)
    if not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise TenancyError("a key is printable ASCII without spaces (it travels as a header)")
    return digest_of(key)


def _cache_tenant(tenant: str) -> bytes:
    """A tenant's share of the prefix cache: its keys share cached blocks, other tenants'
    never do (a digest of the name; a client can set none of it)."""
    return hashlib.blake2b(tenant.encode(), person=b"llmserve-tenant").digest()
