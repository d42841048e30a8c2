"""A simulated cluster: the real scheduler core, workers whose execution time comes from the cost
model, and a virtual clock. No model, no gRPC: it replays an hour of trace in minutes.

Each worker runs its own step loop, as in the scheduler service: when it is idle it asks the core
for its next step (`schedule(index)`), executes it for as long as the cost model says (divided by
the speedup and by the worker's own speed: workers may differ), then hands the sampled tokens back
(`complete`). Workers overlap in time; the clock jumps to the next step's end or arrival. A
request's output ends at its length: with max_tokens = length (exact), by the length limit; with a
larger max_tokens, the simulated worker samples end-of-sequence there, as a model would. A request
that follows another (a conversation's next turn) arrives its think time after that one finished,
its prompt built from that one's prompt and generated ids.
"""

from __future__ import annotations

import heapq
import statistics
import time
from array import array
from collections import deque
from dataclasses import asdict, dataclass

from tqdm import tqdm

from llmserve.bench.cost_model import BatchShape, CostModel
from llmserve.bench.policy import Policy
from llmserve.bench.poller import prefix_counters, sample_of
from llmserve.bench.prompts import WORD_ID
from llmserve.bench.records import RequestRecord, RunResult, StatusSample
from llmserve.bench.workload import Content, RequestSpec, Workload
from scheduler_svc.config import CoreConfig, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.output import Event, Refused
from scheduler_svc.sequence import Sequence
from scheduler_svc.step import Step
from scheduler_svc.step_cost import step_shape
from scheduler_svc.step_model import StepModels

EOS_ID = 2


@dataclass(frozen=True, slots=True)
class SimSettings:
    """GPU-like capacities by default; execution times from the cost model / speedup."""

    workers: int = 4
    kv_capacity: int = 500_000  # positions per worker
    block_size: int = 16
    token_budget: int = 8192  # per worker per step
    step_time_budget_ms: float = 0.0  # the core's time budget per worker step (0: off)
    step_time_window: int = 1  # the steps that budget holds over on average
    max_running: int = 256  # per worker
    max_context: int = 32768
    chunked_prefill: bool = True
    speedup: float = 1.0  # the cost model's times are divided by this
    step_overhead_s: float = 0.0  # added to every step (scheduling + RPC), virtual seconds
    status_every_s: float = 1.0  # virtual seconds between Status samples
    worker_speeds: tuple[float, ...] = ()  # per worker, x the speedup (2: twice as fast); () all 1
    speculative: str = "off"  # the core's proposer (docs/speculative.md); drafts verified greedily
    speculative_length: str = "auto"

    def __post_init__(self) -> None:
        if self.worker_speeds and len(self.worker_speeds) != self.workers:
            raise ValueError(f"{len(self.worker_speeds)} worker speeds for {self.workers} workers")
        if any(not v > 0 for v in self.worker_speeds):
            raise ValueError(f"worker speeds must be > 0, got {self.worker_speeds}")

    def speed(self, index: int) -> float:
        return self.speedup * (self.worker_speeds[index] if self.worker_speeds else 1.0)

    def core(self, policy: Policy) -> CoreConfig:
        extra = {} if policy.prefix_caching is None else {"prefix_caching": policy.prefix_caching}
        if self.step_time_budget_ms:  # (a baseline revision's core may not know it)
            extra["step_time_budget_ms"] = self.step_time_budget_ms
        if self.step_time_window != 1:
            extra["step_time_window"] = self.step_time_window
        if policy.queue:
            extra["queue_policy"] = policy.queue
        if self.speculative != "off":
            extra["speculative"] = self.speculative
            extra["speculative_length"] = self.speculative_length
        return CoreConfig(
            token_budget=self.token_budget,
            max_running=self.max_running,
            policy=policy.kv,
            mode=policy.mode,
            chunked_prefill=self.chunked_prefill,
            **extra,
        )

    def specs(self) -> list[WorkerSpec]:
        return [
            WorkerSpec(
                f"sim{i}", self.kv_capacity // self.block_size, self.block_size, self.max_context
            )
            for i in range(self.workers)
        ]


@dataclass(frozen=True, slots=True)
class Inflight:
    """A step a simulated worker is executing."""

    end: float  # virtual seconds
    step: Step
    planned_s: float  # real seconds the core took to plan it
    shape: BatchShape
    forward_s: float  # what the worker reports as its forward time (virtual seconds)


class Simulation:
    def __init__(self, settings: SimSettings, policy: Policy, cost: CostModel) -> None:
        self.settings = settings
        self.policy = policy
        self.cost = cost.scaled(settings.speedup) if settings.speedup != 1 else cost
        self.costs = [cost.scaled(settings.speed(i)) for i in range(settings.workers)]
        self.now = 0.0
        self.inflight: dict[int, Inflight] = {}  # the steps executing, by worker
        # the scheduler's own online step-time models, fed the simulated workers' step times
        self.models = StepModels()
        # the online step-time models: a step-time budget's, and the deadline ordering's
        # prediction of a prompt's time
        timed = {"predict": self.models.predict}
        self.core = Scheduler(
            settings.core(policy), settings.specs(), clock=lambda: self.now, **timed
        )
        self.records: dict[str, RequestRecord] = {}
        self.last_token: dict[str, float] = {}
        self.target: dict[str, int] = {}
        self.samples: list[StatusSample] = []
        self.steps = 0
        self.busy_s = 0.0
        self.core_s = 0.0  # real seconds spent in schedule() + postprocess()
        self.core_steps: list[tuple[float, int]] = []  # each step's core seconds, its running
        self.arrivals: list[tuple[float, int, RequestSpec]] = []  # (due, index, spec), a heap
        self.content: Content | None = None
        self.followers: dict[int, RequestSpec] = {}
        self.kept: dict[str, list[int]] = {}  # prompt + output ids of requests others follow
        self.prompt_tokens = 0
        self.prefill_computed = 0  # tokens of multi-token chunks run (prompts, recomputes)

    def run(self, workload: Workload, progress: bool = True) -> RunResult:
        started = time.perf_counter()
        self.content = workload.content
        self.followers = workload.followers()
        roots = workload.roots
        if workload.closed:
            for spec in roots[: workload.concurrency]:
                self._due(self.now, spec)
            later: deque[RequestSpec] = deque(roots[workload.concurrency :])
        else:
            for spec in roots:
                self._due(spec.arrival_s or 0.0, spec)
            later = deque()
        bar = tqdm(
            total=len(workload.requests),
            desc=f"sim {self.policy.label}",
            unit="req",
            disable=not progress,
            leave=False,
            mininterval=0.5,
        )
        next_sample = 0.0
        while True:
            while self.arrivals and self.arrivals[0][0] <= self.now:
                due, _, spec = heapq.heappop(self.arrivals)
                self._arrive(spec, due)
            self._send_next(self._complete_due(), workload.closed, later, bar)
            if self.now >= next_sample:
                self._sample()
                next_sample = self.now + self.settings.status_every_s
            self._send_next(self._start_idle(), workload.closed, later, bar)
            upcoming = [run.end for run in self.inflight.values()]
            if self.arrivals:
                upcoming.append(self.arrivals[0][0])
            if not upcoming:
                break
            self.now = max(self.now, min(upcoming))
        if self.core.waiting:
            raise RuntimeError(
                f"nothing can run: head of queue waits for "
                f"{self.core.head_reason}; raise the KV capacity or budget"
            )
        self._sample()
        bar.close()
        return self._result(workload, time.perf_counter() - started)

    def _send_next(
        self, finished: list[str], closed: bool, later: deque[RequestSpec], bar: tqdm
    ) -> None:
        """What `finished` lets go: each one's next turn, else (closed loop) the next request."""
        bar.update(len(finished))
        if finished:
            bar.set_postfix(virtual_s=f"{self.now:.0f}", refresh=False)
        for rid in finished:
            follower = self.followers.get(int(rid))
            if follower is not None:
                self._due(self.now + follower.think_s, follower)
            elif closed and later:
                self._due(self.now, later.popleft())

    def _due(self, at: float, spec: RequestSpec) -> None:
        heapq.heappush(self.arrivals, (at, spec.index, spec))

    # ---- one step ------------------------------------------------------------------------

    def _start_idle(self) -> list[str]:
        """Every idle worker plans its next step; a worker the queue's head was placed on while
        it was not planning is woken and plans again (the service's wakes). The requests that
        finished meanwhile (refused at admission)."""
        workers = self.core.workers
        idle = [ws.index for ws in workers if ws.healthy and ws.index not in self.inflight]
        finished: list[str] = []
        for _ in range(len(workers) + 1):
            for index in idle:
                finished += self._start(index)
            woken = self.core.take_wakes()
            idle = [i for i in idle if i in woken and i not in self.inflight]
            if not idle:
                break
        return finished

    def _start(self, index: int) -> list[str]:
        """`index` plans its next step and, if it has work, starts executing it; the requests
        the planning finished (failed: no live worker can ever hold them)."""
        t = time.perf_counter()
        step = self._schedule(index)
        planned = time.perf_counter() - t
        self.core_s += planned
        finished = self._news([*getattr(step, "failed", ()), *getattr(step, "admissions", ())])
        if not step.has_work:
            return finished
        self.prefill_computed += sum(w.num_tokens for w in step.chunks)
        shape = step_shape(step)
        forward = self.costs[index].seconds(shape)
        seconds = forward + self.settings.step_overhead_s
        self.inflight[index] = Inflight(self.now + seconds, step, planned, shape, forward)
        self.busy_s += seconds
        self.steps += 1
        return finished

    def _complete_due(self) -> list[str]:
        """The steps that end by now hand their tokens back; the requests that finished."""
        done = sorted(i for i, run in self.inflight.items() if run.end <= self.now)
        finished: list[str] = []
        for index in done:
            run = self.inflight.pop(index)
            step = run.step
            drafts = getattr(step, "drafts", ())  # (a baseline revision's step has none)
            plain = step.sampled_seqs()[: step.num_sampled - len(drafts)]
            tokens = [self._token(s) for s in plain]
            emitted = []
            for draft in drafts:
                kept = self._verify(draft.seq, draft.token_ids)
                tokens += kept
                emitted.append(len(kept))
            t = time.perf_counter()
            if drafts:
                outputs = self.core.complete(step, tokens, emitted)
            else:
                outputs = self.core.complete(step, tokens)
            completed = time.perf_counter() - t
            self.models.observe(index, run.shape, run.forward_s)
            self.core_s += completed
            self.core_steps.append((run.planned_s + completed, run.step.num_requests))
            finished += self._news(outputs.events() if outputs is not None else [])
        return finished

    def core_figures(self) -> dict[str, float | None]:
        """The core's real time per worker step (planning and completing it), in µs: the
        mean, the median, and the median of the steps that ran at least 90% of the running
        limit (None if none did)."""
        times = [t for t, _ in self.core_steps]
        full = 0.9 * self.settings.max_running
        busy = [t for t, running in self.core_steps if running >= full]
        return {
            "core_us_per_step": 1e6 * self.core_s / max(1, self.steps),
            "core_us_median": 1e6 * statistics.median(times) if times else None,
            "core_us_median_full": 1e6 * statistics.median(busy) if busy else None,
            "full_steps": len(busy),
        }

    def _model_figures(self) -> list[dict[str, object]]:
        """Per worker: the online model's recent prediction error and its coefficients against
        the simulated worker's own (the cost model at its speed)."""
        out = []
        for index, model in sorted(self.models.models.items()):
            error = model.error()
            out.append(
                {
                    "worker": index,
                    "steps": model.observed,
                    "error_p50": error and error.p50,
                    "error_p90": error and error.p90,
                    "learned": model.model().coefficients(),
                    "true": self.costs[index].coefficients(),
                }
            )
        return out

    def _token(self, seq: Sequence, ahead: int = 0) -> int:
        """The simulated model's next token (`ahead` tokens past its known output)."""
        ends = len(seq.output_ids) + ahead + 1 >= self.target[seq.request_id]
        return EOS_ID if ends and not seq.ignore_eos else WORD_ID

    def _verify(self, seq: Sequence, draft: list[int]) -> list[int]:
        """A draft's tokens as greedy verification keeps them: the draft's while they are the
        model's own, then the model's next."""
        kept: list[int] = []
        for token in draft:
            if token != self._token(seq, len(kept)):
                break
            kept.append(token)
        return kept + [self._token(seq, len(kept))]

    def _arrive(self, spec: RequestSpec, due: float, prompt: list[int] | None = None) -> None:
        """`spec` arrives; `prompt`: its ids, when the caller built them (a router's cells)."""
        rid = str(spec.index)
        arrival = due if spec.arrival_s is None else spec.arrival_s
        record = RequestRecord(
            spec.index,
            spec.prompt_tokens,
            spec.output_tokens,
            arrival,
            arrival,
            token_gaps=array("d"),
            turn=spec.turn,
        )  # type: ignore[arg-type]
        self.records[rid] = record
        self.target[rid] = spec.output_tokens
        prompt = self._prompt(spec) if prompt is None else prompt
        record.prompt_tokens = len(prompt)
        self.prompt_tokens += len(prompt)
        if spec.index in self.followers:
            self.kept[rid] = list(prompt)
        seq = Sequence(
            rid,
            prompt,
            spec.limit,
            eos_ids=frozenset({EOS_ID}),
            ignore_eos=spec.limit == spec.output_tokens,
            arrival=arrival,
            **({} if spec.tenancy is None else {"tenancy": spec.tenancy}),
        )
        try:
            self.core.add(seq)
        except Refused as refused:
            record.error, record.end_s = f"refused: {refused}", arrival
            self._drop_followers(spec, arrival)

    def _drop_followers(self, spec: RequestSpec, at: float) -> None:
        """A refused turn ends its conversation: the turns after it are never sent."""
        follower = self.followers.get(spec.index)
        while follower is not None:
            turn, index = follower.turn, follower.index
            record = RequestRecord(index, 0, follower.output_tokens, at, turn=turn)
            record.error = f"not sent: request {spec.index} before it was refused"
            self.records[str(follower.index)] = record
            follower = self.followers.get(follower.index)

    def _prompt(self, spec: RequestSpec) -> list[int]:
        if self.content is None:
            return [WORD_ID] * spec.prompt_tokens
        history = self.kept.pop(str(spec.follows), []) if spec.follows >= 0 else []
        return self.content.prompt_ids(spec, history)

    def _schedule(self, index: int):
        """The core's next step for `index`: `schedule(index)`, or `plan(index)` in an older
        revision's core (the --baseline-rev simulations), whose `schedule()` was lock-step."""
        older = getattr(self.core, "plan", None)
        return older(index) if older is not None else self.core.schedule(index)

    def _news(self, returned: list[Event]) -> list[str]:
        """What a call into the core returned, or what an older revision's core posted to its
        outbox instead (the --baseline-rev simulations); the requests that finished."""
        take = getattr(self.core, "take_events", None)
        return self._record(take() if take is not None else returned)

    def _record(self, events: list[Event]) -> list[str]:
        """The requests' records take what the core did; the requests that finished."""
        finished = []
        for ev in events:
            record = self.records[ev.request_id]
            if ev.admitted:
                record.queue_time_s = ev.queue_time
            if ev.token_id is not None:
                if record.first_token_s is None:
                    record.first_token_s = self.now
                else:
                    record.token_gaps.append(self.now - self.last_token[ev.request_id])
                self.last_token[ev.request_id] = self.now
                record.completion_tokens += 1
                if ev.request_id in self.kept:
                    self.kept[ev.request_id].append(ev.token_id)
            if ev.finish is not None:
                record.end_s, record.finish = self.now, ev.finish.value
                record.preemptions, record.error = ev.preemptions, ev.error
                self.last_token.pop(ev.request_id, None)
                finished.append(ev.request_id)
        return finished

    def _sample(self) -> None:
        self.samples.append(sample_of(self.core.snapshot(), self.now))

    def _result(self, workload: Workload, wall: float) -> RunResult:
        records = sorted(self.records.values(), key=lambda r: r.index)
        config = {
            "policy": self.policy.label,
            **asdict(self.settings),
            "cost_model": {k: v for k, v in asdict(self.cost).items() if k != "meta"},
        }
        counters = {
            "stalls": dict(self.core.stalls),
            "refused": dict(self.core.refused),
            "steps": self.steps,
            "virtual_s": self.now,
            "busy_s": self.busy_s,
            "real_s": wall,
            "core_s": self.core_s,
            **self.core_figures(),
            "preemptions": self.core.preemptions,
            "step_model": self._model_figures(),
            **prefix_counters(self.core.snapshot().workers),
            # what the simulated workers ran, whatever the core reports
            "prompt_tokens": self.prompt_tokens,
            "prefill_computed": self.prefill_computed,
        }
        return RunResult(
            self.policy.label,
            records,
            self.samples,
            self.now,
            config=config,
            counters=counters,
            kind="simulated",
            sample_period_s=self.settings.status_every_s,
        )
