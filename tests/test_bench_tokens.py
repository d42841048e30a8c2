"""Synthetic prompts through the gateway's tokenizer: texts of single-token words encode back to
exactly their ids, so equal content reaches the scheduler as equal tokens."""

from __future__ import annotations

import functools

import pytest

from gateway.tokenizer import load_default_tokenizer
from llmserve.bench import hash_trace as ht
from llmserve.bench.multiturn import MultiTurn, multiturn
from llmserve.bench.tokens import TokenSource, checked_word_vocab, word_text


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_tokenizer()


@pytest.fixture(scope="module")
def source(tokenizer) -> TokenSource:
    return TokenSource(checked_word_vocab(tokenizer), seed=5)


def test_a_hash_trace_prompt_text_encodes_to_its_ids(tokenizer, source) -> None:
    text = functools.partial(word_text, tokenizer=tokenizer)
    rows = [ht.HashRow(0, 900, 4, (3, 4)), ht.HashRow(5, 700, 4, (3, 9))]
    workload = ht.hash_trace_workload(rows, ht.HashPrompts(source), text)
    for spec in workload.requests:
        ids = workload.content.prompt_ids(spec, [])
        # as the gateway encodes a plain prompt (with the tokenizer's special tokens, none here)
        assert tokenizer.encode(workload.content.served_input(spec, [])) == ids
        assert len(ids) == spec.prompt_tokens
    a, b = (workload.content.prompt_ids(s, []) for s in workload.requests)
    assert a[:512] == b[:512] and a[512:700] != b[512:700]


def test_a_chat_turn_renders_to_the_previous_turn_and_its_answer_then_more(
    tokenizer, source
) -> None:
    shape = MultiTurn(conversations=1, turns=3, system_tokens=40, user_tokens=10, answer_tokens=8)
    workload = multiturn(shape, source, functools.partial(word_text, tokenizer=tokenizer))
    content, (first, second, _) = workload.content, workload.requests

    def ids(messages: list[tuple[str, str]]) -> list[int]:
        rendered = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages])
        return tokenizer.encode(rendered, add_special_tokens=False)  # as the gateway does

    turn1 = content.served_input(first, [])
    answer = "Sure, here it is.\n\nThe end."
    turn2 = content.served_input(second, [*turn1, ("assistant", answer)])
    one, two = ids(turn1), ids(turn2)
    assert two[: len(one)] == one  # the whole previous prompt, token for token
    system, user = content.system_ids(0), content.user_ids(first)
    assert _contains(one, system) and _contains(one, user)  # n words are n tokens in the chat
    assert _contains(two[len(one) :], content.user_ids(second))


def _contains(haystack: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))
