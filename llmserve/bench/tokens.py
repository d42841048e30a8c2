"""Synthetic prompt content: deterministic token ids per key, and the text that tokenizes to them.

Prefix caching needs prompts whose content repeats exactly where a workload says it does
(a conversation's history, a shared system prompt, a trace's equal hash ids) and differs
elsewhere. A `TokenSource` makes n token ids for a key from a seeded generator over a
vocabulary; the same (seed, key) always gives the same ids. For the simulation any ids do (the
default vocabulary avoids the special and end-of-sequence ids); for real processes the
vocabulary is the tokenizer's single-token words (" word"), so that the text of a run of them
encodes back to exactly those ids through the gateway.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from typing import Protocol

# SmolLM2's vocabulary has 49,152 ids; the special tokens and the byte tokens sit below 256.
SIM_VOCAB = range(256, 49152)
_WORD = re.compile(r"^[a-z]{2,12}$")
TextOf = Callable[[list[int]], str]  # word-token ids -> the text that encodes to them


class TokenSource:
    """Token ids for keys: `ids("sys", 3, n=512)` is the same list on every call and every run."""

    def __init__(self, vocab: Sequence[int] = SIM_VOCAB, seed: int = 0) -> None:
        if len(vocab) < 2:
            raise ValueError("a token vocabulary needs at least two ids")
        self.vocab = vocab
        self.seed = seed

    def ids(self, *key: object, n: int) -> list[int]:
        rng = random.Random(":".join(map(str, (self.seed, *key))))
        return rng.choices(self.vocab, k=n)


class WordTokenizer(Protocol):
    """The part of gateway.tokenizer.Tokenizer that word vocabularies use."""

    @property
    def vocab_size(self) -> int: ...

    def id_to_token(self, token_id: int) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def word_vocab(tokenizer: WordTokenizer) -> list[int]:
    """Ids of the tokens that are a space and a lowercase word ("Ġword" in byte-level BPE) and
    that the tokenizer gives back alone for that text: " w1 w2 ..." encodes to [w1, w2, ...]."""
    ids = [
        i
        for i in range(tokenizer.vocab_size)
        if tokenizer.id_to_token(i).startswith("Ġ") and _WORD.match(tokenizer.id_to_token(i)[1:])
    ]
    return [i for i in ids if tokenizer.encode(word_text([i], tokenizer), False) == [i]]


def word_text(ids: Sequence[int], tokenizer: WordTokenizer) -> str:
    """The text of word-token ids ("Ġcat" -> " cat")."""
    return "".join(" " + tokenizer.id_to_token(i)[1:] for i in ids)


def checked_word_vocab(tokenizer: WordTokenizer, minimum: int = 1000) -> list[int]:
    """`word_vocab`, refusing a tokenizer with too few such words, and checking one long text
    round-trips (words next to each other never merge)."""
    vocab = word_vocab(tokenizer)
    if len(vocab) < minimum:
        raise RuntimeError(
            f"the tokenizer has {len(vocab)} single-token lowercase words; synthetic prompts "
            f"need at least {minimum}"
        )
    sample = TokenSource(vocab, 0).ids("roundtrip", n=2048)
    if tokenizer.encode(word_text(sample, tokenizer), False) != sample:
        raise RuntimeError("a text of single-token words does not encode back to its words")
    return vocab
