"""`llmserve bench ...`: serve | sim | calibrate | core. Heavy imports happen inside commands."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from llmcommon.flags import help_of
from llmserve.bench.budget_sweep import positive_list, time_budget_list
from llmserve.bench.goodput import SLO_FORMAT, slo_arg
from llmserve.bench.outdir import check_out_dir
from llmserve.bench.policy import DEFAULT_POLICIES, policy_list
from llmserve.bench.tenants_cmd import add_tenants_parser
from llmserve.bench.workload_args import above, add_workload_flags
from llmserve.client import check_target
from scheduler_svc.config import CoreConfig
from scheduler_svc.settings import SchedulerSettings


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: served stack, simulation, calibration")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    serve = kinds.add_parser(
        "serve",
        help="load-generate against stacks, one per policy, and "
        "against transformers on the same prompts",
    )
    add_workload_flags(serve, requests=64, concurrency=32)
    serve.add_argument(
        "--policies",
        type=policy_list,
        default=DEFAULT_POLICIES,
        help="comma-separated mode+kv; one stack each",
    )
    serve.add_argument(
        "--target",
        type=address,
        default="",
        help="use a running gateway instead of starting stacks; its Status (its scheduler's, "
        "passed on) is sampled during the run",
    )
    serve.add_argument(
        "--status-target",
        type=address,
        default="",
        help="with --target: sample this scheduler's Status directly instead (with "
        "$LLMSERVE_INTERNAL_TOKEN when set; the prefix-cache figures come with it); default: "
        "ask the gateway at --target",
    )
    serve.add_argument(
        "--backend",
        choices=("grpc", "openai"),
        default="grpc",
        help="grpc: this stack's gateway (stacks per policy, or --target); openai: the "
        "OpenAI-compatible servers of --base-url (this stack's --http-port, llama-server, vLLM)",
    )
    serve.add_argument(
        "--base-url",
        action="append",
        default=[],
        metavar="[LABEL=]URL",
        help="--backend openai: a server's API root, e.g. ours=http://127.0.0.1:8000/v1; "
        "repeat it to run the workload against each, side by side in one report",
    )
    serve.add_argument(
        "--concurrencies",
        default="",
        metavar="C,C,...",
        help="--backend openai, --workload fixed: run the workload at each of these closed-loop "
        "concurrencies against every --base-url, one column per server and concurrency in one "
        "report (with --requests 0: 2 x C requests each, at least 8)",
    )
    serve.add_argument(
        "--api-model",
        default="",
        help="--backend openai: the model to ask for (default: the server's first in /v1/models)",
    )
    serve.add_argument(
        "--api-key", default="none", help="--backend openai: the Bearer key (default: none)"
    )
    serve.add_argument("--model", default="smollm2")
    serve.add_argument("--dtype", default="bf16")
    serve.add_argument("--workers", type=int, default=1)
    serve.add_argument(
        "--token-budget",
        type=int,
        default=0,
        help="0: enough for a whole batch of prompts (concurrency x prompt), at least 256",
    )
    serve.add_argument("--max-running", type=int, default=0, help="0: the concurrency")
    _time_budget_flag(serve, "; each stack's scheduler")
    _sweep_flags(serve, "one stack per budget and policy, or, with --target, the running stack's "
                 "budgets set live (needs --admin-key-file)")  # fmt: skip
    serve.add_argument(
        "--sweep-rounds",
        type=int,
        default=1,
        help="sweep mode: run the budgets this many times, every second round in reverse order "
        "(drift on a shared host then hits both ends alike); a verdict per round",
    )
    serve.add_argument(
        "--admin-key-file",
        type=Path,
        default=None,
        help="with --target: the stack's admin key, sent with the gateway's Status (the "
        "operator's figures); sweep mode: to set each budget live",
    )
    serve.add_argument(
        "--cost-model",
        type=Path,
        default=None,
        help="each stack's scheduler: " + help_of(SchedulerSettings, "cost_model"),
    )
    serve.add_argument("--kv-capacity", type=int, default=16384)
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per worker and for transformers (on a shared machine "
        "1 is steadier than oversubscribed OpenMP threads)",
    )
    serve.add_argument(
        "--baselines",
        default="static,generate_batch",
        help="transformers baselines (static, generate_batch) or 'none'",
    )
    serve.add_argument(
        "--hf-attention",
        default="eager",
        help="transformers' attention implementation for the baselines (eager measured faster "
        "than sdpa for generate on this CPU: 258-281 vs 212-219 output tokens/s)",
    )
    serve.add_argument(
        "--poll",
        type=above(0.0),
        default=None,
        help="seconds between the scheduler's Status samples (the KV and peak-running rows), "
        "on every stack the command runs (default: 0.25; not with --backend openai)",
    )
    serve.add_argument(
        "--timeout",
        type=above(0.0),
        default=None,
        help="per-request deadline, seconds from sending; a request past it fails "
        "(DEADLINE_EXCEEDED); default: none",
    )
    _slo_flag(serve)
    _out_flags(serve, "serve")
    serve.set_defaults(func=_cmd_serve)

    sim = kinds.add_parser(
        "sim",
        help="the real scheduler core on a virtual clock with a "
        "calibrated cost model (the whole trace in minutes)",
    )
    add_workload_flags(sim, requests=0, concurrency=0, workload="trace", tenants=True)
    sim.add_argument(
        "--policies",
        type=policy_list,
        default="continuous+paged,continuous+reserve,static+reserve",
        help="comma-separated mode+kv, e.g. continuous+paged,static+reserve",
    )
    sim.add_argument(
        "--loads",
        type=load_list,
        default="1",
        help="comma-separated load factors: the trace's "
        "arrivals compressed by each (time_scale = 1/load x --time-scale)",
    )
    sim.add_argument("--cost-model", type=Path, default=None, help="JSON from `bench calibrate`")
    sim.add_argument(
        "--speedup",
        type=float,
        default=20.0,
        help="the cost model's times divided by this (hardware faster than this CPU)",
    )
    sim.add_argument("--sim-workers", type=int, default=4)
    sim.add_argument(
        "--sim-worker-speeds",
        default="",
        metavar="S,S,...",
        help="each simulated worker's speed, times --speedup (e.g. 1,1,0.5,0.5: two of them "
        "half as fast); one per --sim-workers; default: all 1",
    )
    sim.add_argument("--kv-capacity", type=int, default=500_000, help="positions per worker")
    sim.add_argument("--token-budget", type=int, default=8192)
    _time_budget_flag(sim, "; the simulated scheduler's online model learns each simulated "
                      "worker's step times")  # fmt: skip
    _sweep_flags(sim, "at each load and policy")
    _speculative_flags(sim)
    sim.add_argument("--max-running", type=int, default=256)
    sim.add_argument("--max-context", type=int, default=32768)
    sim.add_argument("--block-size", type=int, default=16)
    sim.add_argument(
        "--step-overhead",
        type=float,
        default=0.0,
        help="virtual seconds added to every step (scheduling + RPC)",
    )
    sim.add_argument(
        "--ttft-slo",
        type=float,
        default=5.0,
        help="p99 TTFT target (s) for 'throughput at equal p99 TTFT'",
    )
    sim.add_argument(
        "--baseline-rev",
        default="",
        help="also simulate every load and policy with the scheduler core of this git "
        "revision, and print the core's real µs per step side by side (e.g. bc5c0ff)",
    )
    _cells_flags(sim)
    _slo_flag(sim)
    _out_flags(sim, "sim")
    sim.set_defaults(func=_cmd_sim)

    cal = kinds.add_parser(
        "calibrate", help="time the real worker's executions; fit the cost model"
    )
    cal.add_argument("--model", default="smollm2")
    cal.add_argument("--dtype", default="bf16")
    cal.add_argument("--threads", type=int, default=2)
    cal.add_argument(
        "--quantization",
        choices=("none", "int8", "int4", "auto"),
        default="auto",
        help="the weights as the worker to be predicted runs them (the worker's default: auto)",
    )
    cal.add_argument("--quick", action="store_true", help="a smaller grid")
    cal.add_argument("--repeats", type=int, default=5)
    cal.add_argument(
        "--output",
        type=Path,
        default=None,
        help="default: data/cost_models/MODEL-DTYPE-QUANTIZATION-cpu.json (without "
        "-QUANTIZATION for none: the simulator's default file is smollm2-bf16-cpu.json)",
    )
    cal.set_defaults(func=_cmd_calibrate)

    over = kinds.add_parser(
        "overhead",
        help="the control plane at GPU-class step times: real processes, simulated workers",
    )
    over.add_argument("--step-ms", default="2,5,20", help="simulated execution times (ms)")
    over.add_argument("--running", default="32,256", help="concurrent streams, in all")
    over.add_argument("--workers", default="1,4", help="simulated workers")
    over.add_argument("--window", type=float, default=4.0, help="seconds measured per config")
    over.add_argument(
        "--repeats", type=int, default=1, help="runs per config; the median (by busy) is shown"
    )
    over.add_argument("--max-tokens", type=int, default=4000, help="per request (closed loop)")
    over.add_argument(
        "--stream-interval-ms",
        type=float,
        default=50.0,
        help="the scheduler gathers token events this long (one message per request)",
    )
    _out_flags(over, "overhead")
    over.set_defaults(func=_cmd_overhead)

    sample = kinds.add_parser(
        "hash-sample",
        help="write a synthetic trace with per-block content hashes (Mooncake's JSONL format)",
    )
    sample.add_argument("--requests", type=int, default=200)
    sample.add_argument("--rate", type=above(0.0), default=2.0, help="requests/s (Poisson), > 0")
    sample.add_argument("--prefixes", type=int, default=4, help="shared prefixes")
    sample.add_argument("--prefix-blocks", type=int, default=4, help="512-token blocks in each")
    sample.add_argument(
        "--shared-share", type=float, default=0.6, help="of new requests, those on a prefix"
    )
    sample.add_argument(
        "--followup-share", type=float, default=0.4, help="of requests, next turns of earlier ones"
    )
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--output", type=Path, default=None, help="default: the sample trace")
    sample.set_defaults(func=_cmd_hash_sample)

    core = kinds.add_parser("core", help="microseconds per schedule() vs running/admitted/queue")
    core.add_argument("--quick", action="store_true")
    core.add_argument("--rounds", type=int, default=3, help="measurements per row; the fastest")
    core.add_argument(
        "--baseline-rev",
        default="",
        help="also measure the core of this git revision, side by side (e.g. 47d2b63, the "
        "lock-step core before per-worker loops)",
    )
    core.add_argument(
        "--prefix-revs",
        default="",
        help="comma-separated revisions for the prefix-cache table (default: --baseline-rev), "
        "each measured in turn with this core, e.g. 9a8d3e1,bc5c0ff",
    )
    core.add_argument(
        "--prefix-only",
        action="store_true",
        help="only the prefix-cache table (PrefixSteady: 256 running, 15,360-token prompts)",
    )
    core.add_argument(
        "--tenants",
        type=int,
        default=0,
        help="this tree's requests belong to N tenants in turn (the baseline's to none)",
    )
    core.add_argument(
        "--queue-policy",
        default="",
        choices=["", "fcfs", "priority", "fair", "deadline"],
        help="this tree's queue ordering (the baseline keeps its own default)",
    )
    _out_flags(core, "core")
    core.set_defaults(func=_cmd_core)
    add_tenants_parser(kinds)


def _speculative_flags(p: argparse.ArgumentParser) -> None:
    """The core's speculative decoding (the simulated worker verifies drafts greedily)."""
    for name in ("speculative", "speculative_length"):
        field = CoreConfig.__dataclass_fields__[name]
        p.add_argument(
            "--" + name.replace("_", "-"),
            choices=[m.value for m in type(field.default)],
            default=field.default.value,
            help=help_of(CoreConfig, name),
        )


def _time_budget_flag(p: argparse.ArgumentParser, where: str) -> None:
    p.add_argument(
        "--step-time-budget-ms",
        type=float,
        default=0.0,
        help=help_of(CoreConfig, "step_time_budget_ms") + where,
    )
    p.add_argument(
        "--step-time-window",
        type=int,
        default=1,
        help=help_of(CoreConfig, "step_time_window"),
    )


def _sweep_flags(p: argparse.ArgumentParser, where: str) -> None:
    p.add_argument(
        "--sweep-token-budgets",
        type=positive_list(int),
        default=None,
        metavar="N,N,...",
        help="sweep mode: one run per token budget (and per --sweep-time-budgets-ms), the same "
        f"arrivals, {where}; one table, goodput against --slo",
    )
    p.add_argument(
        "--sweep-time-budgets-ms",
        type=time_budget_list,
        default=None,
        metavar="T,T,TxW,...",
        help="sweep mode: one run per step-time budget, each under the cap --token-budget; TxW: "
        "T held on average over W steps (--step-time-window)",
    )


def _cells_flags(p: argparse.ArgumentParser) -> None:
    from gateway.routing import RouterSettings
    from llmcommon.flags import help_of

    g = p.add_argument_group("cells (several schedulers behind the gateway's router)")
    g.add_argument(
        "--cells",
        type=int,
        default=0,
        help="simulate this many cells, each a scheduler with --sim-workers workers, behind "
        "the router; 0 = one scheduler (no router)",
    )
    g.add_argument(
        "--router",
        default="cache-aware,round-robin,least-loaded,session,single",
        help="with --cells: the router policies to compare, comma-separated; single = one "
        "scheduler over all the cells' workers (the same total KV)",
    )
    defaults = RouterSettings()
    for name in (
        "cache_threshold",
        "balance_abs_threshold",
        "balance_rel_threshold",
        "load_weight",
        "index_blocks",
        "recent_half_life_s",
    ):
        value = getattr(defaults, name)
        g.add_argument(
            "--router-" + name.replace("_", "-"),
            dest=f"router_{name}",
            type=type(value),
            default=None,
            help=f"{help_of(RouterSettings, name)} (default: {value})",
        )


def _slo_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--slo",
        type=slo_arg,
        default=None,
        metavar="ttft=S,tpot=S",
        help=f"latency targets: {SLO_FORMAT}; the report gives the goodput, the requests per "
        "second that meet both (TTFT, and time per output token after the first averaged "
        "over the request: DistServe's definition)",
    )


def _out_flags(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--out", type=Path, default=Path("results/bench"))
    p.add_argument("--name", default=name, help="file name prefix of the report")
    p.add_argument("--no-progress", action="store_true")


def address(text: str) -> str:
    """An argparse type: a gRPC address whose port is 1 to 65535, or "" (none given)."""
    try:
        return check_target(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def load_list(text: str) -> str:
    """An argparse type: comma-separated load factors, each > 0 (kept as text)."""
    for item in text.split(","):
        try:
            load = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not a number") from None
        if not 0 < load < float("inf"):
            raise argparse.ArgumentTypeError(f"{item.strip()!r}: each load must be > 0")
    return text


def _command() -> str:
    return "llmserve " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _cmd_serve(args: argparse.Namespace) -> int:
    from llmserve.bench.run_serve import run_serve
    from llmserve.bench.workload_args import build_workload

    check_out_dir(args.out)  # before the run, not after it
    workload = build_workload(args, served=True)
    if args.sweep_token_budgets or args.sweep_time_budgets_ms:
        from llmserve.bench.run_serve_sweep import run_serve_sweep

        return run_serve_sweep(args, workload, _command())
    return run_serve(args, workload, _command())


def _cmd_sim(args: argparse.Namespace) -> int:
    check_out_dir(args.out)
    if args.sweep_token_budgets or args.sweep_time_budgets_ms:
        from llmserve.bench.run_budget_sweep import run_budget_sweep

        return run_budget_sweep(args, _command())
    from llmserve.bench.run_sim import run_sim

    return run_sim(args, _command())


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from llmserve.bench.calibrate import calibrate, default_output, fit_summary

    model = calibrate(
        args.model, args.dtype, args.threads, args.quick, args.repeats,
        quantization=args.quantization,
    )  # fmt: skip
    path = args.output or default_output(args.model, args.dtype, args.quantization)
    model.save(path)
    print(f"{fit_summary(model)} -> {path}")
    return 0


def _cmd_overhead(args: argparse.Namespace) -> int:
    from llmserve.bench.run_overhead import run_overhead

    check_out_dir(args.out)
    return run_overhead(args, _command())


def _cmd_hash_sample(args: argparse.Namespace) -> int:
    from llmserve.bench import hash_trace as ht

    shape = ht.SampleShape(
        requests=args.requests,
        rate=args.rate,
        prefixes=args.prefixes,
        prefix_blocks=args.prefix_blocks,
        shared_share=args.shared_share,
        followup_share=args.followup_share,
        seed=args.seed,
    )
    path = args.output or ht.SAMPLE_TRACE
    ht.write_trace(ht.sample_trace(shape), path)
    print(f"wrote {path}: {args.requests} requests, {ht.reuse_text(ht.load_hash_trace(path))}")
    return 0


def _cmd_core(args: argparse.Namespace) -> int:
    from llmserve.bench.run_core import run_core

    check_out_dir(args.out)
    return run_core(args, _command())
