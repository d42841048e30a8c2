"""`llmserve bench tenants`'s flags: the issue's case (short chats beside another tenant's
burst) through real processes, each queue policy in turn."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from llmserve.bench.policy import queue_list
from llmserve.bench.workload_args import above, at_least


def add_tenants_parser(kinds) -> None:
    p = kinds.add_parser(
        "tenants",
        help="two API keys on one stack: short chats one at a time beside a burst of long "
        "requests, under each queue policy (TTFT of the chats, throughput of the burst)",
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bf16")
    p.add_argument(
        "--threads", type=at_least(int, 1), default=2, help="torch threads of the worker"
    )
    p.add_argument(
        "--queue-policies",
        type=queue_list,
        default="fcfs,fair,priority",
        help="comma-separated; each runs for --duration on the same stack, switched live (the "
        "first is the baseline of the ratios)",
    )
    p.add_argument("--duration", type=above(0), default=90.0, help="seconds per policy")
    p.add_argument(
        "--warmup",
        type=at_least(float, 0),
        default=30.0,
        help="seconds of the batch load alone before the first policy, not reported (the "
        "worker's first steps are slower)",
    )
    p.add_argument("--batch-concurrency", type=at_least(int, 1), default=64)
    p.add_argument("--batch-prompt-tokens", type=at_least(int, 1), default=600)
    p.add_argument("--batch-output-tokens", type=at_least(int, 1), default=256)
    p.add_argument("--chat-prompt-tokens", type=at_least(int, 1), default=24)
    p.add_argument("--chat-output-tokens", type=at_least(int, 1), default=24)
    p.add_argument(
        "--chat-priority",
        type=int,
        default=-1,
        help="the chats' priority under `priority` (the chat key's top_priority; lower first)",
    )
    p.add_argument("--out", type=Path, default=Path("results/bench"))
    p.add_argument("--name", default="tenants", help="file name prefix of the report")
    p.set_defaults(func=_cmd_tenants)


def _cmd_tenants(args: argparse.Namespace) -> int:
    from llmserve.bench.outdir import check_out_dir
    from llmserve.bench.run_tenants import run_tenants

    check_out_dir(args.out)  # before minutes of load, not after
    return run_tenants(args, "llmserve " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
