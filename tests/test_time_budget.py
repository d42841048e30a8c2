"""The step-time budget in the core (--step-time-budget-ms), with the seed's numbers and a fake
predictor: decodes always run, prompt chunks and admissions only within the predicted time, a
chunk cut to what fits, one token of progress at least, the token budget still the cap."""

from __future__ import annotations

import pytest

from scheduler_svc.config import BatchMode, CoreConfig, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.reasons import StallReason
from scheduler_svc.step_cost import BatchShape, CostModel, step_shape
from scheduler_svc.time_budget import SLACK, StepTimer
from tests.sim import check_invariants, ran, seq, step


class FakeTimes:
    """Each worker's step time: fixed + per token, in ms; changeable between steps."""

    def __init__(self, fixed_ms: float = 0.0, token_ms: float = 1.0) -> None:
        self.default = CostModel(fixed_ms / 1e3, token_ms / 1e3)
        self.models: dict[int, CostModel] = {}

    def set(self, worker: int, fixed_ms: float, token_ms: float) -> None:
        self.models[worker] = CostModel(fixed_ms / 1e3, token_ms / 1e3)

    def __call__(self, worker: int, shape: BatchShape) -> float:
        return self.models.get(worker, self.default).predict(shape)


def make(times: FakeTimes, budget_ms: float, workers: int = 1, **cfg) -> Scheduler:
    config = CoreConfig(step_time_budget_ms=budget_ms, **cfg)
    specs = [WorkerSpec(f"w{i}", 200, 1, 4096) for i in range(workers)]
    return Scheduler(config, specs, predict=times)


def checked_step(core: Scheduler) -> dict[str, int]:
    done = ran(step(core))
    check_invariants(core)
    return done


def test_a_decode_batch_predicted_over_the_budget_still_runs() -> None:
    times = FakeTimes(token_ms=0.0)  # while they prefill, steps cost nothing
    core = make(times, budget_ms=2.0)
    for rid in "ABCD":
        core.add(seq(rid, 3, max_tokens=6))
    checked_step(core)
    times.set(0, 0.0, 1.0)  # now 1 ms a token: four decodes take 4 ms, twice the budget
    core.add(seq("E", 3, max_tokens=6))
    assert checked_step(core) == {"A": 1, "B": 1, "C": 1, "D": 1}
    assert core.head_reason is StallReason.TIME_BUDGET
    assert core.stalls[StallReason.TIME_BUDGET] == 1 and core.workers[0].stalls["time_budget"] == 1


def test_a_long_prompt_is_chunked_to_fit_the_budget() -> None:
    core = make(FakeTimes(fixed_ms=2.0, token_ms=1.0), budget_ms=20.0)
    core.add(seq("A", 100, max_tokens=2))
    chunks = []
    while "A" in core.seqs and not core.seqs["A"].output_ids:
        chunks.append(checked_step(core)["A"])
    assert chunks == [18, 18, 18, 18, 18, 10]  # 2 ms + 18 x 1 ms = the 20 ms budget


def test_a_chunk_is_cut_to_the_time_the_decodes_leave() -> None:
    """The seed's Figure 2: B decodes, C's 6-token prompt fits the budget of 8 tokens; a time
    budget of 5 ms at 1 ms a token leaves C 4 tokens beside B's decode, then the rest."""
    times = FakeTimes(token_ms=0.0)
    core = make(times, budget_ms=5.0, token_budget=8)
    core.add(seq("B", 3, max_tokens=5))
    checked_step(core)
    times.set(0, 0.0, 1.0)
    core.add(seq("C", 6, max_tokens=5))
    planned = core.schedule_all()
    assert planned[0].ran() == {"B": 1, "C": 4}
    assert times(0, step_shape(planned[0])) <= 0.005
    for s in planned:
        core.complete(s, [7] * s.num_sampled)
    assert checked_step(core) == {"B": 1, "C": 2}


def test_admission_stops_at_the_budget_with_time_budget_counted() -> None:
    """Figure 2's B and C with D behind them: B + C make 7 tokens, the token budget of 8 would
    take one of D's, but at 1 ms a token a 7 ms budget is full: D waits for time."""
    times = FakeTimes(token_ms=0.0)
    core = make(times, budget_ms=7.0, token_budget=8)
    core.add(seq("B", 3, max_tokens=5))
    checked_step(core)
    times.set(0, 0.0, 1.0)
    core.add(seq("C", 6, max_tokens=5))
    core.add(seq("D", 4, max_tokens=5))
    assert checked_step(core) == {"B": 1, "C": 6}
    snap = core.snapshot()
    assert snap.head_wait_reason == "time_budget" and snap.stalls == {"time_budget": 1}


def test_without_chunking_a_prompt_that_does_not_fit_in_time_waits_whole() -> None:
    times = FakeTimes(token_ms=0.0)
    core = make(times, budget_ms=4.0, chunked_prefill=False)
    core.add(seq("B", 3, max_tokens=5))
    checked_step(core)
    times.set(0, 0.0, 1.0)
    core.add(seq("C", 6, max_tokens=5))
    assert checked_step(core) == {"B": 1}
    assert core.head_reason is StallReason.TIME_BUDGET


def test_nothing_starves_under_a_budget_below_one_token() -> None:
    """0.5 ms at 1 ms a token: every step still makes one token of progress."""
    core = make(FakeTimes(token_ms=1.0), budget_ms=0.5)
    core.add(seq("A", 4, max_tokens=3))
    core.add(seq("B", 2, max_tokens=2))
    history = [checked_step(core) for _ in range(12)]
    assert history[:4] == [{"A": 1}] * 4  # A's prompt one token a step (B waits for time)
    assert history[4:6] == [{"A": 1}] * 2  # its decodes (B still waits for time)
    assert history[6:9] == [{"B": 1}] * 3  # then B's prompt and its decode
    assert not core.seqs and core.finished == 2


def test_the_token_budget_stays_the_cap() -> None:
    core = make(FakeTimes(token_ms=1.0), budget_ms=1e6, token_budget=8)
    core.add(seq("A", 20, max_tokens=2))
    assert [checked_step(core)["A"] for _ in range(3)] == [8, 8, 4]


def test_off_the_core_never_asks_for_a_prediction() -> None:
    def refuse(worker: int, shape: BatchShape) -> float:
        raise AssertionError("predicted with the budget off")

    core = Scheduler(CoreConfig(token_budget=8), [WorkerSpec("w0", 100, 1, 4096)], predict=refuse)
    core.add(seq("A", 20, max_tokens=2))
    core.add(seq("B", 3, max_tokens=2))
    assert checked_step(core) == {"A": 8}


def test_the_head_goes_to_a_worker_with_time_left() -> None:
    """Worker 0 is ten times slower: once its step is full in time, the head goes to worker 1
    even though worker 0 has the more free KV."""
    times = FakeTimes(token_ms=1.0)
    times.set(0, 0.0, 10.0)
    core = make(times, budget_ms=20.0, workers=2)
    core.add(seq("A", 2, max_tokens=8))  # worker 0: 2 tokens, 20 ms: its step is full
    core.add(seq("B", 30, max_tokens=8))  # worker 1 (more free now), 20 of 30 tokens
    core.add(seq("C", 2, max_tokens=8))  # worker 0 has more free KV, but no time: waits
    first = core.schedule_all()
    assert [s.ran() for s in first] == [{"A": 2}, {"B": 20}]
    assert core.head_reason is StallReason.TIME_BUDGET
    for s in first:
        core.complete(s, [7] * s.num_sampled)
    check_invariants(core)
    second = core.schedule_all()  # worker 0's decode takes 10 ms: 1 token of C would fit,
    assert second[0].ran() == {"A": 1, "C": 1}  # and worker 1 has only B's 10 left
    assert second[1].ran() == {"B": 10}


def test_a_worker_full_in_time_and_not_planning_does_not_hold_the_head() -> None:
    """Each worker plans alone (its own step loop): worker 0's last step left no time, so the
    head is placed on worker 1 when that one plans, though worker 0 has more free KV."""
    times = FakeTimes(token_ms=1.0)
    times.set(0, 0.0, 10.0)
    core = make(times, budget_ms=20.0, workers=2)
    core.add(seq("A", 2, max_tokens=8))
    assert core.schedule(0).ran() == {"A": 2}  # 20 ms: full
    core.add(seq("C", 2, max_tokens=8))
    assert core.schedule(1).ran() == {"C": 2}


class Settable:
    """A predictor whose cost model the test sets between steps."""

    def __init__(self) -> None:
        self.model = CostModel()

    def __call__(self, worker: int, shape: BatchShape) -> float:
        return self.model.predict(shape)


def chunks_beside_a_decode_at(context: int) -> list[int]:
    """B decodes at `context`; C's 60-token prompt is chunked beside it, 20 ms a step, at 1 ms a
    token and 0.1 ms a KV position read."""
    times = Settable()
    core = Scheduler(
        CoreConfig(step_time_budget_ms=20.0), [WorkerSpec("w0", 400, 1, 4096)], predict=times
    )
    core.add(seq("B", context, max_tokens=10))
    checked_step(core)
    times.model = CostModel(per_token=1e-3, per_kv_read=1e-4)
    core.add(seq("C", 60, max_tokens=2))
    return [checked_step(core)["C"] for _ in range(2)]


def test_a_longer_context_decode_leaves_a_shorter_chunk() -> None:
    # B's decode reads 10 positions (2 ms): C takes 16 tokens (17.6 ms), then, from 16, 14
    assert chunks_beside_a_decode_at(9) == [16, 14]
    # B's decode reads 60 (7 ms): C takes 11 (12.1 ms), then, from 11, 10
    assert chunks_beside_a_decode_at(59) == [11, 10]


def test_without_chunking_a_prompt_over_the_budget_runs_whole_in_an_empty_step() -> None:
    core = make(FakeTimes(token_ms=1.0), budget_ms=2.0, chunked_prefill=False)
    core.add(seq("A", 6, max_tokens=2))
    assert checked_step(core) == {"A": 6}


def per_token(ms: float, sampled_ms: float = 0.0) -> CostModel:
    return CostModel(per_token=ms / 1e3, per_sampled=sampled_ms / 1e3)


def test_a_timer_adds_decodes_to_what_the_step_holds() -> None:
    timer = StepTimer(per_token(1.0).predict, limit_s=1.0)
    timer.add(8, 4, False)
    timer.add_decodes(contexts=30, count=3)  # three decodes reading 30 positions in all
    assert timer.shape == BatchShape.item(8, 4, False) + BatchShape(3, 3, 30, 30)
    assert timer.predicted() == pytest.approx(0.007)


def test_a_chunk_that_fits_whole_is_kept_whole() -> None:
    timer = StepTimer(per_token(1.0).predict, limit_s=0.010)
    assert timer.cut(0, 10, True) == 10
    assert timer.cut(0, 0, True) == 0 and timer.cut(0, -3, True) == 0


def test_a_chunk_is_cut_to_the_tokens_that_fit_without_sampling() -> None:
    """A cut chunk stops short of the prompt's end: it samples nothing, so the LM head's cost
    (5 ms here) is not charged to it, and it may take all but the last token."""
    timer = StepTimer(per_token(1.0, sampled_ms=5.0).predict, limit_s=0.010)
    assert timer.cut(0, 20, True) == 10
    assert timer.cut(0, 10, True) == 9  # 10 + 5 ms over; 10 without sampling would fit
    assert timer.cut(0, 20, True, least=12) == 12  # progress the caller needs


def test_with_no_time_left_a_chunk_gets_only_the_least_asked() -> None:
    timer = StepTimer(per_token(1.0).predict, limit_s=0.002)
    timer.add_decodes(contexts=10, count=3)
    assert timer.cut(0, 5, False) == 0
    assert timer.cut(0, 5, False, least=1) == 1
    assert timer.cut(0, 5, False, whole=True) == 0
    assert timer.cut(0, 5, False, least=1, whole=True) == 5


def test_a_step_predicted_at_the_limit_fits_within_the_rounding_slack() -> None:
    timer = StepTimer(lambda shape: SLACK * shape.tokens, limit_s=0.0)
    assert timer.cut(0, 1, False) == 1  # predicted at limit + SLACK exactly
    assert timer.cut(0, 2, False) == 1


class Counted:
    """A predictor that counts its calls."""

    def __init__(self, predict) -> None:
        self.predict, self.calls = predict, 0

    def __call__(self, shape: BatchShape) -> float:
        self.calls += 1
        return self.predict(shape)


def most_that_fit(timer: StepTimer, start: int, n: int) -> int:
    """What a cut must answer, by trying every k."""
    return max(
        k for k in range(n) if timer.predict(timer.shape + BatchShape.item(start, k, False))
        <= timer.limit + SLACK or k == 0
    )  # fmt: skip


MONOTONE = {
    "linear": CostModel(0.9e-3, 62e-6, 0.0, 69e-9, 56e-9).predict,
    "convex": lambda shape: 1e-3 + 1e-9 * shape.tokens**2 + 50e-6 * shape.tokens,
    "steps": lambda shape: 1e-3 * (shape.tokens // 7) + (2e-3 if shape.tokens > 40 else 0.0),
}


@pytest.mark.parametrize("kind", MONOTONE)
def test_a_cut_is_the_most_tokens_that_fit_under_any_monotone_model(kind: str) -> None:
    for limit_ms in (2.0, 7.5, 20.0):
        for decodes, contexts in ((0, 0), (1, 300), (24, 30_000)):
            for start in (0, 500, 12_000):
                timer = StepTimer(MONOTONE[kind], limit_s=limit_ms / 1e3)
                timer.add_decodes(contexts, decodes)
                want = most_that_fit(timer, start, 3_000)
                assert timer.cut(start, 3_000, False) == want, (limit_ms, decodes, start)


def test_a_cut_under_a_linear_model_takes_a_few_predictions_not_a_bisection() -> None:
    """Planning cost: a bisection of 3,000 tokens predicts 12 times, besides the whole chunk's
    (13); guesses from the local slope, checked by a neighbour, take 3 to 8 in all."""
    predict = Counted(MONOTONE["linear"])
    for limit_ms, decodes in ((5.0, 0), (20.0, 24), (30.0, 100)):
        timer = StepTimer(predict, limit_s=limit_ms / 1e3)
        timer.add_decodes(decodes * 1_500, decodes)
        predict.calls = 0
        assert 0 < timer.cut(0, 3_000, False) < 3_000
        assert predict.calls <= 8


def test_a_static_batch_is_not_cut_by_a_step_time_budget() -> None:
    """Static batching (the baseline) has no token budget and no time budget: its batch runs
    whole prompts in one step even where each token is predicted at 100 ms against 5 ms."""
    times = FakeTimes(token_ms=100.0)
    core = make(times, budget_ms=5.0, mode=BatchMode.STATIC)
    core.add(seq("B", 40, max_tokens=2))
    core.add(seq("C", 30, max_tokens=2))
    assert checked_step(core) == {"B": 40, "C": 30}
