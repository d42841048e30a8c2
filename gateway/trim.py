"""Give the memory that a long text took to tokenize back to the operating system.

The tokenizer's Rust code allocates tens of MB for a long text, in the pool's threads; glibc
keeps what they free in per-thread arenas, so without a trim the gateway's resident memory stays
at the high-water mark of its largest requests, also when idle. `malloc_trim` returns the free
pages, in the pool's thread (ctypes runs it without the GIL; the figures: docs/figures.md).
"""

from __future__ import annotations

import ctypes

__all__ = ["LARGE_TEXT_CHARS", "trim_after"]

LARGE_TEXT_CHARS = 1 << 16  # a text from this size on is followed by a trim

try:
    _malloc_trim = ctypes.CDLL(None).malloc_trim
except AttributeError:  # not glibc: nothing to do
    _malloc_trim = None


def trim_after(chars: int) -> None:
    """Called after tokenizing a text of `chars` characters."""
    if _malloc_trim is not None and chars >= LARGE_TEXT_CHARS:
        _malloc_trim(0)
