"""Are a server's greedy answers the same as another's, token for token? Speculative decoding's
exactness check through the stack: the same prompts, temperature 0, to two OpenAI-compatible
servers (this stack without and with speculation), each prompt streamed and not; it reports how
many answers are identical and shows the first that differ.

    python -m llmserve.bench.spec_exact --base-url off=http://127.0.0.1:P1/v1 \\
        --base-url on=http://127.0.0.1:P2/v1 --prompts 200 --max-tokens 64

The prompts: half repetitive chat tasks, half open ones (task_prompts.py), from --seed. Both
servers see the same batches' shapes only at --concurrency 1 (a step's rounding can depend on
how many rows it holds), which is the default.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass

import openai

from llmserve.bench.openai_backend import parse_base_urls
from llmserve.bench.task_prompts import open_prompt, repetitive_prompt


@dataclass(frozen=True, slots=True)
class Answer:
    text: str
    tokens: int
    finish: str


def prompts(n: int, seed: int) -> list[str]:
    """n prompts: repetitive and open in turn."""
    return [(repetitive_prompt if i % 2 == 0 else open_prompt)(seed, i // 2) for i in range(n)]


async def ask(api: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, stream: bool):
    common = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    if not stream:
        out = await api.chat.completions.create(**common)
        choice = out.choices[0]
        text, tokens = choice.message.content or "", out.usage.completion_tokens
        return Answer(text, tokens, choice.finish_reason)
    parts, finish, tokens = [], "", 0
    chunks = await api.chat.completions.create(
        **common, stream=True, stream_options={"include_usage": True}
    )
    async for chunk in chunks:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return Answer("".join(parts), tokens, finish)


async def answers(url: str, texts: list[str], args: argparse.Namespace) -> list[Answer]:
    """Each prompt, not streamed then streamed: 2 x len(texts) answers."""
    gate = asyncio.Semaphore(args.concurrency)
    async with openai.AsyncOpenAI(base_url=url, api_key=args.api_key, max_retries=0) as api:
        model = (await api.models.list()).data[0].id

        async def one(text: str, stream: bool) -> Answer:
            async with gate:
                return await ask(api, model, text, args.max_tokens, stream)

        return await asyncio.gather(*(one(t, s) for t in texts for s in (False, True)))


def compare(labels: list[str], runs: list[list[Answer]], texts: list[str]) -> int:
    base, other = runs
    same = sum(a == b for a, b in zip(base, other, strict=True))
    streamed_same = sum(
        base[i].text == base[i + 1].text and other[i].text == other[i + 1].text
        for i in range(0, len(base), 2)
    )
    print(f"{same} of {len(base)} answers identical ({labels[0]} vs {labels[1]}: text, token "
          f"count, finish reason); streamed == not streamed on both for {streamed_same} of "
          f"{len(texts)} prompts")  # fmt: skip
    shown = 0
    for i, (a, b) in enumerate(zip(base, other, strict=True)):
        if a != b and shown < 3:
            shown += 1
            print(f"- prompt {i // 2} ({'streamed' if i % 2 else 'not streamed'}):")
            print(f"  {labels[0]}: {a.text[:160]!r} ({a.tokens} tokens, {a.finish})")
            print(f"  {labels[1]}: {b.text[:160]!r} ({b.tokens} tokens, {b.finish})")
    return 0 if same == len(base) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", action="append", required=True, metavar="[LABEL=]URL")
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default="none")
    args = p.parse_args(argv)
    servers = parse_base_urls(args.base_url)
    if len(servers) != 2:
        p.error("two --base-url: the baseline, then the one to compare")
    texts = prompts(args.prompts, args.seed)
    runs = [asyncio.run(answers(url, texts, args)) for _, url in servers]
    return compare([label for label, _ in servers], runs, texts)


if __name__ == "__main__":
    sys.exit(main())
