"""A prompt's block keys: the chained hashes the scheduler's prefix cache keys its blocks by
(scheduler_svc/blocks.py), and the gateway's router matches prompts to the cells that cached
them with (gateway/routing/). One definition, so that both compute the same keys."""

from __future__ import annotations

import hashlib
from array import array


def block_keys(
    tokens: list[int],
    block_size: int,
    keys: list[bytes],
    upto: int,
    salt: bytes = b"",
    offset: int = 0,
) -> list[bytes]:
    """Extend `keys` (the keys of `tokens`' first full blocks, as computed so far) to `upto`
    blocks; `tokens` may start at position `offset`, a block boundary at or before the first
    block still to hash. Each key is BLAKE2b (512 bits, its own size) over the previous key and
    this block's token ids: a cryptographic hash, so that no client can craft a prompt whose
    blocks collide with another's and read or poison its KV (a plain 64-bit hash of the tokens
    would allow it). The previous key and a block of 16 ids are one 128-byte BLAKE2b block; the
    ids are packed once, then hashed a slice at a time, about 0.5 µs a block (the C hash is most
    of it: a `digest_size` of 32 or 16 bytes costs 15% more, for the keyword alone; SHA-256
    twice as much). A `salt` seeds the chain (hashed apart, so that no salt can equal a key):
    chains of different salts share no key, hence no block.
    """
    first = len(keys)
    if upto <= first:
        return keys
    prev = keys[-1] if keys else salt and hashlib.blake2b(salt, person=b"llmserve-salt").digest()
    data = array("I", tokens[first * block_size - offset : upto * block_size - offset]).tobytes()
    blake2b, width = hashlib.blake2b, 4 * block_size
    for at in range(0, len(data), width):
        prev = blake2b(prev + data[at : at + width]).digest()
        keys.append(prev)
    return keys
