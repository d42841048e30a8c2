"""Prompt lookup (vLLM's `ngram` method): the tokens that followed the most recent earlier
occurrence of a request's last n tokens, in its own prompt and output, n from
`prompt_lookup_max` down to `prompt_lookup_min` (the longest match wins).

Where the match is followed by fewer than k tokens, its continuation runs to the end: the text
repeats with that continuation as its period (the last n tokens occur again s tokens later, and
s tokens follow the match), so the draft goes on repeating it, up to k (vLLM stops at the end; a
run of one token, `- - - -`, would otherwise draft one token a step).

The search runs in C: the tokens are packed as 32-bit ids and `bytes.rfind` finds the pattern
from the end; a hit that is not on an id boundary is skipped."""

from __future__ import annotations

from array import array

WIDTH = 4  # bytes of a packed token id


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens to follow `tokens`, or none if no n-gram of its end recurs earlier."""
    if k <= 0 or len(tokens) < n_min + 1:
        return []
    packed = array("I", tokens).tobytes()
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        at = _last_earlier(packed, n)
        if at is not None:
            follow = tokens[at + n : at + n + k]
            while len(follow) < k:  # it ran to the end: the text repeats with this period
                follow += follow[: k - len(follow)]
            return follow
    return []


def _last_earlier(packed: bytes, n: int) -> int | None:
    """The token index of the latest occurrence of the last `n` tokens that ends before the
    last token (so that at least one token follows it), or None."""
    pattern = packed[-n * WIDTH :]
    end = len(packed) - WIDTH  # the match must end before the last token
    while True:
        byte = packed.rfind(pattern, 0, end)
        if byte < 0:
            return None
        if byte % WIDTH == 0:
            return byte // WIDTH
        end = byte + len(pattern) - 1  # a misaligned hit: look before it
