"""Fair share between tenants inside a priority level: the Virtual Token Counter of "Fairness in
Serving Large Language Models" (Sheng et al., OSDI 2024).

Each tenant has a counter of the service its requests got, prompt tokens weighted 1 and sampled
tokens 2, divided by the tenant's weight. The head is, at the best (lowest) priority level
waiting, the oldest request of the tenant with the smallest counter. A tenant that starts waiting
again has its counter lifted to the smallest counter of those waiting (to the counter of the last
one to stop waiting when nobody waits), so that it cannot bank service it did not ask for; on a
tie of counters the tenant that started waiting last goes first (the lift made the tie). Beyond
the paper, so that a tenant arriving beside another's burst need not wait for the burst's
requests to finish: a head whose tenant runs fewer than its weighted share of a worker's running
places may preempt the newest request of a tenant that runs more than its share."""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Iterator
from operator import attrgetter

from scheduler_svc.config import QueuePolicy
from scheduler_svc.queues.base import ArrivalIndex, Clock, RequestQueue, evictable
from scheduler_svc.reasons import StallReason
from scheduler_svc.sequence import Sequence

PREFILL_WEIGHT, DECODE_WEIGHT = 1.0, 2.0  # the paper's
TENANT = attrgetter("tenancy.tenant")


class FairRequestQueue(RequestQueue):
    """Per priority level, per tenant, a deque in arrival order (preempted requests in front)."""

    policy = QueuePolicy.FAIR
    order_reason = StallReason.FAIR_SHARE
    charges = True

    def __init__(self, clock: Clock = time.monotonic) -> None:
        super().__init__(clock)
        self._levels: dict[int, dict[str, deque[Sequence]]] = {}  # only non-empty ones
        self.counters: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self._queued: Counter[str] = Counter()  # waiting requests by tenant
        self._members: set[Sequence] = set()
        self._arrivals = ArrivalIndex()
        self._last_left = ""  # the last tenant to stop waiting (its counter grows as it runs)
        self._joins = itertools.count(1)
        self._joined: dict[str, int] = {}  # minus when each tenant last started waiting
        # the head's deque, until a tenant joins or leaves a level or the counters change (the
        # order of tenants is (counter, joined), unique to each: their heads' arrivals never
        # decide it, so admitting from the head's deque leaves it the head's)
        self._best: deque[Sequence] | None = None

    def _join(self, seq: Sequence) -> deque[Sequence]:
        tenant = seq.tenancy.tenant
        self.learn(seq)
        if not self._queued[tenant]:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), self._floor())
            self._joined[tenant] = -next(self._joins)  # lifted to a tie, it goes first
        self._queued[tenant] += 1
        self._members.add(seq)
        self._arrivals.add(seq)
        tenants = self._levels.setdefault(seq.tenancy.priority, {})
        queue = tenants.get(tenant)
        if queue is None:
            queue = tenants[tenant] = deque()
            self._best = None
        return queue

    def _leave(self, seq: Sequence) -> None:
        level, tenant = seq.tenancy.priority, seq.tenancy.tenant
        tenants = self._levels[level]
        if not tenants[tenant]:
            del tenants[tenant]
            self._best = None
            if not tenants:
                del self._levels[level]
        self._members.remove(seq)
        self._queued[tenant] -= 1
        if not self._queued[tenant]:
            del self._queued[tenant]
            self._last_left = tenant

    def _floor(self) -> float:
        """What a tenant that starts waiting is lifted to: the smallest counter of those
        waiting; when nobody waits, the counter *now* of the last tenant to stop waiting, as the
        paper's algorithm reads it: that tenant's requests have run since, and a snapshot taken
        when it stopped waiting let a newcomer bank all that service (a tenant arriving beside
        another's long-running burst then took most of the service until it had caught up)."""
        waiting = [self.counters[t] for t, n in self._queued.items() if n]
        return min(waiting) if waiting else self.counters.get(self._last_left, 0.0)

    def add(self, seq: Sequence) -> None:
        self._join(seq).append(seq)

    def prepend(self, seq: Sequence) -> None:
        self._join(seq).appendleft(seq)

    def _head_deque(self) -> deque[Sequence]:
        if self._best is not None:
            return self._best
        if not self._levels:
            raise IndexError("the queue is empty")
        tenants = self._levels[min(self._levels)]
        counters, joined = self.counters, self._joined
        self._best = min(
            tenants.values(),
            key=lambda q: (counters[t := q[0].tenancy.tenant], joined[t]),  # joined: unique
        )
        return self._best

    def peek(self) -> Sequence:
        return self._head_deque()[0]

    def pop(self) -> Sequence:
        seq = self._head_deque().popleft()
        self._leave(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        if seq not in self._members:
            raise ValueError(f"{seq.request_id} is not waiting")
        self._levels[seq.tenancy.priority][seq.tenancy.tenant].remove(seq)
        self._leave(seq)

    def __iter__(self) -> Iterator[Sequence]:
        """The order the heads would take if each admission charged its prompt: the order now,
        as far as it can be known before the service is."""
        counters = dict(self.counters)
        for level in sorted(self._levels):
            queues = {t: list(q) for t, q in self._levels[level].items()}
            taken = dict.fromkeys(queues, 0)
            for _ in range(sum(len(q) for q in queues.values())):
                tenant = min(
                    (t for t in queues if taken[t] < len(queues[t])),
                    key=lambda t: (counters[t], self._joined[t]),
                )
                seq = queues[tenant][taken[tenant]]
                taken[tenant] += 1
                counters[tenant] += PREFILL_WEIGHT * len(seq.prompt_ids) / self.weights[tenant]
                yield seq

    def __len__(self) -> int:
        return len(self._members)

    def oldest(self) -> Sequence | None:
        return self._arrivals.oldest(self._members)

    def learn(self, seq: Sequence) -> None:
        self.weights[seq.tenancy.tenant] = _weight(seq)

    def charge(self, tenant: str, prefill: int, decode: int) -> None:
        self._best = None
        service = PREFILL_WEIGHT * prefill + DECODE_WEIGHT * decode
        weight = self.weights.get(tenant, 1.0)
        self.counters[tenant] = self.counters.get(tenant, 0.0) + service / weight

    def victim(self, head: Sequence, running: list[Sequence], slots: int) -> Sequence | None:
        """A lower-priority running request first (the newest); else, at the head's level, when
        the head's tenant runs fewer than its weighted share of the `slots` and another tenant
        more than its own, that tenant's newest (of several such, the most served one's), if the
        head outranks it (a tenant served less, weighted, would take the place back at once).
        Asked again when the running requests change (admissions, finishes, preemptions), not
        at every step as the counters move."""
        mine = head.tenancy.priority
        lower = [s for s in running if s.tenancy.priority > mine and evictable(s)]
        if lower:
            return max(lower, key=lambda s: (s.tenancy.priority, s.arrival))
        peers = [s for s in running if s.tenancy.priority == mine]
        count = Counter(map(TENANT, peers))
        me = head.tenancy.tenant
        known = self.weights  # as the tenant's requests last joined (the head's among them)
        weights = {s.tenancy.tenant: known.get(s.tenancy.tenant) or _weight(s) for s in peers}
        weights[me] = known[me]  # it waits: its weight is known
        total = sum(weights.values())
        if (count[me] + 1) * total > slots * weights[me]:
            return None  # its tenant holds its share (or more) already
        over = [t for t in count if t != me and count[t] * total > slots * weights[t]]
        for tenant in sorted(over, key=lambda t: -self.counters.get(t, 0.0)):
            newest = [s for s in peers if s.tenancy.tenant == tenant and evictable(s)]
            # back in the queue, a victim the head does not outrank (its tenant served less)
            # would be the head again and take back the place it left, step after step
            if newest and self._ahead_of_return(head, tenant):
                return max(newest, key=lambda s: s.arrival)
        return None

    def _ahead_of_return(self, head: Sequence, tenant: str) -> bool:
        """Would `head` still come before a request of `tenant` put back in the queue? A tenant
        that waits keeps its rank; one that does not joins again, lifted, and wins a tie."""
        me = head.tenancy.tenant
        mine = (self.counters[me], self._joined[me])  # it waits: both are known
        if self._queued[tenant]:
            return mine < (self.counters[tenant], self._joined[tenant])
        return mine[0] < max(self.counters.get(tenant, 0.0), self._floor())

    def victim_order(self) -> tuple:
        """The tenants as their counters rank them (a victim must be outranked by the head):
        it changes when one tenant's service passes another's, not at every charge."""
        counters, joined = self.counters, self._joined
        return tuple(sorted(counters, key=lambda t: (counters[t], joined.get(t, 0))))

    def outranks(self, head: Sequence, seq: Sequence) -> bool:
        """A better priority, or at the same one a tenant served less (weighted; on a tie, the
        one that started waiting last, as the head is chosen)."""
        mine, theirs = head.tenancy, seq.tenancy
        if mine.priority != theirs.priority:
            return mine.priority < theirs.priority
        if mine.tenant == theirs.tenant:
            return False
        counters, joined = self.counters, self._joined
        rank = (counters[mine.tenant], joined[mine.tenant])  # it waits: both are known
        # a tenant the queue never saw (running since a live switch): counted 0, joined first
        return rank < (counters.get(theirs.tenant, 0.0), joined.get(theirs.tenant, 0))

    def standing(self, seq: Sequence) -> dict[str, str]:
        shown = super().standing(seq)
        tenant = seq.tenancy.tenant
        shown["counter"] = f"{self.counters[tenant]:.0f}"  # it waits: its tenant has both
        shown["weight"] = f"{self.weights[tenant]:g}"
        return shown


def _weight(seq: Sequence) -> float:
    """A request's tenant's weight (a key without one, or a bad one: 1)."""
    return seq.tenancy.weight if seq.tenancy.weight > 0 else 1.0
