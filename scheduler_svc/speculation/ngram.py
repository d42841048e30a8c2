"""Prompt lookup (vLLM's `ngram` method): the tokens that followed the most recent earlier
occurrence of a request's last n tokens, in its own prompt and output, n from
`prompt_lookup_max` down to `prompt_lookup_min` (the longest match wins).

Where the match is followed by fewer than k tokens, its continuation runs to the end: the text
repeats with that continuation as its period (the last n tokens occur again s tokens later, and
s tokens follow the match), so the draft goes on repeating it, up to k (vLLM stops at the end; a
run of one token, `- - - -`, would otherwise draft one token a step).

The search runs in C: the tokens are packed as 32-bit ids (`Packed` keeps a request's packing
and extends it by the tokens it sampled since) and `bytes.rfind` finds the pattern from the
end; a hit that is not on an id boundary is skipped."""

from __future__ import annotations

from array import array

WIDTH = 4  # bytes of a packed token id


class Packed:
    """A request's tokens packed as 32-bit ids, extended as its output grows."""

    __slots__ = ("data", "count")

    def __init__(self) -> None:
        self.data, self.count = bytearray(), 0

    def update(self, prompt: list[int], output: list[int]) -> bytearray:
        """The packing of prompt + output (which only grows at its end)."""
        if not self.count:
            self.data += array("I", prompt).tobytes()
            self.count = len(prompt)
        done = self.count - len(prompt)
        if done < len(output):
            self.data += array("I", output[done:]).tobytes()
            self.count = len(prompt) + len(output)
        return self.data


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens to follow `tokens`, or none if no n-gram of its end recurs earlier."""
    return propose_packed(array("I", tokens).tobytes(), k, n_min, n_max)


def propose_packed(packed: bytes | bytearray, k: int, n_min: int, n_max: int) -> list[int]:
    """`propose_ngram` of tokens packed as 32-bit ids."""
    count = len(packed) // WIDTH
    if k <= 0 or count < n_min + 1:
        return []
    for n in range(min(n_max, count - 1), n_min - 1, -1):
        at = _last_earlier(packed, n)
        if at is not None:
            start = (at + n) * WIDTH
            follow = array("I", packed[start : start + k * WIDTH]).tolist()
            while len(follow) < k:  # it ran to the end: the text repeats with this period
                follow += follow[: k - len(follow)]
            return follow
    return []


def _last_earlier(packed: bytes | bytearray, n: int) -> int | None:
    """The token index of the latest occurrence of the last `n` tokens that ends before the
    last token (so that at least one token follows it), or None."""
    pattern = bytes(packed[-n * WIDTH :])
    end = len(packed) - WIDTH  # the match must end before the last token
    while True:
        byte = packed.rfind(pattern, 0, end)
        if byte < 0:
            return None
        if byte % WIDTH == 0:
            return byte // WIDTH
        end = byte + len(pattern) - 1  # a misaligned hit: look before it
