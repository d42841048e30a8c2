"""The `llmserve` command: up, generate, status, demo, bench."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import grpc

from llmserve import client
from llmserve.auth import INTERNAL_TOKEN_HELP, internal_token
from llmserve.flags import add_flags, from_args
from llmserve.prometheus import DASHBOARD, Prometheus, start_for_stack
from llmserve.stack import Stack, StackSettings

REASONS = {
    "token_budget": "the execution-token budget is used up this step",
    "max_running": "the running-request limit is reached",
    "kv_capacity": "the KV data itself would not fit",
    "kv_reserved": "the data would fit, but reservations hold the space",
    "static_batch": "static batching: waiting for the batch to drain",
}


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGINT, _interrupt)  # also when started in the background
    signal.signal(signal.SIGTERM, _interrupt)
    settings = from_args(StackSettings, args)
    stack = Stack(settings, Path(args.log_dir))
    print(
        f"starting {settings.workers} worker(s), scheduler and gateway ({settings.model}, "
        f"{settings.policy}, {settings.mode}); logs in {args.log_dir}/",
        flush=True,
    )
    stack.start()
    print(f"gateway   {settings.gateway}   (llmserve generate --target {settings.gateway} ...)")
    if settings.http_url:
        print(f"http      {settings.http_url}   (OpenAI-compatible; curl .../v1/models)")
    status = f"llmserve status --target {settings.scheduler} {' '.join(settings.token_flags)}"
    print(f"scheduler {settings.scheduler}   ({status.strip()})")
    for i in range(settings.workers):
        print(f"worker{i}   {settings.worker_address(i)}")
    if settings.metrics_base_port:
        print(
            f"metrics   http://127.0.0.1:{settings.metrics_port(0)}/metrics (gateway), "
            f"+1 scheduler, +2.. workers"
        )
    prometheus = _start_prometheus(settings, args)
    print("Ctrl-C stops everything.", flush=True)
    try:
        while all(p.poll() is None for p in stack.procs.values()):
            time.sleep(0.5)
        print("a service exited; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...")
        return 0
    finally:
        if prometheus is not None:
            prometheus.stop()
        codes = stack.stop()
        print("stopped: " + ", ".join(f"{n} exit {c}" for n, c in codes.items()))


def _start_prometheus(settings: StackSettings, args: argparse.Namespace) -> Prometheus | None:
    """Prometheus scraping the stack when asked for and installed; says where to look."""
    if not settings.metrics_base_port:
        return None
    workdir = Path(args.log_dir) / "prometheus"
    try:
        prometheus = start_for_stack(settings, args.prometheus_port, workdir)
    except (OSError, RuntimeError) as err:
        print(f"prometheus did not start ({err}); the metrics endpoints still work")
        prometheus = None
    if prometheus is not None:
        print(f"prometheus {prometheus.url}   (config {workdir}/prometheus.yml)")
    elif args.prometheus_port and not shutil.which("prometheus"):
        print("prometheus is not installed (`make prometheus` installs Debian's package)")
    where = prometheus.url if prometheus else "your Prometheus"
    print(f"dashboard {DASHBOARD}")
    print(f"          (import into Grafana with a datasource at {where}; docs/observability.md)")
    return prometheus


def cmd_generate(args: argparse.Namespace) -> int:
    messages = [("user", args.prompt)] if args.chat else None
    request = client.make_request(
        prompt=None if args.chat else args.prompt,
        messages=messages,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    text, final = [], None
    try:
        stream = client.stream(
            args.target, request, timeout=args.timeout, api_key=args.api_key, tls_ca=args.tls_ca
        )
        for message in stream:
            if message.HasField("delta"):
                text.append(message.delta.text)
                if not args.json:
                    print(message.delta.text, end="", flush=True)
            else:
                final = message.final
    except grpc.RpcError as err:
        print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    reason = client.FINISH_NAMES[final.finish_reason]
    if args.json:
        print(
            json.dumps(
                {
                    "request_id": final.request_id,
                    "text": "".join(text),
                    "finish_reason": reason,
                    "usage": client.usage_dict(final.usage),
                }
            )
        )
    else:
        u = final.usage
        print(
            f"\n[{reason}; {u.prompt_tokens} prompt + {u.completion_tokens} generated tokens; "
            f"queue {u.queue_time_s:.3f} s, first token {u.time_to_first_token_s:.3f} s, "
            f"total {u.total_time_s:.3f} s]",
            file=sys.stderr,
        )
    return 0


def status_dict(reply) -> dict:
    keys = [
        "policy",
        "mode",
        "token_budget",
        "max_running",
        "block_size",
        "chunked_prefill",
        "model",
        "max_context",
        "steps",
        "waiting",
        "waiting_tokens",
        "running",
        "head_wait_reason",
        "admitted",
        "finished",
        "preemptions",
        "oldest_wait_s",
        "overlap",
    ]
    out = {k: getattr(reply, k) for k in keys}
    out["stalls"] = dict(reply.stalls)
    out["refused"] = dict(reply.refused)
    out["workers"] = [
        {
            "name": w.name,
            "capacity": w.capacity,
            "written": w.written,
            "reserved_unwritten": w.reserved_unwritten,
            "free": w.free,
            "running": w.running,
            "healthy": w.healthy,
            "draining": w.draining,
            "address": w.address,
            "block_size": w.block_size,
            "max_context": w.max_context,
            "steps": w.steps,
            "stalls": dict(w.stalls),
            "forward_seconds": w.forward_seconds,
            "step_bytes": w.step_bytes,
        }
        for w in reply.workers
    ]
    return out


def format_status(s: dict) -> str:
    head = s["head_wait_reason"]
    lines = [
        f"model {s['model']}  policy {s['policy']}  mode {s['mode']}  budget {s['token_budget']}"
        f"  max running {s['max_running']}  block size {s['block_size']}"
        f"  chunked prefill {'on' if s['chunked_prefill'] else 'off'}"
        f"  overlap {'on' if s['overlap'] else 'off'}",
        f"steps {s['steps']}  admitted {s['admitted']}  finished {s['finished']}"
        f"  preemptions {s['preemptions']}",
        f"waiting {s['waiting']} ({s['waiting_tokens']} tokens, oldest {s['oldest_wait_s']:.2f} s)"
        f"  running {s['running']}",
        f"head of queue waits: {head} ({REASONS.get(head, '')})"
        if head
        else "head of queue waits: nothing waits",
        f"workers ({len(s['workers'])}), KV in positions:",
    ]
    for w in s["workers"]:
        state = "" if w["healthy"] else "  UNHEALTHY"
        state += "  DRAINING" if w["draining"] else ""
        stalls = ", ".join(f"{k} {v}" for k, v in sorted(w["stalls"].items()))
        lines.append(
            f"  {w['name']:<10} {w['address']:<21} block {w['block_size']:>3}  "
            f"context {w['max_context']:>6}  steps {w['steps']:>7}{state}\n"
            f"  {'':<10} capacity {w['capacity']:>7}  written {w['written']:>7}  "
            f"reserved-unwritten {w['reserved_unwritten']:>7}  free {w['free']:>7}  "
            f"running {w['running']}" + (f"  stalls: {stalls}" if stalls else "")
        )
    stalls = ", ".join(f"{k} {v}" for k, v in sorted(s["stalls"].items())) or "none"
    refused = ", ".join(f"{k} {v}" for k, v in sorted(s["refused"].items())) or "none"
    lines += [f"admission stalls by reason (steps): {stalls}", f"refused at submit: {refused}"]
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    try:
        reply = client.status(args.target, token=internal_token(args.internal_token_file))
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    s = status_dict(reply)
    print(json.dumps(s, indent=2) if args.json else format_status(s))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from llmserve.demo import run_demo

    return run_demo(Path(args.log_dir))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start scheduler + workers + gateway on loopback")
    add_flags(up, StackSettings, {"internal_token_file": INTERNAL_TOKEN_HELP})
    up.add_argument("--log-dir", default="results/logs")
    up.add_argument(
        "--prometheus-port",
        type=int,
        default=0,
        help="also run Prometheus (when installed) on this loopback port, scraping the metrics "
        "ports every 5 s; needs --metrics-base-port (default: 0, off)",
    )
    up.set_defaults(func=cmd_up)

    gen = sub.add_parser("generate", help="stream a completion from the gateway")
    gen.add_argument("--target", default="127.0.0.1:50051", help="gateway address")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    gen.add_argument(
        "--api-key",
        default=os.environ.get("LLMSERVE_API_KEY", ""),
        help="sent as `authorization: Bearer KEY` (default: $LLMSERVE_API_KEY)",
    )
    gen.add_argument("--tls-ca", default="", help="CA certificate (PEM) to reach a TLS gateway")
    gen.set_defaults(func=cmd_generate)

    st = sub.add_parser("status", help="the scheduler's snapshot and stalls by reason")
    st.add_argument("--target", default="127.0.0.1:50052", help="scheduler address")
    st.add_argument("--json", action="store_true")
    st.add_argument("--internal-token-file", default="", help=INTERNAL_TOKEN_HELP)
    st.set_defaults(func=cmd_status)

    demo = sub.add_parser("demo", help="the whole stack, a real workload, both KV policies")
    demo.add_argument("--log-dir", default="results/demo-logs")
    demo.set_defaults(func=cmd_demo)

    from llmserve.bench.cli import add_bench_parser

    add_bench_parser(sub)  # llmserve bench serve | sim | calibrate | core
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))
