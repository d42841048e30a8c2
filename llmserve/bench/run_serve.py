"""`llmserve bench serve`: the policies side by side on one workload, then transformers."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from llmcommon.admin_auth import admin_key
from llmserve.bench import hf_baseline
from llmserve.bench.caching import caching_pairs, print_caching
from llmserve.bench.errors import BenchError
from llmserve.bench.openai_backend import parse_base_urls, run_openai
from llmserve.bench.plots import write_plots
from llmserve.bench.policy import DEFAULT_POLICIES, parse_policies
from llmserve.bench.prompts import check_with_tokenizer
from llmserve.bench.report import Report, print_table
from llmserve.bench.served import POLL_S, run_policy, run_workload
from llmserve.bench.stats import ratio
from llmserve.bench.task_prompts import PROMPTS as TASKS
from llmserve.bench.task_prompts import task_workload
from llmserve.bench.workload import Workload, fixed
from llmserve.stack import StackSettings

HF_STATIC, HF_BATCH = "transformers static", "transformers generate_batch"


def stack_settings(args: argparse.Namespace, workload: Workload) -> StackSettings:
    longest = max(r.prompt_tokens for r in workload.requests)
    budget = args.token_budget or max(256, (workload.concurrency or 1) * longest)
    return StackSettings(
        model=args.model,
        dtype=args.dtype,
        workers=args.workers,
        token_budget=budget,
        max_running=args.max_running or workload.concurrency or 32,
        kv_capacity=args.kv_capacity,
        block_size=args.block_size,
        threads=args.threads,
        step_time_budget_ms=args.step_time_budget_ms,
        step_time_window=args.step_time_window,
        cost_model=str(args.cost_model or ""),
    )


def run_serve(args: argparse.Namespace, workload: Workload, command: str) -> int:
    check_backend_flags(args)
    check_poll_and_timeout(args, workload)
    check_with_tokenizer()
    progress = not args.no_progress
    loads = openai_loads(args, workload) if args.backend == "openai" else [("", workload)]
    if loads[0][0]:  # --concurrencies: the report describes every level
        workload = levels_workload([load for _, load in loads])
        described = workload.describe() | {"loop": "closed loop, " + ", ".join(
            f"{load.concurrency} clients ({len(load.requests)} requests)" for _, load in loads
        )}  # fmt: skip
    else:
        described = workload.describe()
    report = Report(f"llmserve bench serve: {workload.name}", described, command, slo=args.slo)
    if not workload.closed:  # a unit slip shows here, not hours later
        print(planned(workload), flush=True)
    if args.backend == "openai":
        if not args.base_url:
            raise SystemExit("--backend openai needs --base-url URL (one or more)")
        for label, load in loads:
            for server, url in parse_base_urls(args.base_url):
                result = asyncio.run(
                    run_openai(server + label, url, load, args.api_model, args.api_key,
                               progress, timeout_s=args.timeout)
                )  # fmt: skip
                _say(report.add(result))
    elif args.target:
        result = asyncio.run(
            run_workload(
                args.target,
                args.status_target,
                workload,
                "served",
                progress,
                args.poll or POLL_S,
                timeout_s=args.timeout,
                **status_options(args),
            )
        )
        _say(report.add(result))
    else:
        base = stack_settings(args, workload)
        for policy in parse_policies(args.policies, args.prefix_caching):
            result = run_policy(base, policy, workload, args.out / "logs" / args.name, progress,
                                poll_s=args.poll or POLL_S, timeout_s=args.timeout)  # fmt: skip
            _say(report.add(result))
    baselines = [b for b in args.baselines.split(",") if b and b != "none"]
    if baselines:
        for result in _transformers(args, workload, baselines):
            _say(report.add(result))
    summaries = report.summaries()
    report.extra["ratios"] = ratios(summaries)
    report.extra["prefix_caching"] = pairs = caching_pairs(summaries)
    notes = _notes(report, described)
    report.extra["notes"] = notes
    reference = HF_STATIC if any(s["label"] == HF_STATIC for s in summaries) else None
    print_table(report.title, summaries, reference, notes)
    print_caching(pairs, workload.params.get("trace_reuse"))
    paths = report.write(args.out, args.name)
    paths += write_plots(args.out, args.name, summaries, report.results, _subtitle(workload))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(s["ok"] == s["requests"] and s["exact_lengths"] is not False
                    for s in summaries) else 1  # fmt: skip


def planned(workload: Workload) -> str:
    """An open loop's arrivals and their span, said before the run."""
    span = max((r.arrival_s or 0.0 for r in workload.requests), default=0.0)
    return f"open loop: {len(workload.roots)} arrivals over {span:,.1f} s ({span / 3600:.2f} h)"


def status_options(args: argparse.Namespace) -> dict[str, str]:
    """run_workload's keywords for a run against --target: where its Status is sampled from
    (--status-target, or the gateway itself), and the admin key that goes with the gateway's."""
    key = admin_key(args.admin_key_file) if args.admin_key_file else ""
    flag = "--status-target" if args.status_target else "--target; or give --status-target"
    return {"admin_key": "" if args.status_target else key, "status_flag": flag}


# flags of one backend (or of the stacks the command starts), with their defaults
OPENAI_ONLY = {"base_url": [], "api_model": "", "api_key": "none", "concurrencies": ""}
NOT_OPENAI = {
    "target": "",
    "status_target": "",
    "admin_key_file": None,
    "policies": DEFAULT_POLICIES,
    "prefix_caching": "",
    "workers": 1,
    "token_budget": 0,
    "max_running": 0,
    "kv_capacity": 16384,
    "block_size": 16,
    "cost_model": None,
}
# flags of the stacks the command starts, which a run against --target (a running stack) cannot set
STACK_FLAGS = ("policies", "prefix_caching", "workers", "token_budget", "max_running",
               "kv_capacity", "block_size", "cost_model")  # fmt: skip
STACK_ONLY = {n: NOT_OPENAI[n] for n in STACK_FLAGS}


def check_backend_flags(args: argparse.Namespace) -> None:
    """A flag the chosen backend does not apply is refused, not ignored."""
    openai = args.backend == "openai"
    unused = NOT_OPENAI if openai else OPENAI_ONLY
    given = [n for n, default in unused.items() if getattr(args, n, default) != default]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise BenchError(
            f"{flag} does not apply to --backend {args.backend}: "
            + (
                "the OpenAI-compatible servers of --base-url are measured as they run"
                if openai
                else "it is for --backend openai (give --backend openai, or leave it out)"
            )
        )
    if not openai and not args.target:
        for name in ("status_target", "admin_key_file"):
            if getattr(args, name, None):
                raise BenchError(f"--{name.replace('_', '-')} is for a run against --target "
                                 "(the stacks this command starts are asked directly)")  # fmt: skip
    if not openai and args.target:
        given = [n for n, default in STACK_ONLY.items() if getattr(args, n, default) != default]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise BenchError(
                f"{flag} does not apply with --target: the running stack is measured with the "
                "settings it has (change them live with `llmserve set`, or leave --target out "
                "to start stacks with these flags)"
            )


def check_poll_and_timeout(args: argparse.Namespace, workload: Workload) -> None:
    """--poll and --timeout hold for every run of the command, or the command is refused."""
    if args.backend == "openai" and args.poll is not None:
        raise BenchError(
            "--poll does not apply to --backend openai: an OpenAI-compatible server has no "
            "scheduler Status to sample (leave --poll out)"
        )
    if args.timeout is not None and baselines_run(args, workload):
        raise BenchError(
            "--timeout does not apply to the transformers baselines (they run in this process "
            "with no per-request deadline): add --baselines none, or leave --timeout out"
        )


def baselines_run(args: argparse.Namespace, workload: Workload) -> bool:
    """Whether transformers baselines are asked for and can run on this workload."""
    asked = [b for b in args.baselines.split(",") if b and b != "none"]
    return bool(asked) and workload.closed and args.model == "smollm2"


def openai_loads(args: argparse.Namespace, workload: Workload) -> list[tuple[str, Workload]]:
    """(label suffix, workload) per --concurrencies value; the workload itself without it."""
    if not args.concurrencies:
        return [("", workload)]
    if args.workload not in ("fixed", *TASKS):
        raise SystemExit("--concurrencies needs --workload fixed, repetitive or open")
    try:
        levels = [int(c) for c in args.concurrencies.split(",")]
    except ValueError:
        raise SystemExit(f"--concurrencies: integers, not {args.concurrencies!r}") from None
    if any(c < 1 for c in levels):
        raise SystemExit("--concurrencies: each at least 1")
    out = []
    for c in levels:
        n = args.requests or max(8, 2 * c)
        if args.workload in TASKS:
            load = task_workload(args.workload, n, args.output_tokens, c, args.seed)
        else:
            load = fixed(n, args.prompt_tokens, args.output_tokens, c)
        out.append((f" c={c}", load))
    return out


def levels_workload(loads: list[Workload]) -> Workload:
    """One description of the --concurrencies runs (each level runs its own workload)."""
    first = loads[0]
    levels = ",".join(str(load.concurrency) for load in loads)
    kind = first.name.split("-")[0]
    name = f"{kind}-c{levels}x{first.params.get('prompt_len', '')}+{first.params['output_len']}"
    specs = [spec for load in loads for spec in load.requests]
    return Workload(name, specs, 0, first.params | {"concurrencies": levels}, first.content)


def _transformers(args: argparse.Namespace, workload: Workload, which: list[str]) -> list:
    if not workload.closed or args.model != "smollm2":
        print("transformers baselines skipped: they need a closed-loop workload on smollm2")
        return []
    print(f"transformers baselines ({', '.join(which)}): loading the model ...", flush=True)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model = hf_baseline.load_hf_model(args.dtype, args.hf_attention)
    out = []
    if "static" in which:
        out.append(hf_baseline.run_static(model, workload, workload.concurrency))
    if "generate_batch" in which:
        result = hf_baseline.run_generate_batch(model, workload, workload.concurrency)
        if result is None:
            print("generate_batch skipped: absent, or the output lengths differ")
        else:
            out.append(result)
    return out


def ratios(summaries: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Output tokens/s of each served run over each transformers baseline."""
    tok = {s["label"]: s["throughput"]["output_tokens_per_s"] for s in summaries}
    bases = [b for b in (HF_STATIC, HF_BATCH) if b in tok]
    served = [s["label"] for s in summaries if s["kind"] == "served"]
    return {
        label: {f"vs {b}": ratio(tok[label], tok[b]) for b in bases} for label in served if bases
    }


def _notes(report: Report, described: dict[str, Any]) -> list[str]:
    load = report.machine_start.get("load_average_1m")
    notes = [
        f"prompts: {described['prompts']}",
        f"workload: {described}",
        f"machine: {report.machine_start.get('cpus')} CPUs, 1-min load average at start "
        f"{load:.1f} (other work on the machine makes these figures noisy)"
        if load
        else "",
    ]
    if described.get("skipped_rows"):
        notes.append(f"trace rows left out: {described['skipped_rows']} ({described['trace']})")
    if any(r.finish == "client_stop" for result in report.results for r in result.records):
        notes.append(
            "max_tokens is above the output lengths: clients stop reading at the length "
            "(as if the model ended there), so the server's usage, and with it the queue "
            "time, does not come back for those requests"
        )
    notes += _basis_notes(report.summaries())
    for label, rs in report.extra.get("ratios", {}).items():
        parts = [f"{v:.2f}× {k.removeprefix('vs ')}" for k, v in rs.items() if v]
        if parts:
            notes.append(f"{label}: " + ", ".join(parts))
    return [n for n in notes if n]


def _basis_notes(summaries: list[dict[str, Any]]) -> list[str]:
    """Where an OpenAI-compatible server's token counts are chunks, not its usage."""
    notes = []
    for s in summaries:
        if "chunks" in s.get("tokens_basis", ""):
            notes.append(
                f"{s['label']}: tokens counted from {s['tokens_basis']}: where the server gave "
                "no usable usage, each chunk with text counts as one token, and a chunk may "
                "carry several (counts, TPOT, the stop at the output length and tokens/s are "
                "then unverified)"
                + (f"; {', '.join(s['usage_notes'])}" if s.get("usage_notes") else "")
            )
    return notes


def _subtitle(workload: Workload) -> str:
    p = workload.params
    time = p.get("time_scale")
    scale = f", length×{p['length_scale']:g}" if "length_scale" in p else ""
    scale += f", time×{time:g}" if isinstance(time, int | float) else ""
    return f"{workload.name}: {len(workload.requests)} requests{scale}"


def _say(summary: dict[str, Any]) -> None:
    t = summary["throughput"]
    print(
        f"{summary['label']}: {summary['ok']}/{summary['requests']} ok, "
        f"{t['output_tokens_per_s']:.0f} output tokens/s, {t['requests_per_s']:.2f} req/s",
        flush=True,
    )
