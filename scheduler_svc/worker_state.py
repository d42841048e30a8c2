"""What the core keeps per worker: its KV manager, its running requests, its counters."""

from __future__ import annotations

from collections import Counter, deque
from itertools import islice

from scheduler_svc.config import MAX_TIME_WINDOW, WorkerSpec
from scheduler_svc.kv import KvManager
from scheduler_svc.kv_records import KvRecords
from scheduler_svc.output import WorkerKv
from scheduler_svc.run_rule import LoopOverhead
from scheduler_svc.sequence import Sequence


class WorkerState:
    def __init__(
        self, spec: WorkerSpec, index: int, caching: bool, records: KvRecords | None
    ) -> None:
        self.index = index
        self.spec = spec
        self.caching, self.records = caching, records
        self.kv = KvManager(spec.num_blocks, spec.block_size, caching, records)
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.prefilling: set[Sequence] = set()  # running, with prompt (chunks) still to compute
        self.done: list[tuple[Sequence, int]] = []  # finished while running: leave next step
        self.released: list[int] = []  # handles freed since the last step sent
        self.trims: list[tuple[int, int]] = []  # (handle, blocks kept) since the last step sent
        self.next_handle = 0
        self.healthy = True
        self.draining = False  # stopping: finishes what it runs, takes nothing new
        self.gone = False  # left the stack; its index stays taken
        self.down_since: float | None = None  # failed at (core clock), until it is back
        self.batch_closed = False  # static mode: the batch has started (a step planned for it)
        self.steps = 0
        self.overhead = LoopOverhead()  # its loop's period outside the forward (--decode-runs)
        # the predicted seconds of its last planned steps (--step-time-window), newest last
        self.planned_s: deque[float] = deque(maxlen=MAX_TIME_WINDOW)
        self.stalls: Counter[str] = Counter()
        # fair share: its last step's decodes counted by tenant, and what they were (a key)
        self.prompt_tokens = 0  # tokens needing KV at admissions here
        self.hit_tokens = 0  # of those, found in the prefix cache
        self.lost_evictions = 0  # evictions counted by pools this worker had before

    def time_limit(self, budget_s: float, window: int) -> float:
        """The predicted seconds this worker's next step may take under a step-time budget held
        on average over `window` steps: what its last window - 1 planned steps left of window x
        budget (a window of 1: the budget itself)."""
        if window <= 1:
            return budget_s
        return window * budget_s - sum(islice(reversed(self.planned_s), window - 1))

    @property
    def live(self) -> bool:
        """May new requests be placed here?"""
        return self.healthy and not self.draining

    @property
    def free_positions(self) -> int:
        return self.kv.free_positions

    def reset_pool(self, spec: WorkerSpec | None = None) -> None:
        """A fresh view of the pool (a replacement worker may bring another size)."""
        self.spec = spec or self.spec
        self.lost_evictions += self.kv.pool.evictions
        self.kv = KvManager(self.spec.num_blocks, self.spec.block_size, self.caching, self.records)
        self.released.clear()
        self.trims.clear()
        self.prefilling.clear()
        self.batch_closed = False

    def report(self) -> WorkerKv:
        """Positions as the pool holds them, and this worker's counters."""
        usage = self.kv.usage(self.running)
        return WorkerKv(
            name=self.spec.name,
            capacity=self.spec.capacity,
            written=usage.written,
            reserved_unwritten=usage.unwritten,
            free=usage.free,
            running=len(self.running),
            healthy=self.healthy,
            draining=self.draining,
            block_size=self.spec.block_size,
            max_context=self.spec.max_context,
            steps=self.steps,
            stalls=dict(self.stalls),
            cached_blocks=usage.cached_blocks,
            evictable_blocks=usage.evictable_blocks,
            evictions=self.lost_evictions + usage.evictions,
            prompt_tokens=self.prompt_tokens,
            hit_tokens=self.hit_tokens,
        )
