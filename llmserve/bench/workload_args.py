"""The workload that `bench serve` / `bench sim`'s workload flags describe (the flags themselves
are declared with the parser, in `bench/cli.py`)."""

from __future__ import annotations

import argparse
import functools
from dataclasses import replace

from llmserve.bench import hash_trace as ht
from llmserve.bench import workload as w
from llmserve.bench.multiturn import MultiTurn, multiturn
from llmserve.bench.tokens import TokenSource
from llmserve.bench.trace import DEFAULT_TRACE, TraceScale, load_trace


def build_workload(
    args: argparse.Namespace, time_scale: float | None = None, served: bool = False
) -> w.Workload:
    """`served`: prompts go through the gateway's tokenizer (multiturn and hash-trace content
    is then text of single-token words); else token ids for the simulation."""
    if args.workload in ("multiturn", "hash-trace"):
        made = _content_workload(args, time_scale or args.time_scale, served)
    elif args.workload == "fixed":
        made = w.fixed(args.requests, args.prompt_tokens, args.output_tokens, args.concurrency or 1)
    elif args.workload == "poisson":
        made = w.poisson(
            args.requests, args.rate, args.prompt_tokens, args.output_tokens, args.seed
        )
    else:
        scale = TraceScale(
            args.length_scale,
            time_scale or args.time_scale,
            args.start,
            args.duration,
            args.requests,
            args.max_prompt_tokens,
            args.max_output_tokens,
        )
        made = w.from_trace(scale, load_trace(args.trace), args.concurrency)
    return w.with_max_tokens(made, args.max_tokens) if args.max_tokens else made


def _content_workload(args: argparse.Namespace, time_scale: float, served: bool) -> w.Workload:
    source, text = TokenSource(seed=args.seed), None
    if served:
        # the tokenizer's libraries load only for served runs (the simulation needs ids only)
        from gateway.tokenizer_files import load_tokenizer
        from llmserve.bench.tokens import checked_word_vocab, word_text

        # the gateway's tokenizer: the packaged models (and --target) use SmolLM2's
        packaged = args.target or args.model in ("smollm2", "tiny", "sim")
        tokenizer = load_tokenizer("" if packaged else args.model)
        source = TokenSource(checked_word_vocab(tokenizer), args.seed)
        text = functools.partial(word_text, tokenizer=tokenizer)
    if args.workload == "multiturn":
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
    path = ht.SAMPLE_TRACE if args.trace == DEFAULT_TRACE else args.trace
    rows = ht.load_hash_trace(path)
    prompts = ht.HashPrompts(source, args.hash_block_tokens)
    made = ht.hash_trace_workload(
        rows, prompts, text, time_scale, args.requests, args.concurrency, args.max_output_tokens
    )
    return replace(made, params=made.params | {"trace": str(path)})
