"""KV block accounting for one worker's pool (no data, only ownership)."""

from __future__ import annotations

from collections import deque


def blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocated(self, request_id: str) -> int:
        return len(self.tables.get(request_id, ()))

    def can_grow(self, request_id: str, positions: int) -> bool:
        return self.missing(request_id, positions) <= len(self.free)

    def missing(self, request_id: str, positions: int) -> int:
        """Blocks still to allocate so that `request_id` holds `positions` positions."""
        return max(0, -(-positions // self.block_size) - len(self.tables.get(request_id, ())))

    def grow(self, request_id: str, positions: int) -> list[int]:
        """Allocate what is missing; return the new blocks (appended to its table)."""
        table = self.tables.get(request_id)
        if table is None:
            table = self.tables[request_id] = []
        need = -(-positions // self.block_size) - len(table)
        if need <= 0:
            return []
        popleft = self.free.popleft
        new = [popleft() for _ in range(need)]
        table += new
        return new

    def release(self, request_id: str) -> None:
        self.free.extend(self.tables.pop(request_id, ()))

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])
