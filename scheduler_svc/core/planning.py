"""The running requests' next work in a step: a decode each, or a prompt (recompute) chunk,
within the token and step-time budgets; KV grown for it, preempting the newest when paged KV
runs out."""

from __future__ import annotations

from scheduler_svc.core.state import CoreState
from scheduler_svc.sequence import SeqStatus, Sequence
from scheduler_svc.step import Step
from scheduler_svc.step_cost import step_shape
from scheduler_svc.worker_state import WorkerState

RUNNING, FINISHED = SeqStatus.RUNNING, SeqStatus.FINISHED


class Planning(CoreState):
    """The running requests' next work, in admission order, within the step's budgets."""

    def _prepare_running(
        self, ws: WorkerState, step: Step, hold: tuple[Sequence, int] | None = None
    ) -> None:
        """Every running request's next work, in admission order, within the token budget
        (`hold`, or None: the head the ordering ranks above a prefilling one, and its first
        chunk's tokens, which that one's chunk leaves it). The usual step (only decodes, the budget
        enough for all) takes a loop of its own."""
        if ws.prefilling or step.budget < len(ws.running):
            return self._prepare_within_budget(ws, step, hold)
        decodes, handles = step.decodes, step.decode_handles
        add_decode, add_handle = decodes.append, handles.append
        held = ws.kv.held
        for seq in ws.running:  # a preemption removes from the end: safe to iterate
            computed, planned = seq.num_computed, seq.num_planned
            if planned >= seq.max_planned or seq.drafting:
                continue  # finished, its last token in flight, or its draft: not known yet
            if computed >= held(seq) and not self._make_room(ws, seq, computed + 1, step):
                continue  # it preempted itself
            seq.num_computed, seq.num_planned = computed + 1, planned + 1
            add_decode(seq)
            add_handle(seq.handle)
        step.budget -= len(decodes)
        if step.timer is not None:  # decodes always run, whatever their predicted time
            step.timer.add_decodes(sum(s.num_computed for s in decodes), len(decodes))

    def _prepare_within_budget(
        self, ws: WorkerState, step: Step, hold: tuple[Sequence, int] | None = None
    ) -> None:
        """A request decodes when the worker holds its next token (its last work sampled);
        otherwise its next tokens are prompt (or recompute) tokens, sent as a chunk. Under a
        step-time budget the decodes are counted first (they always run) and a chunk is cut to
        the time left, the first one of the step to at least one token. A chunk of a request
        the head outranks leaves the head its `hold` tokens."""
        timer, ahead, held = step.timer, 0, ws.kv.held
        if timer is not None:
            decoding = [
                s
                for s in ws.running
                if s not in ws.prefilling and s.num_planned < s.max_planned and not s.drafting
            ]
            timer.add_decodes(sum(s.num_computed + 1 for s in decoding), len(decoding))
            ahead = len(decoding)
        for seq in ws.running:
            computed, planned = seq.num_computed, seq.num_planned
            if planned >= seq.max_planned or step.budget == 0 or seq.drafting:
                continue  # finished, its last token or its draft in flight, or no budget left
            if seq not in ws.prefilling:
                if computed >= held(seq) and not self._make_room(ws, seq, computed + 1, step):
                    continue
                seq.num_computed, seq.num_planned = computed + 1, planned + 1
                step.decodes.append(seq)
                step.decode_handles.append(seq.handle)
                step.budget -= 1
                continue
            budget = step.budget
            if hold is not None and self.waiting.outranks(hold[0], seq):
                budget = max(0, budget - hold[1])
            n = self._chunk(seq, budget)
            if n and timer is not None:
                n = timer.cut(computed, n, computed + n == planned, least=int(not step.chunks))
            if n and (computed + n <= held(seq) or self._make_room(ws, seq, computed + n, step)):
                step.budget -= n
                self._plan_chunk(ws, step, seq, n)
        if timer is not None and len(step.decodes) != ahead:  # a decode was cut (preempted, or
            timer.shape = step_shape(step)  # no budget left): what the step holds, anew

    def _make_room(self, ws: WorkerState, seq: Sequence, positions: int, step: Step) -> bool:
        """Blocks for `seq` to hold `positions`, preempting the newest running requests until
        they fit; False if `seq` itself was preempted."""
        while (new := ws.kv.allocate(seq, positions)) is None:
            victim = ws.running[-1]
            self._preempt(ws, victim)
            if victim is seq:
                return False
        step.grants.append((seq.handle, new))
        return True
