"""The tenant flags of `bench sim` (--tenants, --tenants-file, --slo-classes, --queue-policies)
and the workload they describe."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from llmcommon.tenancy import TenancyError, parse_slo_classes
from llmserve.bench.policy import queue_list
from llmserve.bench.tenants import (
    TenantSpecError,
    load_tenants_file,
    parse_tenants,
    tenant_workload,
)
from llmserve.bench.workload import Workload
from scheduler_svc.config import QueuePolicy

TENANT_KEYS = (
    "weight, priority (lower first), class, workload (poisson|closed|trace), requests, rate, "
    "concurrency, prompt, output, trace, time_scale, length_scale, start, duration, "
    "prompt_from, prompt_below, seed"
)


def add_tenant_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tenants")
    g.add_argument(
        "--tenants",
        default="",
        metavar="NAME:KEY=V,...;NAME:...",
        help=f"a workload of tenants, each with its own arrivals (keys: {TENANT_KEYS}); "
        "replaces --workload; e.g. 'chat:class=interactive,concurrency=1,prompt=24,output=24;"
        "batch:priority=5,class=batch,concurrency=64,prompt=600,output=256'",
    )
    g.add_argument(
        "--tenants-file",
        type=Path,
        default=None,
        help="the tenants as a JSON (or YAML) list of objects with a name and the same keys",
    )
    g.add_argument(
        "--slo-classes",
        default="",
        metavar="NAME=ttft:S,tpot:S ...",
        help="the SLO classes tenants name (e.g. 'interactive=ttft:1,tpot:0.1 batch=ttft:30')",
    )
    g.add_argument(
        "--queue-policies",
        type=queue_list,
        default="",
        metavar="P,P,...",
        help="each policy once per waiting-queue ordering ("
        + ", ".join(q.value for q in QueuePolicy)
        + "), the same arrivals, side by side; default: the core's (fcfs)",
    )


def wants_tenants(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "tenants", "") or getattr(args, "tenants_file", None))


def tenants_from_args(args: argparse.Namespace, time_scale: float) -> Workload:
    """--tenants (or --tenants-file) at load --time-scale / `time_scale`; SystemExit naming
    what is wrong."""
    try:
        if args.tenants and args.tenants_file:
            raise TenantSpecError("give --tenants or --tenants-file, not both")
        tenants = (
            load_tenants_file(args.tenants_file)
            if args.tenants_file
            else parse_tenants(args.tenants)
        )
        unit = getattr(args, "timestamp_unit", None)
        if unit:  # the trace tenants' default
            tenants = [replace(t, unit=t.unit or unit) if t.workload == "trace" else t
                       for t in tenants]  # fmt: skip
        classes = parse_slo_classes(args.slo_classes)
        load = args.time_scale / time_scale
        made = tenant_workload(tenants, classes, load, args.requests, args.seed)
    except (TenantSpecError, TenancyError, OSError) as e:
        raise SystemExit(f"llmserve bench sim: {e}") from None
    for tenant in made.params["tenants"]:
        if tenant.get("skipped_rows"):
            print(f"tenant {tenant['name']}: trace rows left out: {tenant['skipped_rows']}")
    return made
