"""What the core keeps per worker: its pool's ownership, its running requests, its counters."""

from __future__ import annotations

from collections import Counter

from scheduler_svc.blocks import BlockPool, blocks_for
from scheduler_svc.config import WorkerSpec
from scheduler_svc.output import WorkerKv
from scheduler_svc.sequence import Sequence


class WorkerState:
    def __init__(self, spec: WorkerSpec, index: int) -> None:
        self.index = index
        self.spec = spec
        self.pool = BlockPool(spec.num_blocks, spec.block_size)
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.prefilling: set[Sequence] = set()  # running, with prompt (chunks) still to compute
        self.done: list[tuple[Sequence, int]] = []  # finished while running: leave next step
        self.released: list[int] = []  # handles freed since the last step sent
        self.next_handle = 0
        self.healthy = True
        self.draining = False  # stopping: finishes what it runs, takes nothing new
        self.gone = False  # left the stack; its index stays taken
        self.batch_closed = False  # static mode: the batch has started (a step planned for it)
        self.steps = 0
        self.stalls: Counter[str] = Counter()
        self.prompt_tokens = 0  # tokens needing KV at admissions here
        self.hit_tokens = 0  # of those, found in the prefix cache
        self.lost_evictions = 0  # evictions counted by pools this worker had before

    @property
    def live(self) -> bool:
        """May new requests be placed here?"""
        return self.healthy and not self.draining

    @property
    def free_positions(self) -> int:
        return self.pool.num_free * self.spec.block_size

    def reset_pool(self, spec: WorkerSpec | None = None) -> None:
        """A fresh view of the pool (a replacement worker may bring another size)."""
        self.spec = spec or self.spec
        self.lost_evictions += self.pool.evictions
        self.pool = BlockPool(self.spec.num_blocks, self.spec.block_size)
        self.released.clear()
        self.prefilling.clear()
        self.batch_closed = False

    def reserved_unused(self) -> int:
        """Blocks held by running requests beyond what their planned KV needs."""
        bs = self.spec.block_size
        return sum(
            self.pool.allocated(s.request_id) - blocks_for(s.num_computed, bs) for s in self.running
        )

    def kv(self) -> WorkerKv:
        """Positions as the pool holds them: a block shared by several requests counts once
        (shared blocks are full and written; only each request's own tail is unwritten)."""
        bs, pool = self.spec.block_size, self.pool
        allocated = (pool.num_blocks - pool.num_free) * bs
        unwritten = sum(pool.allocated(s.request_id) * bs - s.num_computed for s in self.running)
        return WorkerKv(
            name=self.spec.name,
            capacity=self.spec.capacity,
            written=allocated - unwritten,
            reserved_unwritten=unwritten,
            free=pool.num_free * bs,
            running=len(self.running),
            healthy=self.healthy,
            draining=self.draining,
            block_size=bs,
            max_context=self.spec.max_context,
            steps=self.steps,
            stalls=dict(self.stalls),
            cached_blocks=len(pool.key_of),
            evictable_blocks=len(pool.evictable),
            evictions=self.lost_evictions + pool.evictions,
            prompt_tokens=self.prompt_tokens,
            hit_tokens=self.hit_tokens,
        )
