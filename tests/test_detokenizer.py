"""gateway.detokenizer: streamed deltas concatenate to the full decode, never with broken UTF-8."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.detokenizer import IncrementalDetokenizer
from gateway.tokenizer import Tokenizer, load_default_tokenizer

REPLACEMENT = "\ufffd"

# text that exercises multi-byte characters: emoji (incl. ZWJ sequences), CJK, combining marks
_pieces = st.one_of(
    st.characters(exclude_categories=["Cs"]),
    st.sampled_from(list("😀👍🏽👨‍👩‍👧🇯🇵中文字日本語한국어é́ñ ")),
    st.sampled_from(["<|im_end|>", "<|endoftext|>", " the", "\n", "  "]),
)
rich_text = st.lists(_pieces, max_size=40).map("".join)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_default_tokenizer()


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    deltas: list[str] = []
    i = 0
    sizes = iter(chunk_sizes)
    while i < len(ids):
        n = max(1, next(sizes, 1))
        deltas.append(detok.push(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


@settings(max_examples=150, deadline=None)
@given(rich_text, st.lists(st.integers(1, 4), max_size=80), st.booleans())
def test_deltas_concatenate_to_full_decode(
    tok: Tokenizer, text: str, chunks: list[int], skip_special: bool
) -> None:
    ids = tok.encode(text)
    deltas = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip_special), ids, chunks)
    full = tok.decode(ids, skip_special_tokens=skip_special)
    assert "".join(deltas) == full
    if REPLACEMENT not in full:
        assert not any(REPLACEMENT in d for d in deltas)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 49151), max_size=60), st.lists(st.integers(1, 3), max_size=60))
def test_arbitrary_ids_including_invalid_utf8(
    tok: Tokenizer, ids: list[int], chunks: list[int]
) -> None:
    """Random ids form stray/truncated byte sequences; the concatenation is still exact."""
    assert "".join(stream(IncrementalDetokenizer(tok), ids, chunks)) == tok.decode(ids)


def test_holds_back_partial_character(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "😀"
    assert detok.flush() == ""


def test_flush_releases_incomplete_tail(tok: Tokenizer) -> None:
    ids = tok.encode("a😀")[:-1]
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.push([i]) for i in ids)
    assert out == "a"
    assert out + detok.flush() == tok.decode(ids)


def test_empty_push_and_special_tokens(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    assert detok.push([]) == ""
    assert detok.push([tok.eos_token_id]) == ""
    assert detok.push(tok.encode(" hi")) == " hi"
    detok = IncrementalDetokenizer(tok)
    assert detok.push([tok.eos_token_id]) == "<|im_end|>"


def test_prompt_ids_are_context_only(tok: Tokenizer) -> None:
    prompt = tok.encode("Hello")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert detok.push(tok.encode(" world")) == " world"
    assert detok.flush() == ""


@pytest.mark.parametrize("prompt_text", ["x", "a longer prompt, then x"])
def test_a_character_split_by_the_prompts_end_decodes_as_the_whole_sequence_does(
    tok: Tokenizer, prompt_text: str
) -> None:
    """The prompt ends in the first byte of an emoji, the output brings the rest: the output's
    text is what the whole sequence decodes to after the prompt's own text (its last tokens are
    the context), not the stray bytes as replacement characters."""
    ids = tok.encode(prompt_text + "😀 done")
    split = len(tok.encode(prompt_text)) + 1  # the emoji's first byte ends the prompt
    prompt, out = ids[:split], ids[split:]
    assert tok.decode(prompt).endswith(REPLACEMENT)
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    text = "".join(detok.push([i]) for i in out) + detok.flush()
    assert text == tok.decode(ids)[len(tok.decode(prompt)) :]
    assert REPLACEMENT not in text


class _CountingDecoder:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.longest = 0
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.longest = max(self.longest, len(ids))
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decodes_only_a_window(tok: Tokenizer) -> None:
    counting = _CountingDecoder(tok)
    ids = tok.encode("word 中文 😀 " * 300)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(counting)
    out = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert out == tok.decode(ids)
    assert counting.longest <= 10


def test_the_window_is_the_last_five_emitted_tokens_and_the_new_one(tok: Tokenizer) -> None:
    """Plain text, one token at a time: each push decodes exactly 5 tokens of context and the
    new token, however long the stream (and a long prompt gives 5 tokens of context too)."""
    counting = _CountingDecoder(tok)
    ids = tok.encode(" one two three four five six seven eight nine ten" * 20)
    detok = IncrementalDetokenizer(counting, prompt_ids=tok.encode(" and so on" * 10))
    out = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert out == tok.decode(ids)
    assert counting.lengths == [5, 6] * len(ids)  # the context, then the context + the new one
