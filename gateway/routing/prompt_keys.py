"""A prompt's block keys as the router compares them: the scheduler's chained keys
(llmcommon/block_keys.py) over the prompt's full blocks, salted as the scheduler salts them, each
held as its Python hash (an int: 8 bytes to compare and store where the key is 64)."""

from __future__ import annotations

from llmcommon.block_keys import block_keys


def prompt_keys(
    prompt_ids: list[int], block_size: int, salt: bytes = b"", max_blocks: int = 1024
) -> list[int]:
    """The hashes of the keys of `prompt_ids`' first full blocks (at most `max_blocks`)."""
    full = min(len(prompt_ids) // block_size, max_blocks)
    return [hash(key) for key in block_keys(prompt_ids, block_size, [], full, salt)]
