"""A worker's failed work: the requests it failed, and the KV they wrote, which the prefix cache
no longer trusts (nor what was computed over it since)."""

from __future__ import annotations

from scheduler_svc.core.state import CoreState
from scheduler_svc.kv import FailedWork
from scheduler_svc.output import Event
from scheduler_svc.sequence import Finish, SeqStatus, Sequence
from scheduler_svc.step import Step
from scheduler_svc.worker_state import WorkerState

RUNNING, FINISHED = SeqStatus.RUNNING, SeqStatus.FINISHED


class Failures(CoreState):
    """Work a worker could not run: its requests fail; the KV it wrote is distrusted."""

    def fail_items(self, step: Step, failed: dict[int, str], where: str) -> list[Event]:
        """The worker could not run these requests (by handle): each fails alone, the rest of
        the step stands. Their work leaves the step, so `complete` gets the others' tokens.
        Returns their finishes."""
        self._distrust(step, set(failed))
        finishes = []
        for seq in self.workers[step.worker].running:
            if seq.handle in failed and not seq.is_finished:
                error = f"worker {where} could not run this request: {failed[seq.handle]}"
                finishes.append(self._finish(seq, Finish.ERROR, error))
        step.chunks = [w for w in step.chunks if w.handle not in failed]
        step.drafts = [d for d in step.drafts if d.handle not in failed]
        kept = [
            p for p in zip(step.decodes, step.decode_handles, strict=True) if p[1] not in failed
        ]
        step.decodes = [seq for seq, _ in kept]
        step.decode_handles = [handle for _, handle in kept]
        return finishes

    def fail_step(self, step: Step, error: str) -> list[Event]:
        """The worker answered that this execution raised: fail its requests (re-queueing them
        would carry a request that breaks the model to every worker). Returns their finishes."""
        failed = []
        drafts = [(d.seq, d.handle) for d in step.drafts]
        handles = {w.handle for w in step.chunks} | set(step.decode_handles)
        self._distrust(step, handles | {handle for _, handle in drafts})
        for seq, handle in (
            [(w.seq, w.handle) for w in step.chunks]
            + drafts
            + list(zip(step.decodes, step.decode_handles, strict=True))
        ):
            if seq.handle == handle and not seq.is_finished:
                failed.append(self._finish(seq, Finish.ERROR, error))
        return failed

    def _distrust(self, step: Step, handles: set[int]) -> None:
        """These items of a step failed: the KV they wrote, and everything computed over it
        since (with overlap, later steps were planned over it), is not to be trusted
        (`KvManager.distrust`). A request that filled a block over a distrusted one goes back
        to the queue (admitted with overlap before the failure was known), or, if it has
        finished since, caches nothing when it leaves."""
        if not self.caching:
            return
        ws = self.workers[step.worker]
        failed = [
            self._failed_work(ws, w.seq, w.handle, w.start, w.blocks)
            for w in step.chunks
            if w.handle in handles
        ]
        decodes = list(zip(step.decodes, step.decode_handles, strict=True))
        decodes += [(d.seq, d.handle) for d in step.drafts]
        failed += [  # a decode (with a draft or not) writes past the prompt
            self._failed_work(ws, seq, h, len(seq.prompt_ids), [])
            for seq, h in decodes
            if h in handles
        ]
        others = [s for s in ws.running if s.handle not in handles]
        for seq in ws.kv.distrust(failed, others):
            if seq.is_finished:
                ws.kv.mark_suspect(seq)
            else:
                self._preempt(ws, seq, cache=False)

    @staticmethod
    def _failed_work(
        ws: WorkerState, seq: Sequence, handle: int, start: int, blocks: list[int]
    ) -> FailedWork:
        """The request's table on `ws` is the one this work wrote into while it runs there
        under the same handle, or has finished there (its table not freed yet)."""
        owns = seq.handle == handle or (seq.is_finished and seq.worker == ws.index)
        return FailedWork(seq, start, blocks, owns)
