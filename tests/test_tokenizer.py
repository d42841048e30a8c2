"""gateway.tokenizer against transformers' tokenizer loaded from the same GGUF (offline)."""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.tokenizer import ChatTemplateError, Tokenizer, load_default_tokenizer
from llmcommon.model_files import default_gguf_path

TEXTS = [
    "Hello, world!",
    "hello world",
    "  leading spaces",
    " one leading space",
    "trailing spaces   ",
    "line one\nline two\n\n\nthree\r\nfour",
    "\ttabs\tand\n\tindent",
    "12345",
    "pi is 3.14159, year 2024, 1,000,000",
    "def f(x):\n    return x ** 2  # square\n",
    'for (int i = 0; i < n; ++i) { printf("%d\\n", i); }',
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇯🇵",
    "中文测试，你好世界。日本語のテキスト。한국어",
    "combining: e\u0301 a\u0300 n\u0303 Z\u0351\u0308",
    "Ünïcödé café naïve résumé",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|im_end|> inside and <|endoftext|> too",
    "<|im_start|><|im_start|>",
    "It's we're they've I'm you'll he'd",
    "   ",
    "\n",
    "",
    "URL: https://example.com/path?q=1&r=two#frag",
    "Привет, мир! Ελληνικά. العربية",
]

# Texts where the `smollm` pre-tokenizer (numbers isolated first) and plain GPT-2 splitting,
# which transformers' GGUF converter falls back to, give different ids.
DIGIT_SPLIT_TEXTS = ["a  1", "x\n 2", "x²³", "values:  42 and   7", "math: ∑ x² ≤ ∞, ½ + ¼"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_default_tokenizer()


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    path = default_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def smollm_oracle(hf, text: str) -> list[int]:
    """llama.cpp's `smollm` pre-tokenization on top of transformers: control tokens matched
    whole, then every \\p{N} isolated, then transformers' (GPT-2) split + BPE on each piece."""
    import regex

    specials = sorted(hf.all_special_tokens, key=len, reverse=True)
    ids: list[int] = []
    parts = regex.split("(" + "|".join(regex.escape(s) for s in specials) + ")", text)
    for part in parts:
        if part in specials:
            ids.append(hf.convert_tokens_to_ids(part))
            continue
        for piece in regex.split(r"(\p{N})", part):
            if piece:
                ids.extend(hf.encode(piece, add_special_tokens=False))
    return ids


def test_loads_fast_and_metadata() -> None:
    start = time.perf_counter()
    tok = Tokenizer.from_gguf(default_gguf_path())
    assert time.perf_counter() - start < 2.0
    assert tok.vocab_size == 49152
    assert tok.eos_token_id == 2
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.bos_token_id == 1
    assert tok.id_to_token(0) == "<|endoftext|>"
    assert tok.pre_tokenizer_type == "smollm"
    assert {0, 1, 2} <= tok.special_token_ids
    assert len(tok.special_token_ids) == 17


def test_load_default_is_cached() -> None:
    assert load_default_tokenizer() is load_default_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf, text: str) -> None:
    assert tok.encode(text) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS + DIGIT_SPLIT_TEXTS)
def test_encode_matches_llama_cpp_smollm_split(tok: Tokenizer, hf, text: str) -> None:
    assert tok.encode(text) == smollm_oracle(hf, text)


def test_digits_isolated_like_smollm(tok: Tokenizer, hf) -> None:
    ids = tok.encode("a  1")
    assert [tok.id_to_token(i) for i in ids] == ["a", "ĠĠ", "1"]
    # transformers' GGUF converter has no `smollm` entry and splits like GPT-2 here
    assert hf.convert_ids_to_tokens(hf.encode("a  1")) == ["a", "Ġ", "Ġ", "1"]


def test_no_bos_added(tok: Tokenizer) -> None:
    assert tok.encode("hi")[0] != tok.bos_token_id
    assert tok.encode("") == []


@pytest.mark.parametrize("text", TEXTS + DIGIT_SPLIT_TEXTS)
def test_decode_roundtrip(tok: Tokenizer, hf, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == hf.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_decode_skips_special(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi!<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\nHi!"


def test_decode_partial_utf8_gives_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1
    assert tok.decode(ids[:1]).endswith("\ufffd")


# Bytes the vocabulary has no token for: six C0 controls, and the lead bytes 0xF1-0xF7 of code
# points >= U+40000 (0xC0/0xC1/0xF8+ never occur in UTF-8). BPE drops them, as llama.cpp and
# transformers do, so text using them does not round-trip.
UNENCODABLE_CHARS = "\x04\x06\x13\x14\x16\x1d"
encodable_text = st.text(
    alphabet=st.characters(
        max_codepoint=0x3FFFF, exclude_categories=["Cs"], exclude_characters=UNENCODABLE_CHARS
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=40))
def test_encode_property_matches_oracle(tok: Tokenizer, hf, text: str) -> None:
    assert tok.encode(text) == smollm_oracle(hf, text)


@settings(max_examples=100, deadline=None)
@given(encodable_text)
def test_decode_roundtrip_property(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_unencodable_bytes_are_dropped(tok: Tokenizer) -> None:
    assert tok.decode(tok.encode("a\x16b")) == "ab"


def test_lone_surrogate_is_value_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="surrogate"):
        tok.encode("a\ud800")


def test_no_token_spells_more_characters_than_the_longest_token(tok: Tokenizer) -> None:
    """The gateway's default character limit rests on this: a text longer than the context times
    `longest_token_chars` cannot fit the context."""
    spelled = [len(tok.decode([i])) for i in range(tok.vocab_size)]
    assert max(spelled) <= tok.longest_token_chars == 81  # SmolLM2's: a newline and 80 spaces
    text = "\n" + " " * 80
    assert len(tok.encode(text * 100)) >= len(text * 100) / tok.longest_token_chars


CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tell me a joke about 🐍 and 中文"},
    ],
    [{"role": "user", "content": ""}],
    [{"role": "assistant", "content": "  leading\n\ntrailing  \n"}],
]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_transformers(tok: Tokenizer, hf, messages) -> None:
    ours = tok.apply_chat_template(messages)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")
    assert tok.encode(ours) == hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )


def test_chat_template_default_system_prompt(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    with_system = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "x"}]
    )
    assert with_system.startswith("<|im_start|>system\nS<|im_end|>\n")


def test_chat_template_raise_exception() -> None:
    from gateway.tokenizer import _compile_chat_template

    template = _compile_chat_template("{{ raise_exception('nope') }}")
    with pytest.raises(Exception, match="nope"):
        template.render(messages=[])
    assert issubclass(ChatTemplateError, ValueError)
