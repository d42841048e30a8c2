"""Multi-turn chat: conversations whose every turn resends the whole history (a system prompt
shared with other conversations, every earlier user message and answer, then the new message).

Conversations arrive open loop (Poisson, `rate` per second, or all at once); within one, turn
t+1 is sent a think time after turn t's answer ended, so its turns are sequential and the
conversations run concurrently. Think times and arrivals come from the seed, so two runs (prefix
caching on and off) get the same ones.

Through real processes a turn is a list of chat messages (the gateway renders them with the
model's chat template) and the history holds the answer text the server gave; in the
simulation a turn is token ids: the previous turn's prompt and generated ids, then the new
user message's ids.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from llmserve.bench.tokens import TextOf, TokenSource
from llmserve.bench.workload import RequestSpec, Workload


@dataclass(frozen=True, slots=True)
class MultiTurn:
    conversations: int = 8
    turns: int = 6  # per conversation
    system_prompts: int = 2  # conversation c uses system prompt c mod this
    system_tokens: int = 256
    user_tokens: int = 64  # each user message
    answer_tokens: int = 32  # each answer (max_tokens, ignore_eos)
    think_s: float = 2.0  # mean think time between an answer and the next turn (exponential)
    rate: float = 0.5  # conversations started per second (Poisson); 0 = all at once
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_prompts", "user_tokens", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.system_tokens < 0 or self.think_s < 0 or self.rate < 0:
            raise ValueError("system_tokens, think_s and rate must be >= 0")

    def index(self, conversation: int, turn: int) -> int:
        return conversation * self.turns + turn

    def nominal_prompt(self, turn: int) -> int:
        """Prompt tokens of turn `turn` in the simulation (a served prompt adds the template)."""
        exchange = self.user_tokens + self.answer_tokens
        return self.system_tokens + turn * exchange + self.user_tokens


def multiturn(shape: MultiTurn, source: TokenSource, text: TextOf | None = None) -> Workload:
    """The workload of `shape`; `text` turns word-token ids into text (real processes only)."""
    rng = random.Random(shape.seed)
    specs, start = [], 0.0
    for c in range(shape.conversations):
        for t in range(shape.turns):
            think = rng.expovariate(1 / shape.think_s) if shape.think_s and t else 0.0
            specs.append(
                RequestSpec(
                    shape.index(c, t),
                    shape.nominal_prompt(t),
                    shape.answer_tokens,
                    arrival_s=start if t == 0 else None,
                    follows=-1 if t == 0 else shape.index(c, t - 1),
                    think_s=think,
                    turn=t,
                )
            )
        if shape.rate:
            start += rng.expovariate(shape.rate)
    return Workload(
        f"multiturn-{shape.conversations}x{shape.turns}",
        specs,
        0,
        {"kind": "multi-turn chat"} | asdict(shape),
        MultiTurnContent(shape, source, text),
    )


class MultiTurnContent:
    def __init__(self, shape: MultiTurn, source: TokenSource, text: TextOf | None) -> None:
        self.shape = shape
        self.source = source
        self.text = text

    @property
    def label(self) -> str:
        s = self.shape
        return (
            f"multi-turn chat: {s.system_prompts} shared system prompt(s) of {s.system_tokens} "
            "tokens, each turn resending its conversation's history, user messages distinct"
        )

    def system_ids(self, conversation: int) -> list[int]:
        k = conversation % self.shape.system_prompts
        return self.source.ids("system", k, n=self.shape.system_tokens)

    def user_ids(self, spec: RequestSpec) -> list[int]:
        c = spec.index // self.shape.turns
        return self.source.ids("user", c, spec.turn, n=self.shape.user_tokens)

    def prompt_ids(self, spec: RequestSpec, history: list[int]) -> list[int]:
        before = history if spec.turn else self.system_ids(spec.index // self.shape.turns)
        return before + self.user_ids(spec)

    def served_input(
        self, spec: RequestSpec, history: list[tuple[str, str]]
    ) -> list[tuple[str, str]]:
        if self.text is None:
            raise RuntimeError("multi-turn prompts for real processes need a text vocabulary")
        user = ("user", self.text(self.user_ids(spec)))
        if spec.turn:
            return [*history, user]
        system = self.system_ids(spec.index // self.shape.turns)
        return [("system", self.text(system)), user] if system else [user]
