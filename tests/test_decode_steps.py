"""Several executions per step (--decode-steps K): while a worker's batch only decodes and no
request waits, its step runs the decodes up to K times, each execution feeding the next the
token it sampled, and the K tokens of each request come back together. The outputs are those
of one execution per step; the run ends at a request's length; a stop token ends its request
there (what the worker computed after it is dropped); a waiting request keeps steps at one
execution; nothing is preempted to make a run; KV is freed at the end."""

from __future__ import annotations

import random

import pytest

from llmcommon.sampling import Grammar, SamplingParams
from llmcommon.v1 import common_pb2
from llmserve.status_text import decode_steps_text
from scheduler_svc.config import MAX_DECODE_STEPS, CoreConfig, KvPolicy, WorkerSpec
from scheduler_svc.core import RUN_LIMIT_S, Scheduler
from scheduler_svc.live_settings import SettingError, apply
from scheduler_svc.sequence import Finish
from tests.inproc import run_all
from tests.sim import Overlapped, Recording, check_invariants, fake_token, sample, seq, step


def make(capacity: int = 24, block_size: int = 1, step_s: float = 0.001, **cfg) -> Scheduler:
    """The seed's worker: KV capacity 24 positions, token budget 8; each execution predicted
    to take `step_s`."""
    cfg.setdefault("token_budget", 8)
    cfg.setdefault("decode_runs", "fixed")  # the length asked for (auto: test_decode_runs_auto)
    spec = WorkerSpec("w0", capacity // block_size, block_size, 4096)
    return Recording(CoreConfig(**cfg), [spec], predict=lambda worker, shape: step_s)


def drive(core: Scheduler, limit: int = 200) -> list[tuple[dict[str, int], int]]:
    """Every step until nothing is left: (tokens each request processed, executions)."""
    history = []
    for _ in range(limit):
        steps = step(core)
        check_invariants(core)
        if not steps and not core.waiting:
            return history
        history += [(s.ran(), s.repeat) for s in steps if s.has_work]
    raise AssertionError("did not finish")


def test_a_lone_decode_runs_four_executions_per_step_with_the_same_tokens() -> None:
    """The seed's B (prompt 3, 9 tokens) alone on the worker of 24 positions, budget 8: its
    prompt step samples token 1, then steps of 4 executions (tokens 2-5, 6-9), its KV freed."""
    outputs = {}
    for runs in (1, 4):
        core = make(decode_steps=runs)
        core.add(b := seq("B", 3, max_tokens=9))
        history = drive(core)
        outputs[runs] = list(b.output_ids)
        assert b.finish is Finish.LENGTH
        assert core.workers[0].kv.pool.num_free == 24
    assert history == [({"B": 3}, 1), ({"B": 4}, 4), ({"B": 4}, 4)]
    assert outputs[1] == outputs[4] and len(outputs[4]) == 9
    assert core.steps == 9 and core.run_steps == 2  # executions, and steps of several


def test_a_run_ends_at_the_shortest_remaining_length() -> None:
    """B has 5 tokens left and D 2 after their prompts: the run takes 2 executions (D's
    last token), then B's 3 remaining in one step of 3."""
    core = make(decode_steps=4)
    core.add(seq("B", 3, max_tokens=6))
    core.add(seq("D", 3, max_tokens=3))
    history = drive(core)
    assert [r for _, r in history] == [1, 2, 3]
    assert history[1][0] == {"B": 2, "D": 2} and history[2][0] == {"B": 3}


def test_a_stop_token_inside_a_run_ends_the_request_there() -> None:
    """B's 4th token is a stop token: the run of 4 that samples it hands out B's tokens up to
    it, finishes B with stop, and drops what the worker computed after it."""
    probe = make()
    probe.add(p := seq("B", 3, max_tokens=9))
    drive(probe)
    stop = p.output_ids[3]
    for runs in (1, 4):
        core = make(decode_steps=runs)
        core.add(b := seq("B", 3, max_tokens=9, eos_ids=frozenset({stop})))
        drive(core)
        assert b.finish is Finish.STOP and b.output_ids == p.output_ids[:4]
        assert core.generated == 4
        assert core.workers[0].kv.pool.num_free == 24


@pytest.mark.parametrize(("step_s", "runs"), [(0.03, 3), (0.06, 1), (0.0, 8)])
def test_a_run_lasts_at_most_the_run_limit_as_predicted(step_s: float, runs: int) -> None:
    """Executions predicted at 30 ms: runs of 3 (within RUN_LIMIT_S, 100 ms); at 60 ms one
    per step; a model that predicts nothing bounds nothing."""
    core = make(decode_steps=8, step_s=step_s)
    core.add(seq("B", 3, max_tokens=20))
    history = drive(core)
    assert history[1][1] == runs and RUN_LIMIT_S == 0.1


def test_a_waiting_request_keeps_steps_at_one_execution() -> None:
    """The seed's C (prompt 6) waits behind B for the running limit of 1: B decodes one
    execution per step while C waits, so C is admitted the step after B's last token."""
    core = make(decode_steps=4, max_running=1)
    core.add(seq("B", 3, max_tokens=4))
    core.add(seq("C", 6, max_tokens=2))
    history = drive(core)
    assert history[:5] == [
        ({"B": 3}, 1), ({"B": 1}, 1), ({"B": 1}, 1), ({"B": 1}, 1), ({"C": 6}, 1)
    ]  # fmt: skip
    assert history[5:] == [({"C": 1}, 1)]  # its last token: a run of one


@pytest.mark.parametrize(("c_tokens", "preempted"), [(6, 0), (8, 1)])
def test_no_request_is_preempted_to_make_a_run(c_tokens: int, preempted: int) -> None:
    """Paged blocks of 4 on the 24-position worker (6 blocks): B (prompt 3, 9 tokens) and C
    (prompt 6) fill it exactly with C's 6 tokens, or one block too many with 8. Runs take only
    blocks that are free and come out shorter where they run out: no preemption that one
    execution per step would not make, the same outputs."""
    outputs = {}
    for runs in (1, 8):
        core = make(block_size=4, decode_steps=runs, token_budget=16)
        core.add(b := seq("B", 3, max_tokens=9))
        core.add(c := seq("C", 6, max_tokens=c_tokens))
        drive(core)
        outputs[runs] = (list(b.output_ids), list(c.output_ids), core.preemptions)
        assert core.workers[0].kv.pool.num_free == 6
        assert (core.run_steps > 0) == (runs > 1)
    assert outputs[8] == outputs[1] and outputs[8][2] == preempted


@pytest.mark.parametrize("field", ["logprobs", "grammar"])
def test_requests_taking_tokens_one_at_a_time_keep_steps_at_one_execution(field: str) -> None:
    if field == "logprobs":
        sampling = SamplingParams(logprobs=0)
    else:
        sampling = SamplingParams(grammar=Grammar(kind=common_pb2.Grammar.REGEX, spec="a+"))
    core = make(decode_steps=4)
    core.add(seq("B", 3, max_tokens=6, sampling=sampling))
    assert all(r == 1 for _, r in drive(core))


def test_overlap_runs_give_the_same_outputs() -> None:
    """With overlap the step after a run is planned before its tokens are known: it runs on
    from the run's last token (the core counts it in flight), and a request the run finished
    is dropped from it."""
    outputs = []
    for runs in (1, 4):
        core = make(decode_steps=runs)
        reqs = [seq("B", 3, max_tokens=11), seq("D", 2, max_tokens=6)]
        for r in reqs:
            core.add(r)
        driver = Overlapped(core)
        for _ in range(30):
            driver.step()
            check_invariants(core)
        driver.flush()
        outputs.append([list(r.output_ids) for r in reqs])
        assert all(r.finish is Finish.LENGTH for r in reqs)
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("policy", [KvPolicy.PAGED, KvPolicy.RESERVE])
def test_random_workloads_through_the_worker_session_match_one_execution_per_step(
    overlap: bool, policy: KvPolicy
) -> None:
    """The step messages executed by a worker session (the simulated model), two workers,
    requests of random lengths, some with stop tokens, KV tight enough to preempt: the same
    outputs with runs of up to 1, 3 and 8 executions; invariants after every step, every
    block free at the end."""
    rng = random.Random(7)
    specs = [(rng.randint(1, 14), rng.randint(1, 16)) for _ in range(30)]
    results = []
    for runs in (1, 3, 8):
        core = Scheduler(
            CoreConfig(
                token_budget=16,
                max_running=4,
                policy=policy,
                decode_steps=runs,
                decode_runs="fixed",
            ),
            [WorkerSpec("w0", 10, 4, 64), WorkerSpec("w1", 12, 4, 64)],
        )
        reqs = [seq(f"r{i}", p, m) for i, (p, m) in enumerate(specs)]
        for r in reqs:
            core.add(r)
        run_all(core, overlap)
        results.append({r.request_id: (r.finish, list(r.output_ids)) for r in reqs})
        assert all(ws.kv.pool.num_free == ws.spec.num_blocks for ws in core.workers)
        assert (core.run_steps > 0) == (runs > 1)
    assert results[0] == results[1] == results[2]


def test_the_fake_worker_feeds_each_execution_the_token_before() -> None:
    """The test sampler itself: a run's tokens are those of single steps in a row."""
    core = make(decode_steps=3)
    core.add(b := seq("B", 3, max_tokens=4))
    step(core)
    planned = core.schedule(0)
    assert planned.repeat == 3
    context = list(b.tokens)
    expected = []
    for _ in range(3):
        expected.append(fake_token(context))
        context.append(expected[-1])
    assert sample(planned) == expected


def test_the_setting_is_bounded_and_live_and_shows_in_status() -> None:
    with pytest.raises(ValueError, match="decode_steps must be 1 to"):
        CoreConfig(decode_steps=0)
    with pytest.raises(ValueError, match="decode_steps must be 1 to"):
        CoreConfig(decode_steps=MAX_DECODE_STEPS + 1)
    assert apply(CoreConfig(), {"decode-steps": "4"}).decode_steps == 4
    with pytest.raises(SettingError):
        apply(CoreConfig(), {"decode-steps": "0"})
    assert decode_steps_text({"decode_steps": 1}) == ""
    assert "up to 4 per step (3 such" in decode_steps_text({"decode_steps": 4, "run_steps": 3})


# The worker's side: a step that repeats its decodes, on the tiny model.


def tiny_session():
    import torch

    from tests.model_support import model
    from worker_svc.runner import ModelRunner
    from worker_svc.session import Session

    config, weights = model("tiny")
    return Session(ModelRunner(config, weights, 16, 4, dtype=torch.float32), 16)


def prompt_step(blocks: list[int], seed: int | None = None) -> object:
    from llmcommon.v1 import worker_pb2

    first = worker_pb2.Step(step=0)
    sampling = common_pb2.SamplingParams(temperature=0.0 if seed is None else 0.9)
    if seed is not None:
        sampling.seed = seed
    for handle in (1, 2):
        first.added.add(handle=handle, request_id=f"r{handle}", sampling=sampling)
        first.chunks.add(handle=handle, token_ids=[5 + handle, 17, 42], sample=True)
    first.grants.add(handle=1, blocks=blocks[:2])
    first.grants.add(handle=2, blocks=blocks[2:4])
    return first


@pytest.mark.parametrize("seed", [None, 11])
def test_the_worker_runs_a_repeated_step_as_single_steps_in_a_row(seed: int | None) -> None:
    """Two requests, greedy or seeded: one step of 4 executions returns, execution by
    execution, the tokens of 4 single decode steps; its forward time is the executions'."""
    from llmcommon.v1 import worker_pb2

    singles, repeated = tiny_session(), tiny_session()
    for s in (singles, repeated):
        assert s.run(prompt_step([0, 1, 2, 3], seed))[0].tokens
    one = [singles.run(worker_pb2.Step(step=1 + i, decodes=[1, 2]))[0] for i in range(4)]
    result, _, seconds = repeated.run(worker_pb2.Step(step=1, decodes=[1, 2], repeat=4))
    assert not result.error and not result.failed
    assert list(result.tokens) == [t for r in one for t in r.tokens]
    assert len(repeated.executions) == 4 and seconds == sum(t for _, t in repeated.executions)
    assert result.kv.written_positions == singles.report().written_positions


def test_a_repeated_step_without_room_fails_that_request_alone() -> None:
    """Request 2's table (2 blocks of 4) ends at position 8: a run of 6 from position 3 would
    write past it, so it fails alone; request 1 (4 blocks) runs all 6 executions."""
    from llmcommon.v1 import worker_pb2

    session = tiny_session()
    first = prompt_step([0, 1, 2, 3])
    first.grants[0].blocks.extend([4, 5])
    session.run(first)
    result, _, _ = session.run(worker_pb2.Step(step=1, decodes=[1, 2], repeat=6))
    assert list(result.failed) == [2] and "position" in result.failed[2]
    assert len(result.tokens) == 6


@pytest.mark.parametrize(
    ("repeat", "chunks", "message"),
    [(MAX_DECODE_STEPS + 1, False, "at most"), (2, True, "only decodes may repeat")],
)
def test_a_repeat_the_worker_cannot_run_is_an_error(repeat: int, chunks: bool, message: str):
    from llmcommon.v1 import worker_pb2

    session = tiny_session()
    session.run(prompt_step([0, 1, 2, 3]))
    step = worker_pb2.Step(step=1, decodes=[1], repeat=repeat)
    if chunks:
        step.chunks.add(handle=2, token_ids=[3], start_position=3, sample=True)
    result, _, _ = session.run(step)
    assert message in result.error and not result.tokens


def test_a_run_hands_out_the_events_of_single_steps() -> None:
    """What the service streams, not only what the core keeps: B stops on its 3rd token inside
    a run while D, after it in the batch, runs on. The events (each token by request, in order,
    then each finish) are those of one execution per step, B's tokens after its stop are not
    handed out, and D's tokens of that execution are."""
    probe = make()
    probe.add(p := seq("B", 3, max_tokens=9))
    drive(probe)
    stop = p.output_ids[2]
    logs = {}
    for runs in (1, 4):
        core = make(decode_steps=runs)
        core.add(seq("B", 3, max_tokens=9, eos_ids=frozenset({stop})))
        core.add(seq("D", 2, max_tokens=7))
        history = drive(core)
        events = core.take_events()
        tokens = {
            rid: [e.token_id for e in events if e.request_id == rid and e.token_id is not None]
            for rid in ("B", "D")
        }
        finishes = [(e.request_id, e.finish) for e in events if e.finish is not None]
        logs[runs] = (tokens, finishes)
        assert len(tokens["B"]) == 3 and len(tokens["D"]) == 7
    assert max(r for _, r in history) > 1  # B stopped inside a run of D's
    assert logs[4] == logs[1]


def test_a_run_answered_with_the_wrong_number_of_tokens_is_refused_by_name() -> None:
    core = make(decode_steps=4)
    core.add(seq("B", 3, max_tokens=9))
    step(core)
    planned = core.schedule(0)
    assert planned.repeat == 4
    with pytest.raises(ValueError, match="^3 tokens for 4 executions of 1 decodes$"):
        core.complete(planned, sample(planned)[:3])


def test_each_worker_bounds_its_runs_by_its_own_model() -> None:
    """Two workers, one predicted at 30 ms an execution (runs of 3 within RUN_LIMIT_S) and one
    at 10 ms (runs of 8, the setting): one request on each."""
    speeds = {0: 0.03, 1: 0.01}
    core = Recording(
        CoreConfig(token_budget=8, decode_steps=8, decode_runs="fixed"),
        [WorkerSpec("w0", 24, 1, 4096), WorkerSpec("w1", 24, 1, 4096)],
        predict=lambda worker, shape: speeds[worker],
    )
    core.add(seq("B", 3, max_tokens=20))
    core.add(seq("D", 3, max_tokens=20))
    runs: dict[int, set[int]] = {0: set(), 1: set()}
    for _ in range(50):
        for s in step(core):
            if s.decodes:
                runs[s.worker].add(s.repeat)
        check_invariants(core)
    assert max(runs[0]) == 3 and max(runs[1]) == 8


def test_a_run_takes_the_kv_it_needs_and_no_more() -> None:
    """B (prompt 3, 9 tokens) on a worker of the 12 positions admission asks of it (its last
    two runs write positions 3-6 and 7-10): runs of 4 fit to the end, tokens 2-5 then 6-9; a
    run that took a position or two more than it writes would come out shorter."""
    core = make(capacity=12, decode_steps=4)
    core.add(b := seq("B", 3, max_tokens=9))
    assert drive(core) == [({"B": 3}, 1), ({"B": 4}, 4), ({"B": 4}, 4)]
    assert b.finish is Finish.LENGTH and core.preemptions == 0


def test_a_run_short_of_blocks_runs_to_the_end_of_what_it_holds() -> None:
    """Blocks of 4, three of them: B (prompt 1) holds one, C (prompt 5) two. A run of 6 (C's
    remaining tokens) would need 7 positions of B, and no block is free: the run stops at the
    end of B's block (positions 1-3, 3 executions); C's fits in its own blocks."""
    core = make(capacity=12, block_size=4, decode_steps=8)
    core.add(seq("B", 1, max_tokens=11))
    core.add(seq("C", 5, max_tokens=7))
    history = drive(core)
    assert history[:2] == [({"B": 1, "C": 5}, 1), ({"B": 3, "C": 3}, 3)]


def test_every_request_of_a_run_gets_the_kv_it_needs_after_one_that_has_it() -> None:
    """Blocks of 4: B (prompt 1) holds room for a run of 3 in its block; D (prompt 3), after it
    in the batch, needs a block more. The invariants (every running request holds the KV its
    computed positions need) hold after every step."""
    core = make(block_size=4, decode_steps=3, token_budget=16)
    core.add(seq("B", 1, max_tokens=10))
    core.add(seq("D", 3, max_tokens=10))
    history = drive(core)  # check_invariants after every step
    assert history[1] == ({"B": 3, "D": 3}, 3)


def test_a_setting_of_two_makes_runs_of_two() -> None:
    core = make(decode_steps=2)
    core.add(seq("B", 3, max_tokens=5))
    assert drive(core) == [({"B": 3}, 1), ({"B": 2}, 2), ({"B": 2}, 2)]


def test_a_request_after_one_short_of_blocks_still_gets_the_kv_of_the_shorter_run() -> None:
    """Blocks of 4, three of them: B (prompt 1) would need two more blocks for a run of 8 and
    one is free, so the run comes out at what B holds (3 executions); D (prompt 3), after B in
    the batch, takes the free block for those 3. Invariants after every step."""
    core = make(capacity=12, block_size=4, decode_steps=8, token_budget=16)
    core.add(seq("B", 1, max_tokens=11))
    core.add(seq("D", 3, max_tokens=9))
    history = drive(core)
    assert history[1] == ({"B": 3, "D": 3}, 3)


def test_a_run_the_free_blocks_cannot_hold_for_all_takes_none_it_would_not_write() -> None:
    """Blocks of 4, five of them: B (prompt 1) and D (prompt 3) hold one each, three are free.
    A run of 8 would need two more for each; the longest the three hold for both is 7 (B one
    more, D two). No block is taken that the run does not write: a block taken for B before D
    came up short would be held unwritten, and a new arrival would read it as reserved space
    (a kv_reserved stall under paged)."""
    core = make(capacity=20, block_size=4, decode_steps=8, token_budget=16)
    core.add(seq("B", 1, max_tokens=16))
    core.add(seq("D", 3, max_tokens=16))
    step(core)
    [run] = step(core)
    check_invariants(core)
    assert run.ran() == {"B": 7, "D": 7} and run.repeat == 7
    kv = core.workers[0].kv
    assert kv.pool.num_free == 0 and kv.reserved_unused(list(core.seqs.values())) == 0
