"""Chat tasks whose answers repeat their prompt, or do not: the workloads of speculative
decoding's benchmark (docs/speculative.md).

`repetitive`: rewrite a given code block with one change, quote a list back, summarise a text
quoting its sentences: an answer that copies long runs of its prompt, where a lookup in the
prompt drafts well. `open`: questions whose answers are the model's own prose (a story, an
explanation, advice), where a lookup drafts little. Every prompt is made from the seed and the
request's index (templates and word lists here, no data downloaded): two runs send the same.
"""

from __future__ import annotations

import functools
import random

from llmserve.bench.workload import RequestSpec, Workload

NOUNS = (
    "river apple engine window garden ticket marble lantern violin harbor pepper canyon "
    "blanket rocket meadow candle spider button glacier parrot compass wallet hammer "
    "pillow tunnel orchard falcon saddle beacon"
).split()
VERBS = "sorts counts merges filters joins scales parses checks rounds splits".split()
NAMES = "total items values result buffer count index limit offset scores".split()
TOPICS = (
    "how tides form|why bread rises|how a bicycle stays upright|how vaccines train the body|"
    "why the sky is blue|how bees make honey|how a compass works|why cats purr|"
    "how rainbows appear|how a lighthouse guides ships"
).split("|")


def _code(rng: random.Random) -> tuple[str, str, str]:
    """A small Python module; the name to rename, and the new one."""
    names = rng.sample(NAMES, 4)
    lines = []
    for _ in range(3):
        verb = rng.choice(VERBS)
        a, b = rng.randint(2, 9), rng.randint(10, 99)
        lines += [
            f"def {verb}_{NOUNS[rng.randrange(len(NOUNS))]}({names[0]}, {names[1]}={a}):",
            f'    """{verb.capitalize()} the {names[0]} by {names[1]}."""',
            f"    {names[2]} = []",
            f"    for {names[3]} in {names[0]}:",
            f"        if {names[3]} % {names[1]} == 0:",
            f"            {names[2]}.append({names[3]} * {b})",
            f"    return {names[2]}",
            "",
        ]
    return "\n".join(lines).rstrip(), names[2], rng.choice([n for n in NAMES if n not in names])


def repetitive_prompt(seed: int, index: int) -> str:
    rng = random.Random(f"repetitive:{seed}:{index}")
    kind = index % 3
    if kind == 0:
        code, old, new = _code(rng)
        return (
            f"Rewrite this Python code with one change: rename the variable `{old}` to `{new}`. "
            f"Reply with the whole code only.\n\n```python\n{code}\n```"
        )
    if kind == 1:
        items = [f"{rng.choice(NOUNS)} {rng.randint(1, 500)}" for _ in range(24)]
        listed = "\n".join(f"- {item}" for item in items)
        return f"Repeat this list back exactly as it is, one item per line:\n\n{listed}"
    sentences = [
        f"The {rng.choice(NOUNS)} near the {rng.choice(NOUNS)} was {rng.randint(2, 90)} years old."
        for _ in range(8)
    ]
    text = " ".join(sentences)
    return f"Summarise this text, quoting each of its sentences word for word:\n\n{text}"


def open_prompt(seed: int, index: int) -> str:
    rng = random.Random(f"open:{seed}:{index}")
    kind = index % 3
    if kind == 0:
        return f"Write a short story about a {rng.choice(NOUNS)} and a {rng.choice(NOUNS)}."
    if kind == 1:
        return f"Explain {rng.choice(TOPICS)}, in simple words."
    return f"Give me three pieces of advice for someone who just bought a {rng.choice(NOUNS)}."


PROMPTS = {"repetitive": repetitive_prompt, "open": open_prompt}


class TaskPrompts:
    """Content (workload.py) of chat tasks: one user message per request."""

    def __init__(self, kind: str, seed: int = 0) -> None:
        if kind not in PROMPTS:
            raise ValueError(f"unknown task prompts {kind!r} (of {', '.join(PROMPTS)})")
        self.kind, self.seed = kind, seed

    @property
    def label(self) -> str:
        what = {
            "repetitive": "rewrite a code block with one change, quote a list back, summarise "
            "quoting the text",
            "open": "a short story, an explanation, advice",
        }[self.kind]
        return f"{self.kind} chat tasks ({what}; seed {self.seed})"

    def text(self, index: int) -> str:
        return PROMPTS[self.kind](self.seed, index)

    def prompt_ids(self, spec: RequestSpec, history: list[int]) -> list[int]:
        return _tokenizer().encode(self.text(spec.index))

    def served_input(self, spec: RequestSpec, history: list[tuple[str, str]]):
        return [("user", self.text(spec.index))]


@functools.cache
def _tokenizer():
    from gateway.tokenizer import load_default_tokenizer

    return load_default_tokenizer()


def task_workload(
    kind: str, requests: int, output_tokens: int, concurrency: int, seed: int = 0
) -> Workload:
    """`requests` chat tasks from `concurrency` clients (closed loop), each answer
    `output_tokens` long (ignore_eos, as every served workload)."""
    content = TaskPrompts(kind, seed)
    specs = [
        RequestSpec(i, len(content.prompt_ids(RequestSpec(i, 0, 0), [])), output_tokens)
        for i in range(requests)
    ]
    return Workload(
        f"{kind}-{concurrency}x+{output_tokens}",
        specs,
        max(concurrency, 1),
        {"kind": f"{kind} tasks", "output_len": output_tokens, "seed": seed},
        content,
    )
