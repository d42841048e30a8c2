"""The cost of structured output, side by side: output tok/s and p50 inter-token time at each
concurrency, with and without a JSON schema on every request, through a running stack's HTTP
API; and llguidance's compile time per schema, cold and cached.

    python -m llmserve.bench.structured_cost --url http://127.0.0.1:8000/v1 --model tiny
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


async def one(client, model: str, seed: int, constrained: bool, max_tokens: int):
    """(output tokens, inter-token gaps) of one streamed request."""
    extra = {"response_format": FORMAT} if constrained else {}
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        stream=True,
        **extra,
    )
    times = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    return len(times), [b - a for a, b in zip(times, times[1:], strict=False)]


async def load(client, model: str, concurrency: int, constrained: bool, rounds: int, max_tokens):
    started = time.perf_counter()
    results = await asyncio.gather(
        *(one(client, model, i, constrained, max_tokens) for i in range(concurrency * rounds))
    )
    seconds = time.perf_counter() - started
    tokens = sum(n for n, _ in results)
    gaps = [g for _, gs in results for g in gs]
    return tokens / seconds, statistics.median(gaps) * 1000 if gaps else float("nan")


def compile_times() -> tuple[float, float]:
    """ms to compile the schema cold (a new schema text) and cached (the same text again)."""
    from gateway.structured import grammar_problem
    from llmserve.v1 import common_pb2

    spec = json.dumps(SCHEMA | {"title": f"t{time.time_ns()}"})
    kind = common_pb2.Grammar.JSON_SCHEMA
    t0 = time.perf_counter()
    grammar_problem(kind, spec)
    t1 = time.perf_counter()
    grammar_problem(kind, spec)
    t2 = time.perf_counter()
    return (t1 - t0) * 1000, (t2 - t1) * 1000


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=2, help="requests per slot")
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()
    client = openai.AsyncOpenAI(base_url=args.url, api_key="-", max_retries=0, timeout=600)
    await load(client, args.model, 2, True, 1, args.max_tokens)  # warm: the worker's table
    print("concurrency | free tok/s | schema tok/s | ratio | free p50 ITL ms | schema p50 ITL ms")
    for c in [int(x) for x in args.concurrency.split(",")]:
        free = await load(client, args.model, c, False, args.rounds, args.max_tokens)
        constrained = await load(client, args.model, c, True, args.rounds, args.max_tokens)
        ratio = constrained[0] / free[0]
        print(
            f"{c} | {free[0]:.0f} | {constrained[0]:.0f} | {ratio:.2f} | "
            f"{free[1]:.2f} | {constrained[1]:.2f}"
        )
    cold, cached = compile_times()
    print(f"gateway compile of the schema: cold {cold:.2f} ms, cached {cached:.4f} ms")


if __name__ == "__main__":
    asyncio.run(main())
