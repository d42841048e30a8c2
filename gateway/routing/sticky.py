"""A stable 64-bit digest of a name (Python's own hash of a str differs between processes), for
rendezvous hashing of sessions over cells (router.py)."""

from __future__ import annotations

import hashlib


def digest64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
