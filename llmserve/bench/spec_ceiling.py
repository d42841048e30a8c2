"""How fast could speculation make this model on this workload? The ceiling, from the answers
themselves: a server's greedy answers to the workload's prompts (temperature 0, one at a time,
streamed, each timed), then each answer replayed step by step against the proposers, as a
verifying worker would take their drafts (the longest matching prefix, plus one token).

    python -m llmserve.bench.spec_ceiling --base-url http://127.0.0.1:P/v1 \\
        --workload repetitive --requests 9 --output-tokens 128 --row-cost 0.14

Printed per proposer: the share of the answers' tokens that came from an accepted draft, the
tokens a step emits, and what that makes of the decode speed and of output tokens/s end to end:
"free" if verifying cost nothing, and with each draft row costing `--row-cost` of a plain decode
step (llmserve.bench.draft_step measures it: its "x plain" at k drafted tokens is 1 + k * cost).
End to end, the answers' own time to first token stays (speculation does not touch the prefill).

The replay and the proposers are the scheduler's own (scheduler_svc/speculation/potential.py,
which --speculation-potential runs on live traffic): prompt lookup as the scheduler runs it at
the given settings, and an **oracle**: at each step, the longest stretch of the answer's next
tokens that occurs anywhere earlier in the prompt or the answer (an occurrence may run on into
the stretch, as a repeating period does). No proposer that copies earlier
text drafts more than the oracle, so its row is the ceiling for ngram and suffix on fresh
prompts (a suffix index over other requests' answers only adds where requests repeat).

The server must be the model without speculation (any OpenAI-compatible one); the prompt and the
answer are tokenized again here (the GGUF's tokenizer and chat template), which can differ from
the server's ids at a few places.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from array import array
from dataclasses import dataclass

import openai

from llmserve.bench.task_prompts import PROMPTS
from scheduler_svc.speculation import potential


@dataclass(frozen=True, slots=True)
class Replay:
    """One proposer over a set of answers: what a verifying worker would have done."""

    tokens: int  # the answers' tokens
    steps: int  # decode steps (each emits its accepted draft plus one token)
    drafted: int  # draft tokens verified
    accepted: int  # of those, accepted

    @property
    def per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    def speedup(self, row_cost: float) -> float:
        """Decode speed against one token a step, each drafted row costing `row_cost` of a
        plain step."""
        cost = self.steps + row_cost * self.drafted
        return self.tokens / cost if cost else 0.0


def replay(prompt: list[int], answer: list[int], propose: potential.Propose) -> Replay:
    """Steps through `answer` as speculative decoding would, by the scheduler's own replay
    (scheduler_svc/speculation/potential.py; `propose` one of its proposers): each step keeps its
    draft's longest prefix that matches the answer, plus one token (the target's own). The first
    token is the prompt's step's (no draft there): the replay starts after it, and counts the
    tokens after it."""
    if not answer:
        return Replay(0, 0, 0, 0)
    packed = array("I", prompt + answer).tobytes()
    tokens, steps, drafted, accepted, _, _ = potential.replay(packed, len(prompt) + 1, propose)
    return Replay(tokens, steps, drafted, accepted)


def total(replays: list[Replay]) -> Replay:
    return Replay(*(sum(getattr(r, f) for r in replays) for f in Replay.__slots__))


@dataclass(frozen=True, slots=True)
class Answer:
    text: str
    ttft: float  # seconds
    decode: float  # seconds from the first token to the last


async def ask(url: str, api_key: str, prompt: str, max_tokens: int) -> Answer:
    async with openai.AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0) as api:
        model = (await api.models.list()).data[0].id
        start = time.perf_counter()
        first = last = None
        parts = []
        chunks = await api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens, temperature=0.0, stream=True,
        )  # fmt: skip
        async for chunk in chunks:
            for choice in chunk.choices:
                if choice.delta.content:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    parts.append(choice.delta.content)
    if first is None:
        return Answer("", 0.0, 0.0)
    return Answer("".join(parts), first - start, last - first)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the model without speculation")
    p.add_argument("--api-key", default="none")
    p.add_argument("--workload", choices=sorted(PROMPTS), default="repetitive")
    p.add_argument("--requests", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--model", default=None, help="a .gguf for the tokenizer (default: SmolLM2)")
    p.add_argument(
        "--row-cost",
        type=float,
        default=0.14,
        help="a draft row's cost in plain decode steps (draft_step's x plain - 1) / k",
    )
    p.add_argument(
        "--ngram", default="5:5:5,10:2:5", help="prompt lookup settings to replay, k:min:max each"
    )
    p.add_argument("--oracle-k", default="5,16")
    args = p.parse_args(argv)
    from gateway.tokenizer_files import load_tokenizer
    from llmcommon.model_files import default_gguf_path

    tok = load_tokenizer(args.model or str(default_gguf_path()))
    make = PROMPTS[args.workload]
    texts = [make(args.seed, i) for i in range(args.requests)]
    answers = [asyncio.run(ask(args.base_url, args.api_key, t, args.output_tokens)) for t in texts]
    pairs = []
    for text, answer in zip(texts, answers, strict=True):
        rendered = tok.apply_chat_template([{"role": "user", "content": text}])
        pairs.append((tok.encode(rendered, add_special_tokens=False),
                      tok.encode(answer.text, add_special_tokens=False)))  # fmt: skip
    proposers = {}
    for spec in args.ngram.split(","):
        k, n_min, n_max = (int(v) for v in spec.split(":"))
        proposers[f"ngram k={k} min={n_min} max={n_max}"] = potential.lookup(k, n_min, n_max)
    for k in (int(v) for v in args.oracle_k.split(",")):
        proposers[f"oracle k={k}"] = potential.oracle(k)
    ttft = statistics.median(a.ttft for a in answers)
    decode = statistics.median(a.decode for a in answers)
    tokens = sum(len(a) for _, a in pairs)
    print(
        f"{args.workload} prompts, seed {args.seed}: {args.requests} answers, {tokens} tokens; "
        f"median TTFT {ttft * 1e3:.0f} ms, decode {decode:.2f} s; row cost {args.row_cost}"
    )
    print(
        f"{'proposer':28}{'drafted %':>10}{'tok/step':>9}{'free':>7}{'costed':>8}{'end-to-end':>11}"
    )
    for name, fn in proposers.items():
        r = total([replay(prompt, answer, fn) for prompt, answer in pairs])
        share = 100 * r.accepted / r.tokens if r.tokens else 0.0
        costed = r.speedup(args.row_cost)
        e2e = (ttft + decode) / (ttft + decode / costed) if costed else 0.0
        print(
            f"{name:28}{share:>9.0f}%{r.per_step:>9.2f}{r.speedup(0):>6.2f}x{costed:>7.2f}x"
            f"{e2e:>10.2f}x"
        )


if __name__ == "__main__":
    main()
