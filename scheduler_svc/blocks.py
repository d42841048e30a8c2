"""KV block accounting for one worker's pool (no data, only ownership), with the prefix cache.

A block is in exactly one of three states:
- **free**: no request holds it and its contents are worth nothing;
- **held** by one or more requests (`refs[block]` tables list it; only full blocks of a cached
  prefix are ever held by more than one, and nobody writes into those);
- **evictable**: nobody holds it, but its contents are a cached prefix block (it has a key);
  it is counted as free, and taken (least recently used first) when no free block is left.

A cached block's key is a hash chain over token ids (`block_keys`, llmcommon/block_keys.py, which
the gateway's router computes too): equal keys mean equal
tokens at equal positions from the start of the sequence, so equal KV.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from itertools import repeat

from llmcommon.block_keys import block_keys

__all__ = ["BlockPool", "Keys", "block_keys", "blocks_for", "common_blocks"]


def blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


def common_blocks(a: list[int], b: list[int], block_size: int, limit: int, start: int = 0) -> int:
    """How many leading full blocks (at most `limit`) `a` and `b` have equal, the first `start`
    known to be: slices compared in C, a run of 32 blocks first (of one past `start`),
    doubling, then halving the run that differs."""
    n = block_size
    lo, run = start, 1 if start else 32
    while lo < limit:
        hi = min(limit, lo + run)
        if a[lo * n : hi * n] != b[lo * n : hi * n]:
            return _equal_before(a, b, n, lo, hi)
        lo, run = hi, 2 * run
    return lo


def _equal_before(a: list[int], b: list[int], n: int, lo: int, hi: int) -> int:
    """Blocks (of `n` ids) before `lo` are equal and `lo..hi` holds one that is not: the
    first that is not, halving the run."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo * n : mid * n] == b[lo * n : mid * n]:
            lo = mid
        else:
            hi = mid
    return lo


class Keys(Mapping[int, bytes]):
    """block -> key of the cached blocks, read-only, over the pool's list indexed by block (a
    list is one memory access a block, a dict of millions of blocks two and a resize now and
    then: the per-block cost of a chunk). Iterating it scans the pool (checks and tests only)."""

    def __init__(self, by_block: list[bytes | None], cached: dict[bytes, int]) -> None:
        self._by_block, self._cached = by_block, cached

    def __getitem__(self, block: int) -> bytes:
        key = self._by_block[block] if 0 <= block < len(self._by_block) else None
        if key is None:
            raise KeyError(block)
        return key

    def __contains__(self, block: object) -> bool:
        by_block = self._by_block
        return type(block) is int and 0 <= block < len(by_block) and by_block[block] is not None

    def __iter__(self) -> Iterator[int]:
        return (block for block, key in enumerate(self._by_block) if key is not None)

    def __len__(self) -> int:
        return len(self._cached)  # a key names one block and a cached block has one key


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.refs = [0] * num_blocks  # how many tables list each block
        self.key_at: list[bytes | None] = [None] * num_blocks  # each cached block's key
        self.cached: dict[bytes, int] = {}  # key -> block
        self.key_of = Keys(self.key_at, self.cached)  # block -> key, for cached blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.fresh: set[int] = set()  # cached in the step being planned: not readable yet
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks a request can be given: free ones and evictable cached ones."""
        return len(self.free) + len(self.evictable)

    def allocated(self, request_id: str) -> int:
        return len(self.tables.get(request_id, ()))

    def can_grow(self, request_id: str, positions: int) -> bool:
        return self.missing(request_id, positions) <= self.num_free

    def missing(self, request_id: str, positions: int) -> int:
        """Blocks still to allocate so that `request_id` holds `positions` positions."""
        return max(0, -(-positions // self.block_size) - len(self.tables.get(request_id, ())))

    def try_grow(self, request_id: str, positions: int) -> list[int] | None:
        """`grow`, or None (nothing taken) if not enough blocks are free."""
        need = -(-positions // self.block_size) - len(self.tables.get(request_id, ()))
        if need > len(self.free) + len(self.evictable):
            return None
        return self.grow(request_id, positions)

    def grow(self, request_id: str, positions: int) -> list[int]:
        """Allocate what is missing; return the new blocks (appended to its table)."""
        table = self.tables.get(request_id)
        if table is None:
            table = self.tables[request_id] = []
        need = -(-positions // self.block_size) - len(table)
        if need <= 0:
            return []
        free = self.free
        if need <= len(free):
            popleft = free.popleft
            new = [popleft() for _ in range(need)]
        else:
            new = list(free)
            free.clear()
            new += self._evict(need - len(new))
        refs = self.refs
        for block in new:
            refs[block] = 1
        table += new
        return new

    def _evict(self, n: int) -> list[int]:
        """The `n` least recently used evictable blocks, their cached contents forgotten."""
        popitem, cached, key_at = self.evictable.popitem, self.cached, self.key_at
        taken = []
        for _ in range(n):
            block = popitem(False)[0]
            del cached[key_at[block]]
            key_at[block] = None
            taken.append(block)
        self.evictions += n
        return taken

    def release(self, request_id: str) -> None:
        """Drop the request's references. Its blocks whose last reference this was become free,
        or evictable if cached; the end of a sequence is evicted before its beginning."""
        table = self.tables.pop(request_id, ())
        refs, key_at, free = self.refs, self.key_at, self.free
        if not self.cached:  # nothing cached (caching off): no key to look at
            for block in table:
                refs[block] -= 1
                if not refs[block]:
                    free.append(block)
            return
        cached = []
        for block in table:
            left = refs[block] - 1
            refs[block] = left
            if not left:
                if key_at[block] is None:
                    free.append(block)
                else:
                    cached.append(block)
        evictable = self.evictable
        for block in reversed(cached):
            evictable[block] = None

    def shrink(self, request_id: str, keep: int) -> int:
        """Drop the request's blocks from `keep` on (unwritten, so never cached): they become
        free. Returns how many it dropped."""
        table = self.tables.get(request_id, [])
        dropped = table[keep:]
        del table[keep:]
        for block in dropped:
            self.refs[block] -= 1
            if not self.refs[block]:
                self.free.append(block)
        return len(dropped)

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    # ---- the prefix cache ----------------------------------------------------------------

    def match(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest run of `keys` from the start (none cached in the
        step being planned: their KV is written by that step), looked up in C."""
        blocks = list(map(self.cached.get, keys, repeat(-1)))  # a miss is -1
        if -1 in blocks:
            del blocks[blocks.index(-1) :]
        fresh = self.fresh
        if fresh and not fresh.isdisjoint(blocks):
            del blocks[next(i for i, block in enumerate(blocks) if block in fresh) :]
        return blocks

    def match_as(self, keys: list[bytes], like: list[int]) -> list[int]:
        """`like` (another request's hit, say) as far as `keys` go, if each of those blocks is
        cached under its key and readable (what `match` would find), else none: checked in one
        comparison of keys, without a dict lookup each."""
        n = min(len(like), len(keys))
        blocks = like[:n]
        if not n or list(map(self.key_at.__getitem__, blocks)) != keys[:n]:
            return []
        return blocks if self.fresh.isdisjoint(blocks) else []

    def share(self, request_id: str, blocks: list[int]) -> None:
        """A new request's table starts with these cached blocks (a reference each)."""
        table = self.tables.setdefault(request_id, [])
        assert not table  # a shared prefix starts the table
        refs, evictable = self.refs, self.evictable
        for block in blocks:
            held = refs[block]
            if not held:
                del evictable[block]
            refs[block] = held + 1
        table += blocks

    def evictable_in(self, blocks: list[int]) -> int:
        """How many of `blocks` nobody holds (sharing them takes them from the free count)."""
        refs = self.refs
        return sum(1 for block in blocks if refs[block] == 0)

    def cache(self, block: int, key: bytes) -> None:
        """`block`, held and full, holds the contents `key` names (once its step has run)."""
        self.cache_all([block], [key])

    def cache_all(self, blocks: list[int], keys: list[bytes]) -> None:
        """Each block, held and full, holds the contents its key names (once its step has run).
        A block already cached stays as it is. Contents cached before in another block are
        forgotten there: the newest computation of a key is the one the cache names, so a
        block that became stale can never outlive a recompute of its contents."""
        if len(blocks) != len(keys):
            raise ValueError(f"{len(blocks)} blocks for {len(keys)} keys")
        key_at = self.key_at
        if any(map(key_at.__getitem__, blocks)):
            return self._cache_each(blocks, keys)
        olds = list(map(self.cached.setdefault, keys, blocks))  # in C: each key new, usually
        if olds != blocks:
            for block, key, old in zip(blocks, keys, olds, strict=True):
                if old != block:
                    self._forget(old)
                    self.cached[key] = block
        deque(map(key_at.__setitem__, blocks, keys), 0)
        self.fresh.update(blocks)

    def _cache_each(self, blocks: list[int], keys: list[bytes]) -> None:
        """`cache_all` a block at a time, where some of them are cached already."""
        key_at, setdefault = self.key_at, self.cached.setdefault
        skipped: list[int] = []
        for block, key in zip(blocks, keys, strict=True):
            if key_at[block] is not None:
                skipped.append(block)  # already cached: it stays, and is not fresh for this
                continue
            old = setdefault(key, block)  # one lookup: the key is new (the usual case) or not
            if old is not block:
                self._forget(old)
                self.cached[key] = block
            key_at[block] = key
        self.fresh.update(set(blocks).difference(skipped))

    def uncache(self, blocks: Iterable[int]) -> None:
        """These cached blocks' contents cannot be trusted (their step failed): forget them."""
        for block in blocks:
            self._forget(block)

    def _forget(self, block: int) -> None:
        """A cached block loses its key; if nobody holds it, it is plainly free."""
        key = self.key_at[block]
        assert key is not None, f"block {block} is not cached"
        del self.cached[key]
        self.key_at[block] = None
        self.fresh.discard(block)
        if block in self.evictable:
            del self.evictable[block]
            self.free.append(block)
