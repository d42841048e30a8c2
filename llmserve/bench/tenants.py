"""Tenants for `bench sim`: each with its own arrivals (Poisson, a closed loop, or a trace on its
own time scale), lengths, weight, priority and SLO class, and the one workload they make together.

A spec is `NAME:key=value,...` per tenant, `;`-separated (`--tenants`), or a JSON or YAML list of
objects with the same keys (`--tenants-file`). A closed-loop tenant of concurrency C sends its
requests as C chains, each request sent when the one before it in its chain ends."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from llmcommon.tenancy import SloClass, Tenancy, valid_name
from llmserve.bench.tokens import TokenSource
from llmserve.bench.trace import DEFAULT_TRACE, UNITS, TraceScale, read_trace, scale_trace
from llmserve.bench.workload import DistinctPrompts, RequestSpec, Workload

KINDS = ("poisson", "closed", "trace")


class TenantSpecError(ValueError):
    """A tenant spec that cannot be taken; the message names the tenant and the key."""


@dataclass(frozen=True, slots=True)
class TenantSpec:
    name: str
    weight: float = 1.0
    priority: int = 0
    slo_class: str = ""  # "" = none
    workload: str = "poisson"  # poisson | closed | trace
    requests: int = 0  # poisson and closed: how many (0: --requests); trace: at most (0 = all)
    rate: float = 1.0  # poisson: requests/s at load x1
    concurrency: int = 0  # closed: this many requests at a time
    prompt: int = 16  # poisson and closed: prompt tokens
    output: int = 64  # poisson and closed: output tokens
    trace: str = ""  # trace: the CSV (default: the Azure conversation trace)
    unit: str = ""  # trace: s or ms, numeric timestamps' unit ("": --timestamp-unit, or none)
    time_scale: float = 1.0  # trace: arrival offsets x this
    length_scale: float = 1.0  # trace: lengths x this
    start: float = 0.0  # trace: the slice's start, seconds
    duration: float = 0.0  # trace: the slice's length (0 = all)
    prompt_from: int = 0  # trace: only the requests with at least this many prompt tokens
    prompt_below: int = 0  # trace: only those with fewer (0: no limit)
    seed: int = 0  # poisson: the arrivals' seed
    until: float = 0.0  # no request of this tenant is sent after this many seconds (0: none)

    def __post_init__(self) -> None:
        where = f"tenant {self.name!r}"
        if not valid_name(self.name):
            raise TenantSpecError(f"{where}: a name is letters, digits, _ . - (up to 64)")
        if self.workload not in KINDS:
            raise TenantSpecError(f"{where}: workload must be one of {', '.join(KINDS)}")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise TenantSpecError(f"{where}: weight must be a number > 0, got {self.weight:g}")
        for key in ("rate", "time_scale", "length_scale"):
            if not getattr(self, key) > 0:
                raise TenantSpecError(f"{where}: {key} must be > 0")
        for key in ("requests", "prompt_from", "prompt_below", "start", "duration", "until"):
            if getattr(self, key) < 0:
                raise TenantSpecError(f"{where}: {key} must be >= 0")
        if self.workload == "closed" and self.concurrency < 1:
            raise TenantSpecError(f"{where}: a closed loop needs concurrency=N (N >= 1)")
        if self.unit not in ("", *UNITS):
            raise TenantSpecError(f"{where}: unit must be s or ms, got {self.unit!r}")
        if self.workload != "trace" and (self.prompt < 1 or self.output < 1):
            raise TenantSpecError(f"{where}: prompt and output must be >= 1 token")

    def tenancy(self, classes: dict[str, SloClass]) -> Tenancy:
        slo = classes.get(self.slo_class, SloClass(self.slo_class))
        return Tenancy(
            self.name, self.weight, self.priority, self.slo_class, slo.ttft_s, slo.tpot_s
        )


_TYPES = {f.name: f.type for f in fields(TenantSpec)}
_ALIASES = {"class": "slo_class", "slo": "slo_class"}


def tenant_of(name: str, options: dict[str, Any]) -> TenantSpec:
    """One tenant from its options (strings from the command line, or a file's values); the
    kind of arrivals follows from concurrency= or trace= when workload= is not given."""
    values: dict[str, Any] = {}
    for raw, value in options.items():
        key = _ALIASES.get(raw, raw).replace("-", "_")
        if key not in _TYPES or key == "name":
            known = ", ".join(k for k in [*_TYPES, "class"] if k not in ("name", "slo_class"))
            raise TenantSpecError(f"tenant {name!r}: unknown key {raw!r} (known: {known})")
        values[key] = _typed(name, raw, _TYPES[key], value)
    if "workload" not in values:
        values["workload"] = (
            "trace" if "trace" in values else "closed" if "concurrency" in values else "poisson"
        )
    return TenantSpec(name, **values)


_KINDS = {"int": (int, "an int"), "float": (float, "a float"), "str": (str, "a str")}


def _typed(tenant: str, key: str, kind: str, value: Any) -> Any:
    cast, named = _KINDS[kind]
    try:
        if cast is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return cast(value)
    except (TypeError, ValueError):
        raise TenantSpecError(f"tenant {tenant!r}: {key}={value!r} is not {named}") from None


def parse_tenants(text: str) -> list[TenantSpec]:
    """`chat:weight=1,priority=0,class=interactive,rate=2;batch:concurrency=64,prompt=600`."""
    out = []
    for item in (part.strip() for part in text.split(";")):
        if not item:
            continue
        name, _, rest = item.partition(":")
        options: dict[str, str] = {}
        for pair in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = pair.partition("=")
            if not eq or not key.strip():
                raise TenantSpecError(f"tenant {name.strip()!r}: {pair!r} is not key=value")
            options[key.strip()] = value.strip()
        out.append(tenant_of(name.strip(), options))
    return checked(out)


def load_tenants_file(path: Path) -> list[TenantSpec]:
    """A JSON (or, with PyYAML, YAML) list of tenants, each an object with a `name`."""
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            import yaml
        except ImportError:
            raise TenantSpecError(f"{path}: not JSON (and PyYAML is not installed)") from None
        data = yaml.safe_load(text)
    if isinstance(data, dict):
        data = data.get("tenants")
    if not isinstance(data, list) or not all(isinstance(t, dict) and "name" in t for t in data):
        raise TenantSpecError(f"{path}: expected a list of tenants, each with a name")
    return checked([tenant_of(str(t["name"]), {k: v for k, v in t.items() if k != "name"})
                    for t in data])  # fmt: skip


def checked(tenants: list[TenantSpec]) -> list[TenantSpec]:
    if not tenants:
        raise TenantSpecError("no tenants given")
    names = [t.name for t in tenants]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TenantSpecError(f"tenant {twice[0]!r} is given twice")
    return tenants


def tenant_workload(
    tenants: list[TenantSpec],
    classes: dict[str, SloClass],
    load: float = 1.0,
    requests: int = 0,
    seed: int = 0,
) -> Workload:
    """The tenants' requests in one workload (open loop: closed-loop tenants as chains), each
    carrying its tenant's Tenancy; `load` multiplies the Poisson rates and compresses the traces'
    arrivals; `requests`: the count of a Poisson or closed tenant that gives none."""
    unknown = [t for t in tenants if t.slo_class and t.slo_class not in classes]
    if unknown:
        named = ", ".join(classes) or "none (--slo-classes)"
        raise TenantSpecError(
            f"tenant {unknown[0].name!r}: SLO class {unknown[0].slo_class!r} is not defined "
            f"(defined: {named})"
        )
    specs: list[RequestSpec] = []
    described = []
    for tenant in tenants:
        made, stated = _requests_of(tenant, load, requests, len(specs))
        tenancy = tenant.tenancy(classes)
        specs += [replace(s, tenancy=tenancy) for s in made if not _late(tenant, s)]
        described.append(_described(tenant) | stated)
    params = {
        "kind": "tenants",
        "load": load,
        "tenants": described,
        "slo_classes": [str(c) for c in classes.values()],
    }
    name = "tenants-" + "+".join(t.name for t in tenants)
    return Workload(name, specs, 0, params, DistinctPrompts(TokenSource(seed=seed)))


def _requests_of(
    tenant: TenantSpec, load: float, default: int, first: int
) -> tuple[list[RequestSpec], dict[str, Any]]:
    """The tenant's requests, numbered from `first`, and what a trace's report states (the
    rows it left out)."""
    if tenant.workload == "trace":
        return _trace_requests(tenant, load, first)
    n = tenant.requests or default
    if n < 1:
        raise TenantSpecError(f"tenant {tenant.name!r}: give requests=N (or --requests)")
    if tenant.workload == "closed":
        c = tenant.concurrency
        return [
            RequestSpec(first + i, tenant.prompt, tenant.output, 0.0 if i < c else None,
                        follows=-1 if i < c else first + i - c)
            for i in range(n)
        ], {}  # fmt: skip
    rng, t, out = random.Random(tenant.seed), 0.0, []
    for i in range(n):
        out.append(RequestSpec(first + i, tenant.prompt, tenant.output, arrival_s=t))
        t += rng.expovariate(tenant.rate * load)
    return out, {}


def _late(tenant: TenantSpec, spec: RequestSpec) -> bool:
    """An open-loop request due after the tenant's `until` (closed loops stop in the run)."""
    return bool(tenant.until) and spec.arrival_s is not None and spec.arrival_s > tenant.until


def sending_until(workload: Workload) -> dict[str, float]:
    """Per tenant with an `until`: the time after which none of its requests is sent."""
    return {t["name"]: t["until"] for t in workload.params.get("tenants", []) if t.get("until")}


def _trace_requests(
    tenant: TenantSpec, load: float, first: int
) -> tuple[list[RequestSpec], dict[str, Any]]:
    path = Path(tenant.trace) if tenant.trace else DEFAULT_TRACE
    trace = read_trace(path, tenant.unit or None)
    scale = TraceScale(
        tenant.length_scale, tenant.time_scale / load, tenant.start, tenant.duration,
        tenant.requests,
    )  # fmt: skip
    rows = [
        r
        for r in scale_trace(trace.rows, scale)
        if r.prompt_tokens >= tenant.prompt_from
        and (not tenant.prompt_below or r.prompt_tokens < tenant.prompt_below)
    ]
    specs = [
        RequestSpec(first + i, r.prompt_tokens, r.output_tokens, r.arrival_s)
        for i, r in enumerate(rows)
    ]
    skipped = trace.describe().get("skipped_rows")
    return specs, {"skipped_rows": skipped} if skipped else {}


def _described(tenant: TenantSpec) -> dict[str, Any]:
    """The tenant's settings that differ from the defaults, with its name, class and kind."""
    default = TenantSpec("x")
    keep = ("name", "weight", "priority", "slo_class", "workload")
    return {
        f.name: getattr(tenant, f.name)
        for f in fields(TenantSpec)
        if f.name in keep or getattr(tenant, f.name) != getattr(default, f.name)
    }
