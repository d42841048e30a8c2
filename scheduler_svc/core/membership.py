"""Workers in and out of the core (join, fail, return, drain, leave) and settings changed live."""

from __future__ import annotations

from dataclasses import fields

from scheduler_svc.config import BatchMode, CoreConfig, KvPolicy, WorkerSpec
from scheduler_svc.core.state import CoreState
from scheduler_svc.live_settings import stranded
from scheduler_svc.request_queue import create_request_queue
from scheduler_svc.sequence import NO_HANDLE, SeqStatus, Sequence
from scheduler_svc.speculation.proposer import Proposer

RUNNING, FINISHED = SeqStatus.RUNNING, SeqStatus.FINISHED


class Membership(CoreState):
    """Workers joining, failing, returning, draining and leaving; settings changed live."""

    def remove_worker(self, index: int) -> None:
        """A worker has left the stack (drained, or gone for good): requeue what it held."""
        ws = self.workers[index]
        if ws.running or ws.done:
            self.fail_worker(index)
        ws.healthy, ws.gone = False, True

    def fail_worker(self, index: int) -> list[Sequence]:
        """A worker is gone: requeue its requests (prompt + generated) for recompute elsewhere."""
        ws = self.workers[index]
        ws.healthy = False
        if ws.down_since is None:
            ws.down_since = self.clock()
        self._reap(ws)
        moved = list(ws.running)
        for seq in reversed(moved):  # newest first: the oldest ends at the queue's front
            self._preempt(ws, seq)
        ws.reset_pool()
        return moved

    def restore_worker(self, index: int, spec: WorkerSpec | None = None) -> None:
        """A failed worker answers again (a replacement may bring another pool)."""
        ws = self.workers[index]
        ws.reset_pool(spec)
        ws.healthy, ws.draining, ws.gone = True, False, False
        ws.down_since = None

    def drain_worker(self, index: int) -> None:
        """The worker is stopping: its running requests finish there; nothing new joins it."""
        self.workers[index].draining = True

    def reconfigure(self, config: CoreConfig) -> None:
        """New settings, followed from each worker's next plan. reserve -> paged releases the
        reservations' unwritten blocks at once (the worker's next step trims those tables);
        paged -> reserve lets the running requests grow as paged ones until they finish and
        admits a reservation only beside the blocks they may still take, so none is
        oversubscribed. ValueError, and nothing changes, if a request could then never run."""
        problem = stranded(config, self.seqs.values())
        if problem:
            raise ValueError(problem)
        release = self.reserve and config.policy is KvPolicy.PAGED
        for f in fields(CoreConfig):
            if getattr(config, f.name) != getattr(self.config, f.name):
                self.setting_changes[f.name] += 1
        if config.queue_policy is not self.config.queue_policy:
            self._reorder(config)
        self.config, self.chunked = config, config.chunked_prefill
        self.reserve = config.policy is KvPolicy.RESERVE
        self.static = config.mode is BatchMode.STATIC
        self.caching = config.prefix_caching and not self.reserve
        before = self.proposer
        if before is not None and before.suffix is not None:
            self.kept_suffix = before.suffix  # set aside: off or lookup only forget nothing
        self.proposer = Proposer.of(config, before, self.kept_suffix)
        for ws in self.workers:
            ws.caching = self.caching
            ws.kv.set_caching(self.caching)
            for seq in ws.running if release else ():
                if seq.handle == NO_HANDLE or seq.drafting:
                    continue  # finished since its last step: all its blocks go at the next;
                    # drafting: its draft writes past its position, trimmed when it completes
                keep = ws.kv.trim(seq)
                if keep is not None:
                    ws.trims.append((seq.handle, keep))

    def _reorder(self, config: CoreConfig) -> None:
        """A new ordering: the waiting requests move to its queue in arrival order (the service
        counted under `fair` starts anew), and where it ranks the running requests (priority:
        the lowest last, preempted first), each worker's list is sorted so; back from such an
        ordering, they are sorted by arrival (the newest preempted first)."""
        queue = create_request_queue(config.queue_policy, self.clock)
        queue.eta = self._first_token_eta
        for seq in sorted(self.waiting, key=lambda s: s.arrival):
            queue.add(seq)
        for ws in self.workers:
            for seq in ws.running:
                queue.learn(seq)  # fair: a tenant that only runs is charged at its own weight
        ranked, self.waiting = self.waiting.ranks_running, queue
        if queue.ranks_running:
            for ws in self.workers:
                ws.running.sort(key=queue.running_key)
        elif ranked:  # back from priority's order: the newest last, preempted first again
            for ws in self.workers:
                ws.running.sort(key=lambda s: s.arrival)
