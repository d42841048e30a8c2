"""What an execution sampled (`complete`), and decode runs: a step of several executions of its
decodes when nothing waits (--decode-steps)."""

from __future__ import annotations

from scheduler_svc.config import DecodeRuns
from scheduler_svc.core.state import CoreState
from scheduler_svc.output import Event, Outputs, StepTokens
from scheduler_svc.run_rule import worthwhile_runs
from scheduler_svc.sequence import Finish, SeqStatus, Sequence
from scheduler_svc.step import Step
from scheduler_svc.step_cost import step_shape
from scheduler_svc.worker_state import WorkerState

RUNNING, FINISHED = SeqStatus.RUNNING, SeqStatus.FINISHED
RUN_LIMIT_S = 0.1  # the longest a step of several executions is predicted to take (--decode-steps)


class Runs(CoreState):
    """The tokens an execution sampled, and steps of several executions (decode runs)."""

    def complete(self, step: Step, tokens: list[int]) -> Outputs:
        """Record what an execution sampled: `tokens` in the step's order (sampling chunks,
        then decodes). A request preempted, moved or finished since the step was planned has
        another handle (or none): its token is dropped, never emitted. Returns the tokens
        kept and the requests that finished."""
        if step.repeat > 1:
            return self._complete_run(step, tokens)
        sampling = [w for w in step.chunks if w.sample] if step.chunks else None
        decodes = step.decodes
        seqs = [w.seq for w in sampling] + decodes if sampling else decodes
        emitted = StepTokens(seqs, tokens)
        outputs = Outputs(emitted)
        finishes = outputs.finishes
        self.generated += len(tokens)
        if sampling:
            for work, token in zip(sampling, tokens, strict=False):
                if work.seq.handle == work.handle:
                    self._sampled(work.seq, token, finishes)
                else:
                    self._drop(emitted, work.seq)
            tokens = tokens[len(sampling) :]
        # the usual step has no stop token at all: one isdisjoint instead of a lookup per token
        check_stops = not self.stop_ids.isdisjoint(tokens)
        for seq, handle, token in zip(decodes, step.decode_handles, tokens, strict=True):
            if seq.handle != handle:
                self._drop(emitted, seq)
                continue
            out = seq.output_ids
            out.append(token)
            if check_stops and token in seq.stop_ids:
                finishes.append(self._finish(seq, Finish.STOP))
            elif len(out) >= seq.output_limit:
                finishes.append(self._finish(seq, Finish.LENGTH))
        return outputs

    def _complete_run(self, step: Step, tokens: list[int]) -> Outputs:
        """A step of several executions of its decodes: `tokens` holds `repeat` groups of
        them, execution by execution. A request keeps its tokens up to the one that finishes
        it (a stop token, its length); the worker computed the rest, which are dropped."""
        decodes, n = step.decodes, len(step.decodes)
        if len(tokens) != n * step.repeat:
            raise ValueError(f"{len(tokens)} tokens for {step.repeat} executions of {n} decodes")
        if n == 0:  # the worker failed every decode of the run (fail_items took them out)
            return Outputs(StepTokens([], []))
        live = [seq.handle == h for seq, h in zip(decodes, step.decode_handles, strict=True)]
        kept_seqs: list[Sequence] = []
        kept: list[int] = []
        finishes: list[Event] = []
        for first in range(0, len(tokens), n):
            for i, token in enumerate(tokens[first : first + n]):
                if not live[i]:
                    continue
                seq = decodes[i]
                seq.output_ids.append(token)
                kept_seqs.append(seq)
                kept.append(token)
                if token in seq.stop_ids:
                    finishes.append(self._finish(seq, Finish.STOP))
                    live[i] = False
                elif len(seq.output_ids) >= seq.output_limit:
                    finishes.append(self._finish(seq, Finish.LENGTH))
                    live[i] = False
        self.generated += len(kept)
        return Outputs(StepTokens(kept_seqs, kept), finishes=finishes)

    def _drop(self, emitted: StepTokens, seq: Sequence) -> None:
        self.generated -= 1
        if emitted.dropped is None:
            emitted.dropped = set()
        emitted.dropped.add(seq)

    def _sampled(self, seq: Sequence, token: int, finishes: list[Event]) -> None:
        """A chunk's sampled token (its prompt is computed): stop tokens are checked always."""
        seq.output_ids.append(token)
        if token in seq.stop_ids:
            finishes.append(self._finish(seq, Finish.STOP))
        elif len(seq.output_ids) >= seq.output_limit:
            finishes.append(self._finish(seq, Finish.LENGTH))

    def loop_overhead_s(self) -> float:
        """The live workers' mean loop time outside the forward, per step (0: none seen)."""
        seen = [w.overhead.seconds for w in self.workers if w.live and w.overhead.observed]
        return sum(seen) / len(seen) if seen else 0.0

    def _arrivals_here(self) -> float:
        """A worker's share of the recent arrival rate: new requests go to any live worker."""
        live = sum(1 for w in self.workers if w.live) or 1
        return self.arrivals.per_second(self.clock()) / live

    def _lengthen(self, ws: WorkerState, step: Step) -> None:
        """Nothing waits and the step only decodes: run its decodes up to --decode-steps times,
        each execution feeding the next the token it sampled; under --decode-runs auto only as
        many as pay for the arrivals they hold back (run_rule.py). As many as every request may
        still sample (its length, its context) and hold KV for without preempting anyone; a
        request whose tokens are taken one at a time (logprobs, a grammar) keeps the step
        at one execution. A run is predicted to last at most RUN_LIMIT_S: where one execution
        takes longer (a large batch on a CPU) a run would hold a new arrival back for long and
        save little (the control plane's cost per token is small there). Its length is the
        longest the free blocks hold for every request (`_kv_holds`) before any is taken; a
        request that finishes inside the run (a stop token) keeps its blocks until it is freed."""
        decodes = step.decodes
        if step.chunks or step.drafts or step.draft_next or not decodes:
            return
        runs = self.config.decode_steps
        for seq in decodes:
            if seq.stepwise:
                return
            runs = min(runs, seq.max_planned - seq.num_planned + 1)
        if runs < 2:
            return
        one = self.predict(ws.index, step_shape(step))  # an execution, as the worker's model says
        if one > 0:
            runs = min(runs, max(1, int(RUN_LIMIT_S / one)))
            if runs < 2:
                return
        if self.config.decode_runs is DecodeRuns.AUTO:
            runs = worthwhile_runs(
                len(decodes), one, ws.overhead.seconds, self._arrivals_here(), runs
            )
            if runs < 2:
                return
        runs = _kv_holds(ws, decodes, runs)
        if runs < 2:
            return
        granted = {handle: i for i, (handle, _) in enumerate(step.grants)}
        for seq in decodes:
            need = seq.num_computed + runs - 1
            new = ws.kv.allocate(seq, need) if need > ws.kv.held(seq) else None
            if not new:  # (never None where _kv_holds counted the blocks free)
                continue
            if seq.handle in granted:  # its table grew in this step already: one grant
                i = granted[seq.handle]
                step.grants[i] = (seq.handle, step.grants[i][1] + new)
            else:
                step.grants.append((seq.handle, new))
        for seq in decodes:
            seq.num_computed += runs - 1
            seq.num_planned += runs - 1
        step.repeat = runs
        self.longest_run = max(self.longest_run, runs)
        self.run_steps += 1


def _kv_holds(ws: WorkerState, decodes: list[Sequence], runs: int) -> int:
    """The longest run, up to `runs`, whose new blocks the free KV holds for every request at
    once: a run cut short after some were given blocks would leave those held unwritten, and
    a new arrival would read them as reserved space (a kv_reserved stall under paged)."""
    pool = ws.kv.pool
    free = pool.num_free
    while runs >= 2:
        need = sum(pool.missing(seq.request_id, seq.num_computed + runs - 1) for seq in decodes)
        if need <= free:
            return runs
        runs -= 1
    return runs
