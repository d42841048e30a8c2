"""The scheduler core's own cost: microseconds per schedule() (and postprocess()) as running,
admitted and waiting requests grow. Pure Python, no model: what the core adds to every step."""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

from scheduler_svc.config import CoreConfig, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.sequence import Sequence

PROMPT = 32
FOREVER = 10**9


def schedule_all(core: Scheduler) -> list:
    """One lock-step execution on every worker, by this revision's name or an older one's
    (`bench core` runs these scenarios against another revision's core as its baseline)."""
    lockstep = getattr(core, "schedule_all", None)
    return lockstep() if lockstep is not None else core.schedule()


def finished(core: Scheduler, outputs: list) -> int:
    """How many requests these completions finished: what `complete` returned, or, from an
    older revision's core (which returns nothing and posts to an outbox), its events."""
    take = getattr(core, "take_events", None)
    if take is not None:
        return sum(1 for e in take() if e.finish is not None)
    return sum(len(out.finishes) for out in outputs)


@dataclass(frozen=True, slots=True)
class CoreCost:
    running: int
    admitted_per_step: int
    waiting: int
    schedule_us: float
    postprocess_us: float
    snapshot_us: float


class SteadyState:
    """`running` requests in decode (the running limit reached, so the queue only waits), of
    which `admit` slots take a new request from the queue every step (those finish after their
    first token and are replaced at the tail, so the queue keeps its length)."""

    def __init__(
        self,
        running: int,
        waiting: int,
        admit: int = 0,
        workers: int = 1,
        tenants: int = 0,
        policy: str = "",
    ) -> None:
        """`tenants` > 0: the requests belong to that many tenants in turn (equal weights and
        priorities, so each holds its share and none preempts another); `policy`: the queue's
        ordering ("" = the core's default, which is all an older revision's core knows)."""
        self.ids = itertools.count()
        self.short = admit
        self.tenants = tenants
        spec = [WorkerSpec(f"w{i}", 1 << 20, 16, 1 << 20) for i in range(workers)]
        ordering = {"queue_policy": policy} if policy else {}
        config = CoreConfig(token_budget=1 << 20, max_running=running // workers, **ordering)
        self.core = Scheduler(config, spec, clock=lambda: 0.0)
        for _ in range(running - admit):
            self.core.add(self._seq(FOREVER))
        for _ in range(4):  # prefill the long-lived ones; they stay in decode
            self._step()
        for _ in range(waiting):
            self.core.add(self._seq(1 if admit else FOREVER))

    def _seq(self, max_tokens: int) -> Sequence:
        n = next(self.ids)
        seq = Sequence(str(n), [5] * PROMPT, max_tokens, arrival=1.0)
        if self.tenants:
            from llmcommon.tenancy import Tenancy  # only asked of a core that has tenants

            seq.tenancy = Tenancy(tenant=f"t{n % self.tenants}")
        return seq

    def _step(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        steps = schedule_all(self.core)
        t1 = time.perf_counter()
        outputs = [self.core.complete(step, [7] * step.num_sampled) for step in steps]
        t2 = time.perf_counter()
        done = finished(self.core, outputs)
        for _ in range(done if self.short else 0):
            self.core.add(self._seq(1))
        return t1 - t0, t2 - t1

    def measure(self, steps: int) -> tuple[float, float]:
        for _ in range(3):
            self._step()
        times = [self._step() for _ in range(steps)]
        return (1e6 * min(t for t, _ in times), 1e6 * min(p for _, p in times))


def core_cost(
    running: int, waiting: int, admit: int = 0, steps: int = 30, tenants: int = 0, policy: str = ""
) -> CoreCost:
    state = SteadyState(running, waiting, admit, tenants=tenants, policy=policy)
    schedule_us, post_us = state.measure(steps)
    t = time.perf_counter()
    state.core.snapshot()
    snap_us = 1e6 * (time.perf_counter() - t)
    return CoreCost(running, admit, waiting, schedule_us, post_us, snap_us)


def default_grid(quick: bool = False) -> list[tuple[int, int, int]]:
    """(running, waiting, admitted per step)."""
    if quick:
        return [(64, 0, 0), (256, 0, 0), (256, 10_000, 0), (256, 10_000, 16)]
    grid = [(r, w, 0) for r in (32, 64, 128, 256) for w in (0, 10_000)]
    grid += [(256, w, 0) for w in (1_000, 100_000)]
    grid += [(256, 10_000, a) for a in (16, 64)]
    return grid


# ---- the prefix cache under a Mooncake-shaped load (issue 20, item 13) --------------------

HASH_BLOCK = 512  # tokens per hash id in Mooncake's traces
LONG_PROMPT = 30 * HASH_BLOCK  # 15,360 tokens
SHARED_BLOCKS = 4  # hash blocks each request shares with others (a system prompt)
PREFIXES = 16
NEVER_EVICTS = 1 << 26  # positions: more than the run ever holds
EVICTS = 4_000_000  # positions: 256 long requests fill it, so cached blocks are taken


@dataclass(frozen=True, slots=True)
class PrefixCost:
    running: int
    caching: bool
    positions: int
    steps: int
    schedule_us: float  # medians per step
    complete_us: float
    evictions: int
    hit_rate: float

    @property
    def total_us(self) -> float:
        return self.schedule_us + self.complete_us


class PrefixSteady:
    """One worker at its running limit with long prompts (the hash trace's shape at load): each
    request is a shared 2,048-token prefix (one of 16) and 13,312 tokens of its own, prefilled in
    chunks of the 8,192-token budget, then decodes a few hundred tokens and is replaced by a new
    one from a queue that never empties. Block size 16, as in `bench sim`."""

    def __init__(self, running: int, caching: bool, positions: int, block_size: int = 16) -> None:
        self.ids = itertools.count()
        spec = WorkerSpec("w0", positions // block_size, block_size, 32768)
        config = CoreConfig(token_budget=8192, max_running=running, prefix_caching=caching)
        self.core = Scheduler(config, [spec], clock=lambda: 0.0)
        self.prefixes = [
            [1000 + p * 7 + i % 97 for i in range(SHARED_BLOCKS * HASH_BLOCK)]
            for p in range(PREFIXES)
        ]
        for _ in range(running + 8):
            self._add()

    def _add(self) -> None:
        n = next(self.ids)
        own = [(n * 131 + i) % 50_000 + 3 for i in range(LONG_PROMPT - SHARED_BLOCKS * HASH_BLOCK)]
        prompt = self.prefixes[n % PREFIXES] + own
        self.core.add(Sequence(str(n), prompt, 100 + (n * 37) % 300, arrival=1.0))

    def step(self) -> tuple[float, float]:
        core = self.core
        t0 = time.perf_counter()
        steps = schedule_all(core)
        t1 = time.perf_counter()
        outputs = [core.complete(step, [7] * step.num_sampled) for step in steps]
        t2 = time.perf_counter()
        for _ in range(finished(core, outputs)):
            self._add()
        return t1 - t0, t2 - t1


def prefix_cost(
    running: int = 256, caching: bool = True, positions: int = NEVER_EVICTS, steps: int = 200
) -> PrefixCost:
    """Per-step core time (medians) once every request has been replaced at least once."""
    state = PrefixSteady(running, caching, positions)
    warm = 0
    while state.core.finished < running + 8 and warm < 20_000:  # the first batch replaced
        state.step()
        warm += 1
    times = [state.step() for _ in range(steps)]
    kv = state.core.snapshot().workers[0]
    return PrefixCost(
        running,
        caching,
        positions,
        steps,
        1e6 * statistics.median(t for t, _ in times),
        1e6 * statistics.median(c for _, c in times),
        kv.evictions,
        kv.hit_tokens / max(1, kv.prompt_tokens),
    )
