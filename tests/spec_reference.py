"""A plain-list reference of the speculation replay (what a verifying worker would emit per step),
written apart from scheduler_svc/speculation/potential.py's packed one, which the tests hold to
it: tokens as lists, searched by slicing, one draft list a step."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.speculation.ngram import propose_ngram


@dataclass(frozen=True, slots=True)
class Steps:
    tokens: int  # the answer's tokens after its first (the prompt step's)
    steps: int  # decode steps (each emits its accepted draft plus one token)
    drafted: int  # draft tokens verified
    accepted: int  # of those, accepted


def replay(prompt: list[int], answer: list[int], propose) -> Steps:
    """`propose(context, answer, done)` gives a draft for the context (the prompt and the answer's
    first `done` tokens); each step keeps its longest prefix that matches the answer, plus one
    token. The first token is the prompt's step's: the replay starts after it."""
    done = min(1, len(answer))
    steps = drafted = accepted = 0
    while done < len(answer):
        context = prompt + answer[:done]
        draft = propose(context, answer, done)[: len(answer) - done - 1]
        ok = 0
        while ok < len(draft) and draft[ok] == answer[done + ok]:
            ok += 1
        steps, drafted, accepted = steps + 1, drafted + len(draft), accepted + ok
        done += ok + 1
    return Steps(len(answer) - min(1, len(answer)), steps, drafted, accepted)


def ngram(k: int, n_min: int, n_max: int):
    """Prompt lookup as the scheduler runs it, on lists."""
    return lambda context, answer, done: propose_ngram(context, k, n_min, n_max)


def oracle(k: int):
    """The answer's next tokens as far as they occur earlier in the context (up to k), an
    occurrence starting in the context and possibly running on into the stretch itself."""

    def propose(context: list[int], answer: list[int], done: int) -> list[int]:
        best = 0
        for j in range(1, min(k, len(answer) - done) + 1):
            stretch = answer[done : done + j]
            if not occurs(context + stretch[:-1], stretch):
                break
            best = j
        return answer[done : done + best]

    return propose


def occurs(haystack: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))
