"""Streaming detokenization: turn generated token ids into text deltas as they arrive.

Byte-level BPE tokens are byte strings, so one token can end in the middle of a multi-byte UTF-8
character. Decoding the whole sequence after every token would be quadratic; instead we use
vLLM's prefix/read-offset technique and decode only a sliding window, `ids`:

* `ids[:read_offset]` are the last few tokens whose text was already emitted (kept as context so
  the window decodes the same way the full sequence does; older ones are dropped),
* `ids[read_offset:]` are the tokens not yet emitted.

The new text is `decode(ids) minus decode(ids[:read_offset])`. While it ends with U+FFFD (an
incomplete byte sequence that later tokens may complete) we emit nothing and keep the tokens
pending. `flush()` releases whatever is left, U+FFFD included, so that the concatenated deltas
equal `tokenizer.decode(all_ids)` exactly.

Because the tokenizer has no normalizer and a byte-level decoder (no cleanup of spaces), decoding
is concatenative except for invalid bytes, which makes the window exact.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# Tokens of emitted context to keep in the window. A UTF-8 character is at most 4 bytes, so a few
# tokens before the read offset are enough for an incomplete character to be decoded in context.
_CONTEXT_TOKENS = 5


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """Incremental decoder for one sequence. Not thread-safe; one per request."""

    __slots__ = ("_tokenizer", "_skip_special", "_ids", "_read_offset")

    def __init__(
        self,
        tokenizer: _Decoder,
        skip_special_tokens: bool = False,
        prompt_ids: list[int] | None = None,
    ) -> None:
        """`prompt_ids`, if given, serve as decoding context only: their text is never emitted."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:]) if prompt_ids else []
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_ids: list[int]) -> str:
        """Add generated ids; return the text they complete (possibly empty)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[: self._read_offset])
        new_text = self._decode(self._ids)
        if new_text.endswith(_REPLACEMENT) or len(new_text) <= len(prefix_text):
            # an incomplete character at the end: wait for the bytes that complete it
            return ""
        self._advance()
        return new_text[len(prefix_text) :]

    def _advance(self) -> None:
        """Everything pushed so far has been emitted: keep the last few tokens as context."""
        del self._ids[:-_CONTEXT_TOKENS]  # ids that can never enter a window again
        self._read_offset = len(self._ids)

    def flush(self) -> str:
        """Release held-back text (an incomplete character decodes to U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[: self._read_offset])
        new_text = self._decode(self._ids)
        self._advance()
        return new_text[len(prefix_text) :]
