"""llmcommon.errors.bounded: an error's details cut in their middle, saying how much."""

from __future__ import annotations

from llmcommon.errors import MAX_DETAILS_CHARS, bounded


def test_a_short_message_is_left_as_it_is() -> None:
    assert bounded("x" * MAX_DETAILS_CHARS) == "x" * MAX_DETAILS_CHARS


def test_a_long_message_keeps_its_start_and_end_and_says_what_was_cut() -> None:
    message = "slo_class '" + "x" * 100_000 + "' is not a class: have gold, silver"
    cut = bounded(message)
    assert len(cut) <= MAX_DETAILS_CHARS
    assert cut.startswith("slo_class 'xxx") and cut.endswith("' is not a class: have gold, silver")
    head, tail = cut.split("... (")[0], cut.split(" characters cut) ...")[1]
    dropped = int(cut.split("... (")[1].split(" ")[0])
    assert len(head) + dropped + len(tail) == len(message)
