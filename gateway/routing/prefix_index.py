"""What each cell is likely to hold in its prefix cache, as the router saw it: the block keys of
the prompts routed there (and, where a cell reports evictions, less those).

One dict maps a key to a bit mask of the cells that have it, so that a prompt is matched against
every cell at once. Per cell, its keys are two generations of sets (an approximate LRU, as a
two-hand clock is): a touched key joins the young set; when the young set reaches half the
capacity, the old one is forgotten and the young one becomes old. So a cell holds at most
`capacity` keys, and a key survives at least capacity/2 newer keys.

A prompt's keys are chained (a key names its block and every block before it), and a prompt's
keys are always touched together, so a cell's set is prefix-closed: if it holds a prompt's key d,
it holds keys 0..d. Matching therefore binary-searches where cells drop out along the prompt
instead of walking every block: O(depths x log blocks) lookups, whatever the number of cells.

Memory: at most cells x `capacity` keys, each in one of its cell's sets and in the mask dict,
and as many branch points at most (about 170 bytes a key in CPython; docs/cells.md gives the
figure measured).
"""

from __future__ import annotations


class _CellKeys:
    __slots__ = ("young", "old")

    def __init__(self) -> None:
        self.young: set[int] = set()
        self.old: set[int] = set()

    def __len__(self) -> int:
        return len(self.young) + len(self.old)


class PrefixIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.cells: dict[int, _CellKeys] = {}
        self.masks: dict[int, int] = {}  # key -> bit mask of the slots that have it
        # keys where a routed prompt's match ended and the prompt went on with blocks of its
        # own: branch points, as a shared system prompt is (cleared when it outgrows the keys)
        self.branches: set[int] = set()

    def add_cell(self, slot: int) -> None:
        self.cells.setdefault(slot, _CellKeys())

    def remove_cell(self, slot: int) -> None:
        """Forget what `slot` holds (a cell that left, or restarted with an empty cache)."""
        cell = self.cells.get(slot)
        if cell is None:
            return
        self._clear(cell.young | cell.old, 1 << slot)
        self.cells[slot] = _CellKeys()

    def insert(self, slot: int, keys: list[int]) -> None:
        """`slot` was sent a prompt of these keys: it holds them now (or soon)."""
        cell = self.cells[slot]
        young = cell.young
        if not keys or keys[-1] in young:
            return  # (its blocks before it were touched with it, young is prefix-closed)
        lo, hi = 0, len(keys) - 1  # the first key not young
        while lo < hi:
            mid = (lo + hi) // 2
            if keys[mid] in young:
                lo = mid + 1
            else:
                hi = mid
        fresh = set(keys[lo:])
        new = fresh - cell.old
        cell.old -= fresh
        cell.young |= fresh
        masks, bit = self.masks, 1 << slot
        for key in new:
            masks[key] = masks.get(key, 0) | bit
        if 2 * len(cell.young) >= self.capacity:
            self._clear(cell.old, bit)
            cell.old, cell.young = cell.young, set()

    def branched(self, key: int) -> None:
        """A prompt matched up to `key`, then went on with its own blocks."""
        if len(self.branches) >= max(len(self.masks), 1024):
            self.branches.clear()
        self.branches.add(key)

    def shared(self, key: int, mask: int) -> bool:
        """Is the prefix ending at `key` (held by the slots of `mask`) a shared one: held by
        several cells, or a branch point already?"""
        return bool(mask & (mask - 1)) or key in self.branches

    def forget(self, slot: int, keys: list[int]) -> None:
        """`slot` reports these keys evicted."""
        cell = self.cells[slot]
        gone = (cell.young | cell.old).intersection(keys)
        cell.young -= gone
        cell.old -= gone
        self._clear(gone, 1 << slot)

    def depths(self, keys: list[int], among: int) -> list[tuple[int, int]]:
        """Of the slots of the mask `among`, which hold how many of `keys`' leading blocks:
        (depth, mask of the slots holding exactly that many) pairs, deepest last, depth 0 left
        out."""
        out: list[tuple[int, int]] = []
        get, n = self.masks.get, len(keys)
        mask, start = among, 0
        while mask and start < n:
            lo, hi = start, n  # the first block some slot of `mask` lacks, in lo..hi
            while lo < hi:
                mid = (lo + hi) // 2
                if get(keys[mid], 0) & mask == mask:
                    lo = mid + 1
                else:
                    hi = mid
            if lo == n:
                break
            have = get(keys[lo], 0) & mask
            if lo:
                out.append((lo, mask ^ have))
            mask, start = have, lo + 1
        if mask and n:
            out.append((n, mask))
        return out

    def matches(self, keys: list[int], among: int) -> dict[int, int]:
        """Per slot of `among` holding any, how many of `keys`' leading blocks it holds."""
        return {slot: d for d, mask in self.depths(keys, among) for slot in bits(mask)}

    def size(self, slot: int) -> int:
        return len(self.cells.get(slot, ()))

    def _clear(self, keys: set[int], bit: int) -> None:
        masks = self.masks
        for key in keys:
            left = masks.get(key, 0) & ~bit
            if left:
                masks[key] = left
            else:
                masks.pop(key, None)


def bits(mask: int) -> list[int]:
    """The slots of a bit mask, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
