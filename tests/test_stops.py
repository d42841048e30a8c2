"""gateway.stops: streamed output equals the full text cut at the earliest stop string."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.stops import StopMatcher


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Cut before the occurrence completed first (ties: the one starting first)."""
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) != -1]
    return (text[: min(hits)[1]], True) if hits else (text, False)


def run(stops: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    matcher = StopMatcher(stops)
    out: list[str] = []
    hit = False
    for delta in deltas:
        emitted, hit = matcher.push(delta)
        out.append(emitted)
        if hit:
            break
    if not hit:
        out.append(matcher.flush())
    return "".join(out), hit, out


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# a small alphabet makes stop strings actually occur in random text
small = st.text(alphabet="ab😀中\n", max_size=40)
stops_strategy = st.lists(st.text(alphabet="ab😀中\n", min_size=1, max_size=4), max_size=4)


@settings(max_examples=400, deadline=None)
@given(small, stops_strategy, st.lists(st.integers(0, 40), max_size=12))
def test_random_splits_match_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    emitted, hit, _ = run(stops, split_at(text, cuts))
    assert (emitted, hit) == reference(text, stops)


@settings(max_examples=200, deadline=None)
@given(small, stops_strategy)
def test_char_by_char_matches_reference(text: str, stops: list[str]) -> None:
    emitted, hit, _ = run(stops, list(text))
    assert (emitted, hit) == reference(text, stops)


def test_stop_spanning_deltas() -> None:
    emitted, hit, out = run(["</end>"], ["Hello </", "en", "d> trailing"])
    assert (emitted, hit) == ("Hello ", True)
    assert out[0] == "Hello "  # "</" held back


def test_holds_back_only_possible_prefix() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("abcST") == ("abc", False)
    assert matcher.push("x") == ("STx", False)  # not a stop after all: released
    assert matcher.push("S") == ("", False)
    assert matcher.flush() == "S"


def test_overlapping_stops_earliest_wins() -> None:
    assert run(["bcd", "abc"], ["xabcd"])[:2] == ("x", True)
    assert run(["aab"], ["aa", "aab"])[:2] == ("aa", True)  # "aaaab": match starts at 2
    assert run(["world", "o w"], ["hell", "o world"])[:2] == ("hell", True)


def test_multiple_stops_and_matched() -> None:
    matcher = StopMatcher(["\n\n", "User:"])
    assert matcher.push("answer User") == ("answer ", False)
    assert matcher.push(": more") == ("", True)
    assert matcher.matched == "User:"
    assert matcher.push("anything") == ("", True)
    assert matcher.flush() == ""


def test_unicode_stops() -> None:
    assert run(["😀中"], ["a😀", "中b"])[:2] == ("a", True)
    assert run(["é"], ["cafe\u0301"])[:2] == ("cafe\u0301", False)  # no normalization


def test_no_stops_passes_through() -> None:
    matcher = StopMatcher([])
    assert matcher.push("abc") == ("abc", False)
    assert matcher.flush() == ""
    assert (matcher.stopped, matcher.matched) == (False, None)


def test_without_a_hit_nothing_is_matched_and_the_tail_is_released_once() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("the ST") == ("the ", False)
    assert (matcher.flush(), matcher.flush()) == ("ST", "")
    assert (matcher.stopped, matcher.matched) == (False, None)


def test_empty_stop_rejected() -> None:
    with pytest.raises(ValueError, match="^stop strings must be non-empty$"):
        StopMatcher(["ok", ""])


def test_first_completed_wins_over_leftmost_start() -> None:
    # "b" completes before "aba" does, however the text is split
    assert run(["b", "aba"], ["aba"])[:2] == ("a", True)
    assert run(["b", "aba"], ["a", "b", "a"])[:2] == ("a", True)
    # same end: the longer (earlier-starting) stop wins
    assert run(["b", "ab"], ["xab"])[:2] == ("x", True)


def test_stop_at_very_start() -> None:
    assert run(["abc"], ["abc", "def"])[:2] == ("", True)
