"""Stop strings over streamed text.

`StopMatcher.push(delta)` returns the text that is safe to emit now and whether a stop string was
hit. Text that could still turn out to be the start of a stop string is held back; when a stop is
hit, the output ends just before the earliest occurrence of any stop string (the stop itself is
not emitted, unless `include_stop`: vLLM's `include_stop_str_in_output`, then it ends just after
it) and everything after it is dropped.

"Earliest" means the occurrence that is completed first as text streams in: generation stops
the moment a stop string appears. Among occurrences completed by the same character the one that
starts first (the longer) wins. This only differs from "leftmost start" when an occurrence of one
stop lies strictly inside an occurrence of a longer stop, e.g. stops ["b", "aba"] on "aba" give
"a" (the "b" completes first), and it makes the result independent of how the text is split
into deltas. `matched` tells which stop string was hit.

Matching is on str code points, so it works for any Unicode text; stop strings are matched as
given (no Unicode normalization).
"""

from __future__ import annotations

__all__ = ["StopMatcher"]


class StopMatcher:
    """Find the first occurrence of any of `stops` in text that arrives in pieces."""

    __slots__ = ("_stops", "_include_stop", "_pending", "_done", "matched")

    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))  # de-duplicated, order kept
        self._include_stop = include_stop  # the text ends after the stop, not before it
        self._pending = ""  # text received but not yet emitted: a possible start of a stop
        self._done = False
        self.matched: str | None = None  # the stop string that was hit, if any

    @property
    def stopped(self) -> bool:
        return self._done

    @property
    def include_stop(self) -> bool:
        """Does the text keep what stopped it (vLLM's include_stop_str_in_output): the stop
        string, and the stop token's text?"""
        return self._include_stop

    @property
    def watching(self) -> bool:
        """Are there stop strings still to look for?"""
        return bool(self._stops) and not self._done

    def push(self, delta: str) -> tuple[str, bool]:
        """Add `delta`; return (text safe to emit now, whether a stop string was hit).

        After a hit, further pushes return ("", True).
        """
        if self._done:
            return "", True
        if not self._stops:
            return delta, False
        # what is pending is shorter than the longest stop: searching it again costs little
        text = self._pending + delta
        hit = self._earliest(text)
        if hit is not None:
            index, stop = hit
            self._done = True
            self.matched = stop
            return text[: index + len(stop) * self._include_stop], True
        keep = self._partial_suffix_len(text)
        cut = len(text) - keep
        self._pending = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """At end of stream: the held-back text (empty if a stop was hit)."""
        if self._done:
            return ""
        out, self._pending = self._pending, ""
        return out

    def _earliest(self, text: str) -> tuple[int, str] | None:
        """The occurrence that completes first (ties: the longer one, which starts earlier)."""
        hits = [
            (index + len(stop), index, stop)  # (end, start, stop): two stops never tie on both
            for stop in self._stops
            if (index := text.find(stop)) != -1
        ]
        if not hits:
            return None
        _, index, stop = min(hits)
        return index, stop

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(text), len(stop) - 1), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
