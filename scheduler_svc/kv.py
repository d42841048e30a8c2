"""One worker's KV as the scheduler asks about it, in terms of requests (vLLM v1's
KVCacheManager is the model): the cached blocks a request can start from, the blocks it needs,
allocate (new blocks, or None), commit what a step wrote to the prefix cache, free (keeping or
dropping its cache), distrust what a failed step wrote. The block pool (blocks.py) and the
prefix keys stay behind it: the core never touches a block table, and this never sees the core
or its per-worker state.

What it keeps of each request (its keys, how far it is cached, whether it is suspect) is a
record of its own (kv_records.py), shared by every worker's manager; the core never reads one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduler_svc.blocks import BlockPool, blocks_for
from scheduler_svc.kv_records import KEY_MEMO, KvRecords
from scheduler_svc.reasons import StallReason
from scheduler_svc.sequence import Sequence

HIT_BATCH = 32  # blocks hashed at a time past a request's known keys to look up its cache hit


@dataclass(frozen=True, slots=True)
class KvUsage:
    """Positions as the pool holds them: a block shared by several requests counts once."""

    written: int
    unwritten: int  # allocated to running requests, not written yet
    free: int
    cached_blocks: int
    evictable_blocks: int
    evictions: int


class Held(dict[Sequence, int]):
    """Positions each request's blocks cover; none for a request that holds no block."""

    def __missing__(self, seq: Sequence) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class FailedWork:
    """Work of a failed step: its request, the first position it wrote, the blocks it wrote,
    and whether the request's table on this worker is still the one that work wrote into."""

    seq: Sequence
    start: int
    blocks: list[int]
    owns_table: bool


class KvManager:
    """One worker's blocks and prefix cache. With `caching` off, nothing is looked up, cached
    or distrusted: only allocation."""

    def __init__(
        self, num_blocks: int, block_size: int, caching: bool, records: KvRecords | None = None
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.caching = caching
        self.records = records if records is not None else KvRecords()
        self.recent: dict[bytes, list[int]] = {}  # first key -> its latest hit here (`_remember`)
        self._held = Held()

    # ---- what is free ----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def free_positions(self) -> int:
        return self.pool.num_free * self.block_size

    def sent(self) -> None:
        """The steps planned so far are sent: what they cached is readable from now on."""
        self.pool.fresh.clear()

    # ---- admission -------------------------------------------------------------------------

    def hit(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` would start from here; at least its last known token is
        always computed, for the logits that sample the next one."""
        if not self.caching:
            return []
        bs, match = self.block_size, self.pool.match
        upto = (seq.num_planned - 1) // bs
        keys_of = self.records.keys_of
        keys = keys_of(seq, 0, bs)
        if not keys and upto > 1:
            self.records.reuse(seq, bs, upto)
        if not self.pool.cached:  # nothing cached yet: nothing to look up
            return []
        like = self.recent.get(keys[0], []) if keys else []
        hit = self.pool.match_as(keys[:upto], like)
        while True:  # hash only as far as the cache matches (then the chunks hash the rest)
            known = min(len(keys), upto)
            hit += match(keys[len(hit) : known])
            if len(hit) < known or known == upto:
                break
            keys_of(seq, min(upto, max(2 * known, known + HIT_BATCH)), bs)
        if hit:
            self._remember(keys[0], hit)
        return hit

    def _remember(self, first: bytes, hit: list[int]) -> None:
        """The latest hit of the requests whose first key is `first`: the blocks the next one
        checks first (a shared document, a conversation's history)."""
        recent = self.recent
        recent.pop(first, None)
        recent[first] = hit
        if len(recent) > KEY_MEMO:
            del recent[next(iter(recent))]

    def why_not_admit(
        self, hit: list[int], end: int, reserve: int | None, running: list[Sequence]
    ) -> StallReason | None:
        """Can a request starting from `hit` cached blocks hold `end` positions now (and
        `reserve` positions from the start, when not None)? It needs blocks for the rest only,
        plus the cached ones that nobody holds (sharing takes them out of the evictable,
        counted-free ones).
        KV_RESERVED: it would fit but for blocks the `running` hold beyond their written KV."""
        now = blocks_for(end, self.block_size) - len(hit) + self.pool.evictable_in(hit)
        need = now if reserve is None else blocks_for(reserve, self.block_size)
        free = self.pool.num_free
        if reserve is not None:  # a reservation fits beside what the running may still take
            need += self.owed(running)
        if need <= free:
            return None
        if now <= free + self.reserved_unused(running):
            return StallReason.KV_RESERVED
        return StallReason.KV_CAPACITY

    def place(self, seq: Sequence, hit: list[int]) -> None:
        """`seq`, placed here, starts its table with these cached blocks (maybe none): they are
        cached; its own are not yet, and what it computes from here is computed anew."""
        record = self.records.records.get(seq)
        if record is None and self.caching:  # off, a missing record reads as this reset
            record = self.records.of(seq)
        if record is not None:
            record.suspect, record.cached_to = False, len(hit) * self.block_size
        if hit:
            self.pool.share(seq.request_id, hit)
            self._held[seq] = len(hit) * self.block_size

    @property
    def held(self) -> Callable[[Sequence], int]:
        """`held(seq)`: positions its blocks here cover. A dict's own lookup, no Python call:
        the step loop asks it of every running request."""
        return self._held.__getitem__

    def mark_suspect(self, seq: Sequence) -> None:
        """A failed step's KV is under `seq`'s: it caches nothing of it when it leaves."""
        self.records.of(seq).suspect = True

    # ---- allocation ------------------------------------------------------------------------

    def allocate(self, seq: Sequence, positions: int) -> list[int] | None:
        """The new blocks that let `seq` hold `positions` positions (none if it does), or None
        if the pool has not enough free ones."""
        new = self.pool.try_grow(seq.request_id, positions)
        if new:
            self._held[seq] += len(new) * self.block_size
        return new

    def blocks(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The blocks positions start..end of `seq` are written into."""
        bs = self.block_size
        return self.pool.tables[seq.request_id][start // bs : blocks_for(end, bs)]

    def free(self, seq: Sequence, keep_cache: bool = True) -> None:
        """`seq` leaves this worker. With `keep_cache`, the full blocks its steps wrote and
        its chunks did not cache (those its decodes filled) are cached first, as far as its
        tokens are known."""
        if self.caching and keep_cache:
            self.commit(seq, self.records.of(seq).cached_to, min(seq.num_computed, seq.num_tokens))
        self.pool.release(seq.request_id)
        self._held.pop(seq, None)

    def owed(self, running: list[Sequence]) -> int:
        """Blocks `running` requests may still take to reach their most positions: none for
        those reserved whole, some for those admitted under paged and still growing (the
        policy changed to reserve since)."""
        bs, allocated = self.block_size, self.pool.allocated
        return sum(max(0, blocks_for(s.max_planned, bs) - allocated(s.request_id)) for s in running)

    def trim(self, seq: Sequence) -> int | None:
        """Release `seq`'s blocks beyond those its planned KV needs (reserved, unwritten): the
        blocks it keeps, or None if it held none beyond them."""
        keep = blocks_for(seq.num_computed, self.block_size)
        if not self.pool.shrink(seq.request_id, keep):
            return None
        self._held[seq] = keep * self.block_size
        return keep

    def set_caching(self, on: bool) -> None:
        """Prefix caching turned on or off; off forgets every cached block (nothing then checks
        what a failed step wrote into them, so none may be found later)."""
        if self.caching and not on:
            self.pool.uncache(list(self.pool.cached.values()))
        self.caching = on

    def reserved_unused(self, running: list[Sequence]) -> int:
        """Blocks held by `running` beyond what their planned KV needs."""
        bs, allocated = self.block_size, self.pool.allocated
        return sum(allocated(s.request_id) - blocks_for(s.num_computed, bs) for s in running)

    def usage(self, running: list[Sequence]) -> KvUsage:
        """Shared blocks are full and written; only each request's own tail is unwritten."""
        bs, pool = self.block_size, self.pool
        allocated = (pool.num_blocks - pool.num_free) * bs
        unwritten = sum(pool.allocated(s.request_id) * bs - s.num_computed for s in running)
        return KvUsage(
            written=allocated - unwritten,
            unwritten=unwritten,
            free=pool.num_free * bs,
            cached_blocks=len(pool.key_of),
            evictable_blocks=len(pool.evictable),
            evictions=pool.evictions,
        )

    # ---- the prefix cache ------------------------------------------------------------------

    def commit(self, seq: Sequence, start: int, end: int) -> None:
        """Positions start..end of `seq` are (or will be, by its steps sent) written: cache the
        full blocks among them, under its tokens' keys."""
        bs = self.block_size
        first, last = start // bs, end // bs
        record = self.records.of(seq)
        if last <= first or record.suspect:
            return
        keys = self.records.keys_of(seq, last, bs)
        pool = self.pool
        table = pool.tables[seq.request_id]
        pool.cache_all(table[first:last], keys[first:last])
        record.cached_to = max(record.cached_to, last * bs)

    def distrust(self, failed: list[FailedWork], others: list[Sequence]) -> list[Sequence]:
        """This work failed: the KV it wrote, and everything computed over it since, is not to
        be trusted. Its requests cache nothing more; the blocks it wrote, their requests' later
        blocks, and those cached under their keys from the failed positions on leave the cache;
        and so, transitively, does every block one of `others` (in admission order) filled over
        a distrusted one. Returns those others, newest first: the caller recomputes them (or,
        if finished, marks them suspect)."""
        if not self.caching:
            return []
        bad = self._failed_blocks(failed)
        if not bad:
            return []
        tainted = self._spread(bad, others)
        key_of = self.pool.key_of
        self.pool.uncache([b for b in bad if b in key_of])
        return tainted

    def _failed_blocks(self, failed: list[FailedWork]) -> set[int]:
        """The blocks the failed work wrote or its requests computed over them."""
        pool, bs = self.pool, self.block_size
        bad: set[int] = set()
        for work in failed:
            seq, start = work.seq, work.start
            record = self.records.of(seq)
            record.suspect = True
            bad.update(work.blocks)
            if work.owns_table:
                bad.update(pool.table(seq.request_id)[start // bs :])
            if record.key_block_size == bs:
                keys = record.keys[start // bs :]
                bad.update(b for b in map(pool.cached.get, keys) if b is not None)
        return bad

    def _spread(self, bad: set[int], others: list[Sequence]) -> list[Sequence]:
        """The requests of `others` whose tables hold a distrusted block: their blocks from that
        one on join `bad`, until no more request is reached. Newest first."""
        pool = self.pool
        tainted: dict[Sequence, None] = {}
        grew = True
        while grew:
            grew = False
            for seq in others:
                if seq in tainted:
                    continue
                table = pool.table(seq.request_id)
                first = next((i for i, b in enumerate(table) if b in bad), None)
                if first is not None:
                    bad.update(table[first:])
                    tainted[seq] = None
                    grew = True
        return [s for s in others if s in tainted][::-1]
