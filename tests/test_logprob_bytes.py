"""Logprobs of tokens that are parts of characters (an emoji, CJK): each token keeps its own
bytes (OpenAI's `bytes`, from which a client rebuilds the text) and its own name (`bytes:\\xNN`
where its bytes are not whole characters), so completions' `top_logprobs` dict loses no
alternative to another that decodes to the same U+FFFD, and the chosen token's entry holds its
own logprob; `text_offset` says where each token's first byte falls in the text."""

from __future__ import annotations

import pytest

from gateway.openai_responses import logprobs_body
from gateway.tokenizer import load_default_tokenizer
from llmcommon.v1 import common_pb2


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_tokenizer()


def body(tokenizer, chat: bool, ids: list[int], tops: list[list[int]], offset: int = 0):
    logprobs = [
        common_pb2.TokenLogprobs(
            logprob=-0.5 - i,
            top_ids=top,
            top_logprobs=[-0.5 - i - j for j in range(len(top))],
        )
        for i, top in enumerate(tops)
    ]
    return logprobs_body(
        chat, ids, logprobs, lambda t: tokenizer.decode([t]), tokenizer.token_bytes, offset
    )


def test_the_bytes_of_parts_of_characters_rebuild_the_text(tokenizer) -> None:
    text = "🚀 東京 and café"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # some tokens are parts of characters
    got = body(tokenizer, True, ids, [[t] for t in ids])["content"]
    assert b"".join(bytes(e["bytes"]) for e in got).decode() == text
    partial = [e for e in got if e["token"].startswith("bytes:")]
    assert partial and all("\ufffd" not in e["token"] for e in got)
    first = got[0]
    assert first["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in first["bytes"])
    whole = [e for e in got if e["token"] == " and"]
    assert whole and whole[0]["bytes"] == list(b" and")
    assert got[0]["top_logprobs"][0]["bytes"] == got[0]["bytes"]


def test_completions_top_logprobs_keep_every_alternative_under_its_own_key(tokenizer) -> None:
    ids = tokenizer.encode("🚀🔥東", add_special_tokens=False)
    partial = [t for t in ids if "\ufffd" in tokenizer.decode([t])]
    assert len(set(partial)) >= 3
    chosen = partial[0]
    # the chosen token first (likeliest), then other parts of characters and a whole word
    alternatives = [chosen, *[t for t in partial if t != chosen][:2]]
    alternatives.append(tokenizer.encode(" word", add_special_tokens=False)[0])
    got = body(tokenizer, False, [chosen], [alternatives])
    top = got["top_logprobs"][0]
    assert len(top) == len(alternatives)  # before: parts of characters shared one key
    assert top[got["tokens"][0]] == -0.5 == got["token_logprobs"][0]
    assert top[" word"] == -3.5


def test_a_name_spelled_twice_keeps_the_likelier_value(tokenizer) -> None:
    word = tokenizer.encode(" word", add_special_tokens=False)[0]
    got = body(tokenizer, False, [word], [[word, word]])
    assert got["top_logprobs"][0] == {" word": -0.5}


def test_text_offsets_count_characters_where_each_token_begins(tokenizer) -> None:
    text = "ab 🚀 東京 cd"
    ids = tokenizer.encode(text, add_special_tokens=False)
    got = body(tokenizer, False, ids, [[t] for t in ids], offset=10)
    raws = [tokenizer.token_bytes(t) for t in ids]
    seen = b""
    for raw, at in zip(raws, got["text_offset"], strict=True):
        assert at == 10 + len(seen.decode("utf-8", "ignore"))  # the characters wholly before
        seen += raw
    assert got["text_offset"][0] == 10
    assert got["text_offset"][-1] == 10 + text.index(" cd")


def test_a_control_token_is_its_text(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    got = body(tokenizer, True, [eos], [[eos]])["content"][0]
    assert got["token"] == tokenizer.decode([eos]) and bytes(got["bytes"]) == got["token"].encode()
