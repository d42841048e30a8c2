"""Structured output through a running stack's HTTP API: the share of N answers under JSON
schemas (nested objects, enums, arrays, optional fields) that parse and validate; the cost,
side by side: output tok/s and p50 inter-token time at each concurrency, with and without a
JSON schema on every request; and llguidance's compile time per schema, cold and cached.

    llmserve up --model smollm2 --http-port 8000 &
    python -m llmserve.bench.structured_cost --url http://127.0.0.1:8000/v1 --model smollm2
    python -m llmserve.bench.structured_cost --step 40   # one worker step's parts, in process
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import openai

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip_code": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city", "zip_code"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "role", "address", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
ORDER = {  # an array of nested objects, enums, optional fields
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 999999},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
        "note": {"type": "string", "maxLength": 40},
    },
    "required": ["order_id", "status", "items"],
    "additionalProperties": False,
}
EVENT = {  # nested optional object, a number range, an array of strings
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
        "hours": {"type": "number", "minimum": 0, "maximum": 24},
        "place": {
            "type": "object",
            "properties": {
                "room": {"type": "string", "maxLength": 10},
                "floor": {"type": "integer", "minimum": -2, "maximum": 40},
            },
            "required": ["room"],
            "additionalProperties": False,
        },
        "guests": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["title", "day", "guests"],
    "additionalProperties": False,
}
PERSON = SCHEMA | {
    "properties": SCHEMA["properties"] | {"nickname": {"type": "string", "maxLength": 10}}
}
SCHEMAS = {  # name: (schema, what to ask)
    "person": (PERSON, "Describe a person as JSON."),
    "order": (ORDER, "Write a shop order as JSON."),
    "event": (EVENT, "Plan a meeting as JSON."),
}


async def one(
    client, model: str, seed: int | None, constrained: bool, max_tokens: int, exact: bool
):
    """(output tokens, mean inter-token seconds) of one streamed request: its tokens after the
    first over the time from the first to the last (a chunk may carry several tokens). exact:
    exactly max_tokens tokens (ignore_eos). seed None: an unseeded request."""
    extra = {"response_format": FORMAT} if constrained else {}
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True} if exact else None,
        **extra,
    )
    first = last = None
    tokens = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    gap = (last - first) / (tokens - 1) if first and tokens > 1 else None
    return tokens, gap


async def load(
    client,
    model: str,
    concurrency: int,
    constrained: bool,
    rounds: int,
    max_tokens: int,
    lengths: list[int] | None = None,
    seeded: bool = True,
) -> tuple[float, float, list[int]]:
    """(output tok/s, p50 of the requests' inter-token ms, each request's tokens):
    concurrency x rounds requests, `concurrency` at a time. lengths: request i generates
    exactly lengths[i] tokens (a free run as long as a constrained one). seeded: request i
    has seed i (else none: the worker's own generator)."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(i: int):
        seed = i if seeded else None
        async with gate:
            if lengths is None:
                return await one(client, model, seed, constrained, max_tokens, False)
            return await one(client, model, seed, constrained, max(lengths[i], 1), True)

    started = time.perf_counter()
    results = await asyncio.gather(*(gated(i) for i in range(concurrency * rounds)))
    seconds = time.perf_counter() - started
    tokens = sum(n for n, _ in results)
    gaps = [g for _, g in results if g is not None]
    p50 = statistics.median(gaps) * 1000 if gaps else float("nan")
    return tokens / seconds, p50, [n for n, _ in results]


async def answer(client, model: str, name: str, seed: int, max_tokens: int) -> str | None:
    """Why one answer under schema `name` fails to parse or validate; None: it is valid."""
    import jsonschema

    schema, ask = SCHEMAS[name]
    reply = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": ask}],
        max_tokens=max_tokens,
        temperature=0.8,
        seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
    )
    text = reply.choices[0].message.content or ""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as err:
        return f"{name} seed {seed} ({reply.choices[0].finish_reason}): {err}"
    return None


async def validity(client, model: str, count: int, concurrency: int, max_tokens: int):
    """(valid answers, count, their failures), `count` answers across SCHEMAS."""
    names = list(SCHEMAS)
    gate = asyncio.Semaphore(concurrency)

    async def gated(i: int) -> str | None:
        async with gate:
            return await answer(client, model, names[i % len(names)], i, max_tokens)

    failures = [f for f in await asyncio.gather(*(gated(i) for i in range(count))) if f]
    return count - len(failures), count, failures


def _medians(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """The median tok/s and the median p50 inter-token time of several runs."""
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def compile_times() -> tuple[float, float]:
    """ms to compile the schema cold (a new schema text) and cached (the same text again)."""
    from gateway.structured import grammar_problem
    from llmcommon.v1 import common_pb2

    spec = json.dumps(SCHEMA | {"title": f"t{time.time_ns()}"})
    kind = common_pb2.Grammar.JSON_SCHEMA
    t0 = time.perf_counter()
    grammar_problem(kind, spec)
    t1 = time.perf_counter()
    grammar_problem(kind, spec)
    t2 = time.perf_counter()
    return (t1 - t0) * 1000, (t2 - t1) * 1000


def step_costs(
    steps: int, rows: int = 32, context: int = 200, threads: int = 1
) -> dict[str, float]:
    """Median ms of one worker step's parts, in process on SmolLM2 (no servers): the forward of
    `rows` decodes, then its sampling on the same logits as `rows` seeded free rows and as
    `rows` seeded rows under SCHEMA (their bitmask included), in turn each step; the grammar
    states advance with the schema rows' tokens, through whole answers."""
    import torch

    from llmcommon.sampling import SamplingParams
    from llmcommon.sampling_wire import from_wire
    from llmcommon.v1 import common_pb2
    from llmserve.bench.forward_timing import Ours
    from worker_svc.grammar import (
        GrammarCache,
        TokenTable,
        model_tokenizer,
        row_masks,
        spec_of,
    )
    from worker_svc.loader import load_model
    from worker_svc.sampling import fresh_generator, sample_tokens
    from worker_svc.work import WorkItem

    torch.set_num_threads(threads)
    config, weights = load_model("smollm2", torch.bfloat16, "auto")
    ours, vocab = Ours(config, weights, torch.bfloat16, rows, context), config.vocab_size
    cache = GrammarCache(TokenTable(lambda: model_tokenizer("smollm2", vocab, (2,))))
    grammar = spec_of("json_schema", SCHEMA)
    items = [
        WorkItem(str(i), [100 + i], context, ours.tables[i], sample_index=1) for i in range(rows)
    ]
    states = [cache.state(grammar, vocab) for _ in range(rows)]
    free = [SamplingParams(temperature=1.0, seed=i) for i in range(rows)]
    constrained = [
        from_wire(common_pb2.SamplingParams(temperature=1.0, seed=i, grammar=grammar))
        for i in range(rows)
    ]
    rng, times = fresh_generator(), {"forward": [], "free sampling": [], "schema sampling": []}
    for step in range(steps):
        at = time.perf_counter()
        with torch.inference_mode():
            logits = ours.runner.compute_logits(items).float()
        times["forward"].append(time.perf_counter() - at)
        index = [step + 1] * rows
        for name in ("free sampling", "schema sampling")[:: 1 if step % 2 else -1]:
            at = time.perf_counter()
            if name == "free sampling":
                sample_tokens(logits, free, index, rng)
            else:
                tokens = sample_tokens(
                    logits, constrained, index, rng, None, row_masks(states, vocab)
                )
            times[name].append(time.perf_counter() - at)
        for row, token in enumerate(tokens):
            states[row].advance(token)
            if states[row].matcher.is_stopped():
                states[row] = cache.state(grammar, vocab)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=2, help="requests per slot")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, medians kept")
    parser.add_argument("--validate", type=int, default=60, help="answers checked (0: none)")
    parser.add_argument(
        "--lengths",
        choices=("schema", "own"),
        default="schema",
        help="schema: each free request generates exactly as many tokens as the schema answer "
        "of the same seed (ignore_eos), so both runs do the same work beside the grammar; own: "
        "free answers end where the model ends them (up to --max-tokens)",
    )
    parser.add_argument(
        "--unseeded",
        action="store_true",
        help="requests without a seed (free rows then share one batched draw); with --lengths "
        "schema the free request i is as long as the schema request i",
    )
    parser.add_argument(
        "--step",
        type=int,
        default=0,
        help="instead: time N worker steps in process (SmolLM2, 32 decodes; no --url needed): "
        "the forward, free and schema sampling",
    )
    args = parser.parse_args()
    if args.step:
        costs = step_costs(args.step)
        print(", ".join(f"{name} {ms:.1f} ms" for name, ms in costs.items()))
        free, schema = (costs["forward"] + costs[k] for k in ("free sampling", "schema sampling"))
        print(f"step: free {free:.1f} ms, schema {schema:.1f} ms, ratio {free / schema:.2f}")
        return
    client = openai.AsyncOpenAI(base_url=args.url, api_key="-", max_retries=0, timeout=600)
    await load(client, args.model, 2, True, 1, args.max_tokens)  # warm: the worker's table
    if args.validate:
        valid, count, failures = await validity(client, args.model, args.validate, 8, 400)
        print(f"valid answers: {valid}/{count} ({100 * valid / count:.0f}%) over {list(SCHEMAS)}")
        for failure in failures:
            print("  invalid:", failure)
    print(f"free answers' lengths: {args.lengths}; seeds: {'none' if args.unseeded else 'yes'}")
    print(
        "| concurrency | free tok/s | schema tok/s | ratio | free p50 ITL ms | schema p50 ITL ms |"
    )
    print("|---|---|---|---|---|---|")
    for c in [int(x) for x in args.concurrency.split(",")]:
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.repeats):  # constrained and free in turn: the host's drift shared
            seeded = not args.unseeded
            rate, itl, lengths = await load(
                client, args.model, c, True, args.rounds, args.max_tokens, None, seeded
            )
            runs[True].append((rate, itl))
            same = lengths if args.lengths == "schema" else None
            rate, itl, _ = await load(
                client, args.model, c, False, args.rounds, args.max_tokens, same, seeded
            )
            runs[False].append((rate, itl))
        free, constrained = (_medians(runs[k]) for k in (False, True))
        ratio = constrained[0] / free[0]
        print(
            f"| {c} | {free[0]:.0f} | {constrained[0]:.0f} | {ratio:.2f} | "
            f"{free[1]:.2f} | {constrained[1]:.2f} |"
        )
    cold, cached = compile_times()
    print(f"gateway compile of the schema: cold {cold:.2f} ms, cached {cached:.4f} ms")


if __name__ == "__main__":
    asyncio.run(main())
