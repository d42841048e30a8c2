"""The scheduler: requests in, one planning pass per worker step, what it holds. Each concern is
its own module (membership, admission, planning, runs, failures) over the shared state."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from functools import partial
from operator import attrgetter

from llmcommon.request_checks import context_problem
from llmcommon.sampling import SamplingParams
from scheduler_svc.core.admission import Admission
from scheduler_svc.core.drafts import Drafts
from scheduler_svc.core.failures import Failures
from scheduler_svc.core.membership import Membership
from scheduler_svc.core.planning import Planning
from scheduler_svc.core.runs import Runs
from scheduler_svc.output import Event, Outputs, Refused, Snapshot, TenantCounts
from scheduler_svc.reasons import RefusalReason
from scheduler_svc.request_queue import RequestQueue
from scheduler_svc.sequence import SeqStatus, Sequence
from scheduler_svc.step import Step
from scheduler_svc.time_budget import StepTimer

RUNNING, FINISHED = SeqStatus.RUNNING, SeqStatus.FINISHED
TENANT = attrgetter("tenancy.tenant")
_NO_VICTIM = RequestQueue.victim  # an ordering that never preempts for its head


class Scheduler(Membership, Admission, Planning, Drafts, Runs, Failures):
    """The batching core: `add`/`abort` requests, `schedule(w)` before every execution of
    worker w, `complete(step, tokens)` after it, `snapshot()` for what it holds."""

    def add(self, seq: Sequence) -> None:
        held = self.seqs.get(seq.request_id)
        if held is not None:
            why = "is already in flight"
            if held.is_finished:  # ended (a cancel), its worker not told yet
                why = "has ended; its KV is freed at its worker's next step, and the id with it"
            self._refuse(RefusalReason.DUPLICATE, f"request id {seq.request_id!r} {why}")
        if not seq.prompt_ids or seq.max_tokens < 1:  # (the service's door refuses these)
            raise ValueError(
                f"request {seq.request_id!r}: a prompt of at least one token and max_tokens of "
                f"1 or more, not {len(seq.prompt_ids)} and {seq.max_tokens}"
            )
        self._check_can_ever_run(seq)
        now = self.clock()
        seq.status, seq.arrival = SeqStatus.WAITING, seq.arrival or now
        self.arrivals.add(now)
        self.seqs[seq.request_id] = seq
        self.stop_ids |= seq.stop_ids
        seq.stepwise = _stepwise(seq.sampling)
        self.waiting.add(seq)
        self.waiting_tokens += seq.num_pending

    def _check_can_ever_run(self, seq: Sequence) -> None:
        prompt = len(seq.prompt_ids)
        specs = [ws.spec for ws in self.workers if ws.live]
        specs += [ws.spec for ws in self.returning_workers()]  # it may wait for one of these
        if not specs:
            self._refuse(RefusalReason.NO_WORKER, RefusalReason.NO_WORKER.description)
        computed = prompt + len(seq.output_ids)  # a resubmission's resumed tokens too
        fits = [s for s in specs if computed < s.max_context]
        if not fits:
            context = max(s.max_context for s in specs)
            if not seq.output_ids:
                self._refuse(RefusalReason.CONTEXT, context_problem(prompt, context) or "")
            self._refuse(  # it had been taken, then failed "no worker can hold it; retry"
                RefusalReason.CONTEXT,
                f"prompt of {prompt} tokens and {len(seq.output_ids)} resumed tokens leave no "
                f"room to generate within the model's context of {context} tokens",
            )
        if not any(seq.max_length(s.max_context) <= s.capacity for s in fits):
            need = min(seq.max_length(s.max_context) for s in fits)
            capacity = max(s.capacity for s in fits)
            self._refuse(
                RefusalReason.KV_CAPACITY,
                f"request needs up to {need} KV positions (prompt {prompt} + max_tokens "
                f"{seq.max_tokens}) but a worker holds {capacity}; lower max_tokens or raise "
                f"the KV capacity",
            )
        if not self.chunked and prompt > self._full_budget():
            self._refuse(
                RefusalReason.TOKEN_BUDGET,
                f"prompt of {prompt} tokens exceeds the token budget of "
                f"{self.config.token_budget} and chunked prefill is off; enable it or raise "
                f"the budget",
            )

    def _refuse(self, reason: RefusalReason, message: str) -> None:
        self.refused[reason] += 1
        raise Refused(reason, message)

    def schedule(self, index: int) -> Step:
        """The next execution of one worker (its own step loop calls this)."""
        return self.schedule_workers([index])[0]

    def schedule_all(self) -> list[Step]:
        """One execution on every live worker at once (lock-step: tests and the simulator)."""
        healthy = [ws.index for ws in self.workers if ws.healthy]
        steps = self.schedule_workers(healthy)
        return [s for s in steps if s.has_work or s.released or s.failed]

    def schedule_workers(self, indices: list[int]) -> list[Step]:
        """The next execution of each of these workers, planned together (one FCFS pass over
        the queue). What the planning did comes with the steps: each step's admissions, and
        on the first step the requests failed because no live worker can ever hold them."""
        steps: dict[int, Step] = {}
        budget = sys.maxsize if self.static else self.config.token_budget
        limit = 0.0 if self.static else self.config.step_time_budget_ms / 1e3
        for index in indices:
            ws = self.workers[index]
            ws.kv.sent()  # the steps that write what they cached have been sent
            self._reap(ws)
        if self.waiting and type(self.waiting).victim is not _NO_VICTIM:
            self._displace({i for i in indices if self.workers[i].healthy})
        for index in indices:
            ws = self.workers[index]
            if not ws.running:
                ws.batch_closed = False
            step = steps[index] = Step(index, budget)
            if limit:
                window_limit = ws.time_limit(limit, self.config.step_time_window)
                step.timer = StepTimer(partial(self.predict, index), window_limit)
            if ws.healthy:
                self._prepare_running(ws, step, self._held_for_head(ws))
        failed: list[Event] = []
        self._admit(steps, failed)
        if failed:
            next(iter(steps.values())).failed = failed
        if limit:
            self._note_time_left(steps)
        else:
            self.time_full.clear()
        if self.proposer is not None:  # drafts take what is left, after the time left is noted
            for index, step in steps.items():
                self._speculate(self.workers[index], step)
        if self.config.decode_steps > 1 and not self.waiting:
            for index, step in steps.items():
                self._lengthen(self.workers[index], step)
        if self.waiting.charges:
            self._charge(steps.values())
        for index, step in steps.items():
            ws = self.workers[index]
            if self.static and step.has_work:  # the batch has started: nothing joins it now
                ws.batch_closed = True
            step.released, ws.released = ws.released, []
            if ws.trims:  # those of requests released since are moot (the worker forgot them)
                gone = set(step.released)
                step.trims, ws.trims = [t for t in ws.trims if t[0] not in gone], []
            if step.has_work:  # executions; release-only and empty steps are not
                ws.steps += step.repeat
                self.steps += step.repeat
                if step.timer is not None:
                    ws.planned_s.extend([step.timer.predicted()] * step.repeat)
        return list(steps.values())

    def complete(self, step: Step, tokens: list[int], emitted: list[int] | None = None) -> Outputs:
        """Record what an execution sampled (`Runs.complete`): `tokens` in the step's order,
        sampling chunks, then decodes, then each draft's, `emitted[i]` of them for draft i
        (`Drafts._complete_drafts`)."""
        if step.shadows:
            chunks = sum(1 for w in step.chunks if w.sample)
            self._shadow_rates(step, tokens[chunks : chunks + len(step.decodes)])
        if not step.drafts:
            return Runs.complete(self, step, tokens)
        plain = step.num_sampled - len(step.drafts)
        outputs = Runs.complete(self, step, tokens[:plain])
        assert outputs.tokens is not None
        self._complete_drafts(step, tokens[plain:], list(emitted or ()), outputs)
        return outputs

    def _charge(self, steps: Iterable[Step]) -> None:
        """Tell the queue the service each tenant's requests got in these steps (fair share).
        The decodes are split by tenant at every step: under overlap a request whose last
        token is in flight leaves them and one whose prompt is done joins, with no admission,
        finish or preemption to tell (a split kept by such a key had charged the wrong tenant)."""
        prefill: Counter[str] = Counter()
        decode: Counter[str] = Counter()
        for step in steps:
            for work in step.chunks:
                prefill[work.seq.tenancy.tenant] += work.num_tokens
            for draft in step.drafts:
                decode[draft.seq.tenancy.tenant] += 1 + len(draft.token_ids)
            if step.decodes:
                for tenant, n in Counter(map(TENANT, step.decodes)).items():
                    decode[tenant] += n * step.repeat
        for tenant in prefill.keys() | decode.keys():
            self.waiting.charge(tenant, prefill[tenant], decode[tenant])

    def tenant_counts(self) -> TenantCounts:
        """Waiting and running requests by tenant and by SLO class, and (fair) each tenant's
        service counter: read on demand (a scrape), never in a step."""
        counts = TenantCounts(policy=self.waiting.policy.value)
        for seq in self.seqs.values():
            t = seq.tenancy
            if seq.status is SeqStatus.WAITING:
                counts.queued[t.tenant] += 1
                counts.class_queued[t.slo_class] += 1
            elif seq.status is RUNNING:
                counts.running[t.tenant] += 1
                counts.class_running[t.slo_class] += 1
        counts.service = dict(getattr(self.waiting, "counters", {}))
        return counts

    def snapshot(self) -> Snapshot:
        now = self.clock()
        return Snapshot(
            waiting=len(self.waiting),
            waiting_tokens=self.waiting_tokens,
            running=sum(len(ws.running) for ws in self.workers),
            workers=[ws.report() for ws in self.workers if not ws.gone],
            stalls=dict(self.stalls),
            head_wait_reason=self.head_reason.value if self.head_reason and self.waiting else "",
            steps=self.steps,
            admitted=self.admitted,
            finished=self.finished,
            preemptions=self.preemptions,
            refused=dict(self.refused),
            oldest_wait=0.0 if (oldest := self.waiting.oldest_arrival()) is None else now - oldest,
        )


def _stepwise(sampling: SamplingParams) -> bool:
    """Does the request take its tokens one execution at a time (logprobs, a grammar)?"""
    return sampling.logprobs is not None or sampling.grammar is not None
