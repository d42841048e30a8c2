"""The workload flags of `bench serve` / `bench sim`, and the workload they describe."""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from llmserve.bench import hash_trace as ht
from llmserve.bench import workload as w
from llmserve.bench.errors import BenchError
from llmserve.bench.multiturn import MultiTurn, multiturn
from llmserve.bench.task_prompts import PROMPTS, task_workload
from llmserve.bench.tenant_args import add_tenant_flags, tenants_from_args, wants_tenants
from llmserve.bench.tokens import TextOf, TokenSource
from llmserve.bench.trace import DEFAULT_TRACE, UNITS, Trace, TraceScale, read_trace

# flags of length-only trace replays, with their defaults; the workloads that apply some of them
TRACE_FLAGS = {
    "start": ("--start", 0.0),
    "duration": ("--duration", 0.0),
    "length_scale": ("--length-scale", 1.0),
    "max_prompt_tokens": ("--max-prompt-tokens", 0),
    "timestamp_unit": ("--timestamp-unit", None),
}
APPLIED = {"trace": set(TRACE_FLAGS), "hash-trace": {"start", "duration"}}
INSTEAD = {
    ("hash-trace", "length_scale"): "a hash trace's lengths scale with --hash-block-tokens B "
    "(x B/512, its blocks kept)",
    ("hash-trace", "max_prompt_tokens"): "clipping would cut a hash trace's blocks; "
    "--hash-block-tokens B shortens every prompt (x B/512)",
    ("hash-trace", "timestamp_unit"): "a hash trace's timestamps are milliseconds",
}


def build_workload(
    args: argparse.Namespace, time_scale: float | None = None, served: bool = False
) -> w.Workload:
    """`served`: prompts go through the gateway's tokenizer (trace, multiturn and hash-trace
    content is then text of single-token words); else token ids for the simulation."""
    if wants_tenants(args):
        return tenants_from_args(args, time_scale or args.time_scale)
    if args.shared_prefix_tokens and args.workload != "trace":
        raise BenchError("--shared-prefix-tokens is for --workload trace (a length-only trace)")
    refuse_unused(args)
    if args.workload in ("fixed", "poisson"):
        made = _fixed_or_poisson(args)
    elif args.workload in PROMPTS:
        n, c = args.requests or 8, args.concurrency or 1
        made = task_workload(args.workload, n, args.output_tokens, c, args.seed)
    else:
        source, text = _vocabulary(args, served)
        time_scale = time_scale or args.time_scale
        if args.workload == "trace":
            made = _trace_workload(
                args, time_scale, w.DistinctPrompts(source, text, args.shared_prefix_tokens)
            )
        elif args.workload == "multiturn":
            made = _multiturn_workload(args, time_scale, source, text)
        else:
            made = _hash_workload(args, time_scale, source, text)
    if not made.requests and not getattr(args, "concurrencies", ""):  # each level its own
        raise BenchError(_no_requests(args, made))
    return w.with_max_tokens(made, args.max_tokens) if args.max_tokens else made


def refuse_unused(args: argparse.Namespace) -> None:
    """A trace flag given to a workload that does not apply it is an error, not a no-op."""
    for name, (flag, default) in TRACE_FLAGS.items():
        if name in APPLIED.get(args.workload, set()) or getattr(args, name, default) == default:
            continue
        where = " or ".join(kind for kind, names in APPLIED.items() if name in names)
        instead = INSTEAD.get((args.workload, name))
        raise BenchError(
            f"{flag} does not apply to --workload {args.workload} (only to --workload {where})"
            + (f": {instead}" if instead else "")
        )


def _no_requests(args: argparse.Namespace, made: w.Workload) -> str:
    if args.workload not in ("trace", "hash-trace"):
        return f"--workload {args.workload} makes no requests: give --requests of at least 1"
    p = made.params
    if p.get("trace_requests") == 0:
        return f"no requests in {p['trace']}: its rows, {p['skipped_rows']}, are left out"
    return (
        f"no requests in the slice --start {args.start:g} --duration {args.duration:g} (0: to "
        f"the end) of {p['trace']} (its {p['trace_requests']} requests span "
        f"{p['trace_span_s']} s from its first arrival)"
    )


def _fixed_or_poisson(args: argparse.Namespace) -> w.Workload:
    if args.workload == "fixed":
        return w.fixed(args.requests, args.prompt_tokens, args.output_tokens, args.concurrency or 1)
    return w.poisson(args.requests, args.rate, args.prompt_tokens, args.output_tokens, args.seed)


def _vocabulary(args: argparse.Namespace, served: bool) -> tuple[TokenSource, TextOf | None]:
    """Token ids from --seed: over the simulation's ids, or (served) over the tokenizer's
    single-token words, with the function that makes their text."""
    if not served:
        return TokenSource(seed=args.seed), None
    # the tokenizer's libraries load only for served runs (the simulation needs ids only)
    from gateway.tokenizer_files import load_tokenizer
    from llmserve.bench.tokens import checked_word_vocab, word_text

    # the gateway's tokenizer: the packaged models (and --target) use SmolLM2's
    packaged = args.target or args.model in ("smollm2", "tiny", "sim")
    tokenizer = load_tokenizer("" if packaged else args.model)
    text = functools.partial(word_text, tokenizer=tokenizer)
    return TokenSource(checked_word_vocab(tokenizer), args.seed), text


def _trace_workload(args: argparse.Namespace, time_scale: float, content: w.Content) -> w.Workload:
    trace = read_trace(args.trace, args.timestamp_unit)
    scale = TraceScale(
        args.length_scale,
        time_scale,
        args.start,
        args.duration,
        args.requests,
        args.max_prompt_tokens,
        args.max_output_tokens,
    )
    made = w.from_trace(scale, trace.rows, args.concurrency, content=content)
    return replace(made, params=made.params | trace_params(trace))


def trace_params(trace: Trace) -> dict[str, object]:
    """The file, its format, its rows (and those left out) and their span, for the report."""
    span = trace.rows[-1].arrival_s if trace.rows else 0.0
    counts = {"trace_requests": len(trace.rows), "trace_span_s": round(span, 3)}
    return {"kind": f"trace ({trace.format.label})"} | trace.describe() | counts


def _multiturn_workload(
    args: argparse.Namespace, time_scale: float, source: TokenSource, text: TextOf | None
) -> w.Workload:
    shape = MultiTurn(
        args.conversations,
        args.turns,
        args.system_prompts,
        args.system_tokens,
        args.user_tokens,
        args.answer_tokens,
        args.think_time,
        args.conversation_rate / (time_scale / args.time_scale),
        args.seed,
    )
    return multiturn(shape, source, text)


def _hash_workload(
    args: argparse.Namespace, time_scale: float, source: TokenSource, text: TextOf | None
) -> w.Workload:
    path = ht.SAMPLE_TRACE if args.trace == DEFAULT_TRACE else args.trace
    rows = ht.load_hash_trace(path)
    span = (rows[-1].timestamp_ms - rows[0].timestamp_ms) / 1000
    stated = {"trace": str(path), "trace_requests": len(rows), "trace_span_s": round(span, 3),
              "slice_start_s": args.start, "slice_duration_s": args.duration}  # fmt: skip
    picked = ht.slice_rows(rows, args.start, args.duration)
    if not picked:
        return w.Workload("hash-trace-0", [], args.concurrency, stated)
    prompts = ht.HashPrompts(source, args.hash_block_tokens)
    made = ht.hash_trace_workload(
        picked, prompts, text, time_scale, args.requests, args.concurrency, args.max_output_tokens
    )
    return replace(made, params=made.params | stated)


def add_workload_flags(
    p: argparse.ArgumentParser,
    requests: int,
    concurrency: int,
    workload: str = "fixed",
    tenants: bool = False,
) -> None:
    """`tenants`: also the tenant flags (--tenants, --slo-classes, --queue-policies)."""
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        choices=["fixed", "poisson", "trace", "multiturn", "hash-trace", *PROMPTS],
        default=workload,
        help="multiturn: chat conversations resending their history; hash-trace: a JSONL trace "
        "with per-block content hashes (--trace, default data/traces/hash_sample.jsonl); "
        "repetitive / open: chat tasks whose answers copy their prompt, or do not "
        "(speculative decoding's benchmark)",
    )
    g.add_argument(
        "--requests",
        type=at_least(int, 0),
        default=requests,
        help="fixed/poisson: how many; trace, hash-trace: at most this many (0 = all)",
    )
    g.add_argument(
        "--concurrency",
        type=at_least(int, 0),
        default=concurrency,
        help="closed loop with this many clients; 0 = open loop",
    )
    g.add_argument("--prompt-tokens", type=at_least(int, 1), default=16)
    g.add_argument("--output-tokens", type=at_least(int, 1), default=64)
    g.add_argument("--rate", type=above(0.0), default=1.0, help="poisson: requests/s")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help="trace: a CSV, TIMESTAMP,ContextTokens,GeneratedTokens (Azure) or Timestamp,"
        "Request tokens,Response tokens (BurstGPT, seconds); hash-trace: a JSONL file",
    )
    g.add_argument(
        "--timestamp-unit",
        choices=sorted(UNITS),
        default=None,
        help="trace: the unit of numeric timestamps (seconds or milliseconds from any origin); "
        "needed for them unless the format defines it (BurstGPT: s); date-times need none",
    )
    g.add_argument(
        "--length-scale", type=above(0.0), default=1.0, help="trace: prompt and output lengths x it"
    )
    g.add_argument(
        "--time-scale",
        type=above(0.0),
        default=1.0,
        help="arrival offsets x this (>1: slower arrivals); open loop only",
    )
    g.add_argument(
        "--start", type=at_least(float, 0), default=0.0, help="trace slice start, seconds"
    )
    g.add_argument(
        "--duration", type=at_least(float, 0), default=0.0, help="trace slice length (0 = all)"
    )
    g.add_argument(
        "--max-prompt-tokens", type=at_least(int, 0), default=0, help="trace: clip prompts (0: no)"
    )
    g.add_argument(
        "--max-output-tokens",
        type=at_least(int, 0),
        default=0,
        help="trace, hash-trace: clip outputs (0: no)",
    )
    g.add_argument(
        "--shared-prefix-tokens",
        type=at_least(int, 0),
        default=0,
        help="trace: every prompt starts with the same this many tokens (a stated model of a "
        "shared system prompt); 0 = each request's prompt its own content, the trace carrying "
        "lengths only",
    )
    g.add_argument(
        "--max-tokens",
        type=at_least(int, 0),
        default=0,
        help="requests' max_tokens when above the output length (outputs still end "
        "at their length); 0 = exactly the output length",
    )
    m = p.add_argument_group("multiturn workload")
    m.add_argument("--conversations", type=at_least(int, 1), default=8)
    m.add_argument("--turns", type=at_least(int, 1), default=6, help="per conversation")
    m.add_argument("--system-prompts", type=int, default=2, help="shared by the conversations")
    m.add_argument("--system-tokens", type=int, default=256)
    m.add_argument("--user-tokens", type=int, default=64, help="each user message")
    m.add_argument("--answer-tokens", type=int, default=32, help="each answer (max_tokens)")
    m.add_argument(
        "--think-time",
        type=float,
        default=2.0,
        help="mean seconds between an answer and the next turn (exponential, from --seed)",
    )
    m.add_argument(
        "--conversation-rate",
        type=float,
        default=0.5,
        help="conversations started per second (Poisson, from --seed); 0 = all at once",
    )
    h = p.add_argument_group("hash-trace workload")
    h.add_argument(
        "--hash-block-tokens",
        type=int,
        default=512,
        help="tokens per hash id; below 512 every length is scaled by this / 512",
    )
    p.add_argument(
        "--prefix-caching",
        default="",
        help="on, off, or on,off (each policy twice, same arrivals, side by side with ratios); "
        "default: the stack's default (on under paged)",
    )
    if tenants:
        add_tenant_flags(p)


def at_least(kind: Callable[[str], float], low: float) -> Callable[[str], float]:
    """An argparse type: a number of `kind` (int or float) >= `low`."""

    def parse(text: str) -> float:
        value = _parsed(kind, text)
        if not value >= low:
            raise argparse.ArgumentTypeError(f"{text!r}: must be >= {low:g}")
        return value

    return parse


def above(low: float) -> Callable[[str], float]:
    """An argparse type: a float > `low`."""

    def parse(text: str) -> float:
        value = _parsed(float, text)
        if not value > low:
            raise argparse.ArgumentTypeError(f"{text!r}: must be > {low:g}")
        return value

    return parse


def _parsed(kind: Callable[[str], float], text: str) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number ({kind.__name__})") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value
