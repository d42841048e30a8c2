"""Prompts of an exact token length: one word that is a single token in SmolLM2's vocabulary."""

from __future__ import annotations

import functools

WORD = " a"  # token 253 in SmolLM2's vocabulary; " a" * n encodes to exactly n tokens
WORD_ID = 253
# what a workload without its own content sends, as every report states it
ONE_WORD = (
    "one repeated word (every request's prompt is the same text, so a prefix cache hits across "
    "requests)"
)


def prompt_text(tokens: int) -> str:
    if tokens < 1:
        raise ValueError("a prompt needs at least one token")
    return WORD * tokens


def prompt_ids(tokens: int) -> list[int]:
    """The token ids the gateway makes of `prompt_text(tokens)` (for the transformers baseline)."""
    return [WORD_ID] * tokens


@functools.cache
def check_with_tokenizer(tokens: int = 64) -> None:
    """Fail loudly if the tokenizer no longer maps the word to one token."""
    from gateway.tokenizer import load_default_tokenizer

    ids = load_default_tokenizer().encode(prompt_text(tokens))
    if ids != prompt_ids(tokens):
        raise RuntimeError(f"{WORD!r} * {tokens} is not {tokens} x token {WORD_ID}: {ids[:8]}...")
