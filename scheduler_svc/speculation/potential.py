"""What speculation would give on this server's own traffic, speculating or not: each finished
request's output replayed step by step, as a verifying worker would take drafts (the longest
matching prefix plus one token), against two proposers:

- `ngram`: prompt lookup at the server's settings (`--num-speculative-tokens`,
  `--prompt-lookup-min/max`), as `--speculative ngram` would draft;
- `oracle`: the longest stretch of the output's next tokens (up to the same K) that occurs
  anywhere earlier in the request's prompt and output, an occurrence that may run on into the
  stretch itself (a repeating period). No proposer that copies earlier text drafts more: its
  tokens per step bound prompt lookup's, and the suffix index's on text that does not repeat
  other requests'.

Tokens per step (output tokens / steps) is what a step would emit; the share of tokens that came
from drafts is what the drafts would save. Each step is also priced by the step-time model of the
worker that ran the request, as the request's step alone (one stream): the drafts' steps against
one decode a token, whose ratio is the decode speed speculation would give at one stream on that
worker (a draft of k is a chunk of 1 + k tokens, every row sampled: `BatchShape.draft`).

The output's first token is the prompt's step's, which no draft joins: a replay steps through
the tokens after it, as the decodes that sample them. **Bounded.** A replay takes the output's
last `OUTPUT_TOKENS` tokens, over at most
`CONTEXT_TOKENS` of context. It runs in the step loop when a request finishes, so it is also
bounded in time: after a replay of d seconds none runs for the next (1 / SHARE - 1) * d, so the
replays take at most SHARE of the loop's time, whatever the host or the traffic; a finish in that
window is counted as skipped. The searches are `bytes.find` / `rfind` over the tokens packed as
32-bit ids (C speed)."""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_svc.speculation.ngram import WIDTH, propose_packed

OUTPUT_TOKENS = 512  # of a finished request's output, the last ones replayed
CONTEXT_TOKENS = 8192  # of its prompt and output, the most a replay searches
SHARE = 0.01  # of the step loop's time, the most the replays take
PROPOSERS = ("ngram", "oracle")


@dataclass(slots=True)
class Replayed:
    """A proposer's replays, summed."""

    requests: int = 0
    tokens: int = 0  # output tokens replayed
    steps: int = 0  # decode steps they would take
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of those, accepted
    # the steps' time by the worker's step-time model, one request alone: with the drafts, and
    # one token a step (0 where no model priced them)
    step_seconds: float = 0.0
    plain_seconds: float = 0.0

    def add(self, tokens: int, steps: int, drafted: int, accepted: int, seconds=0.0, plain=0.0):
        self.requests += 1
        self.tokens += tokens
        self.steps += steps
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.step_seconds += seconds
        self.plain_seconds += plain

    @property
    def per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


Propose = Callable[[bytes, int, int], tuple[int, int]]
# (the position of the token a decode feeds, its draft's length) -> the step's seconds
Price = Callable[[int, int], float]


def replay(
    packed: bytes, start: int, propose: Propose, price: Price | None = None, offset: int = 0
) -> tuple[int, int, int, int, float, float]:
    """Steps through the tokens of `packed` (32-bit ids) from token `start` to the end, each step
    asking `propose(packed, done, room)` for the length of its draft after the first `done`
    tokens (at most `room`: the tokens left minus the step's own) and how many of it match what
    follows; returns (tokens, steps, draft tokens, accepted tokens, seconds, plain seconds):
    with `price`, the steps' seconds, and those of one decode a token (token i of `packed` sits
    at position offset + i)."""
    total = len(packed) // WIDTH
    done, steps, drafted, accepted, seconds = start, 0, 0, 0, 0.0
    while done < total:
        room = total - done - 1
        length, ok = propose(packed, done, room)
        if price is not None:
            seconds += price(offset + done - 1, length)
        steps, drafted, accepted = steps + 1, drafted + length, accepted + ok
        done += ok + 1
    tokens = total - start
    # one decode a token, positions offset + start - 1 ... offset + total - 2: the step-time
    # model is linear in a decode's position, so their sum is `tokens` decodes at the middle one
    plain = tokens * price(offset + (start + total - 3) / 2, 0) if price and tokens else 0.0
    return tokens, steps, drafted, accepted, seconds, plain


def lookup(k: int, n_min: int, n_max: int) -> Propose:
    """Prompt lookup's draft after the first `done` tokens: (its length, its tokens that match
    what follows)."""

    def propose(packed: bytes, done: int, room: int) -> tuple[int, int]:
        draft = propose_packed(packed[: done * WIDTH], min(k, room), n_min, n_max)
        want = array("I", packed[done * WIDTH : (done + len(draft)) * WIDTH]).tolist()
        ok = 0
        while ok < len(draft) and draft[ok] == want[ok]:
            ok += 1
        return len(draft), ok

    return propose


def oracle(k: int) -> Propose:
    """The longest stretch of the next tokens (up to k) found earlier: drafted and all kept.
    An occurrence starts in the context and may run on into the stretch itself: a copy of a
    repeating period, which prompt lookup drafts whole (ngram.propose_packed), so that the
    oracle bounds it (it had not: K=16 with lookup 1..8 drafted more on periodic text)."""

    def propose(packed: bytes, done: int, room: int) -> tuple[int, int]:
        end = done * WIDTH  # the context: the first `done` tokens
        best, at = 0, 0  # the longest found so far, and where its occurrence starts (bytes)
        for j in range(1, min(k, room) + 1):
            needle = packed[end : end + j * WIDTH]
            if best and packed[at : at + j * WIDTH] == needle:
                best = j  # the same occurrence goes on (it starts before `end`)
                continue
            # starts before `end`: ends at most j - 1 tokens into the stretch
            found = _aligned_find(packed, needle, at, end + (j - 1) * WIDTH)
            if found < 0:
                break
            best, at = j, found
        return best, best

    return propose


def _aligned_find(packed: bytes, needle: bytes, start: int, end: int) -> int:
    """The first occurrence of `needle` on a token boundary in packed[start:end], or -1."""
    while True:
        at = packed.find(needle, start, end)
        if at < 0 or at % WIDTH == 0:
            return at
        start = at + 1


class Potential:
    """The replays of finished requests, per proposer, within SHARE of the loop's time."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.replayed = {name: Replayed() for name in PROPOSERS}
        self.skipped = 0  # finishes not replayed: within a replay's quiet time
        self.seconds = 0.0  # spent replaying
        self.clock = clock
        self._quiet_until = 0.0

    def observe(
        self,
        prompt: list[int],
        output: list[int],
        k: int,
        n_min: int,
        n_max: int,
        price: Price | None = None,
    ) -> None:
        """A request finished with `output` after `prompt`: replay it, unless a recent replay's
        quiet time runs; `price` prices its steps (the step-time model of its worker)."""
        # the first token is the prompt's step's, never drafted: the decodes' tokens are after it
        tail = output[1:][-OUTPUT_TOKENS:]
        if not tail:
            return
        now = self.clock()
        if now < self._quiet_until:
            self.skipped += 1
            return
        head = (prompt + output[: len(output) - len(tail)])[-(CONTEXT_TOKENS - len(tail)) :]
        packed = array("I", head + tail).tobytes()
        start, offset = len(head), len(prompt) + len(output) - len(head) - len(tail)
        for name, propose in (("ngram", lookup(k, n_min, n_max)), ("oracle", oracle(k))):
            self.replayed[name].add(*replay(packed, start, propose, price, offset))
        spent = self.clock() - now
        self.seconds += spent
        self._quiet_until = now + spent / SHARE
