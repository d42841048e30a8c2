"""Speculative decoding in the core (issue 39, the scheduler's side): a running decode takes a
draft from the proposer, counted in the token budget (1 + k tokens), the step-time budget and
its KV before the step, never preempting anyone for it; the worker's answer keeps what it
verified, cut at a stop token or the length as without speculation; rejected positions' blocks
go back to the pool (trimmed on the worker too) and the prefix cache never keeps one; a request
whose draft is in flight is planned into no other step; preemption, failures and decode runs
stay correct. The outputs are those of one token per step."""

from __future__ import annotations

import pytest

from scheduler_svc.blocks import block_keys, blocks_for
from scheduler_svc.config import CoreConfig, DraftLength, Speculative, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.live_settings import apply
from scheduler_svc.messages import step_message
from scheduler_svc.output import StepLogprobs
from scheduler_svc.sequence import Finish, Sequence
from scheduler_svc.step_cost import CostModel, step_shape
from tests import spec_sim
from tests.spec_sim import Overlapped, cycling, mixed

SPEC = {"speculative": Speculative.NGRAM, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
FLAT = CostModel(fixed=0.05, per_token=0.0005)  # one decode is mostly its fixed cost


def make(capacity: int = 512, block_size: int = 4, cost: CostModel = FLAT, **cfg) -> Scheduler:
    cfg.setdefault("token_budget", 64)
    spec = WorkerSpec("w0", capacity // block_size, block_size, 4096)
    return Scheduler(CoreConfig(**cfg), [spec], predict=lambda worker, shape: cost.predict(shape))


def request(rid: str, max_tokens: int = 40, prompt: list[int] | None = None, **kw) -> Sequence:
    return Sequence(rid, prompt or [3, 5, 8, 4], max_tokens, **kw)


def outputs(core: Scheduler, seqs: list[Sequence], overlap: bool = False) -> dict[str, list]:
    for s in seqs:
        core.add(s)
    if overlap:
        Overlapped(core).drive()
    else:
        spec_sim.drive(core)
    assert core.workers[0].kv.pool.num_free == core.workers[0].spec.num_blocks
    return {s.request_id: list(s.output_ids) for s in seqs}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("length", [DraftLength.FIXED, DraftLength.AUTO])
def test_outputs_equal_those_without_speculation_and_fewer_steps_run(length, overlap) -> None:
    plain = make()
    want = outputs(plain, [request("a"), request("b", 23), request("c", 7)], overlap)
    core = make(speculative_length=length, **SPEC)
    got = outputs(core, [request("a"), request("b", 23), request("c", 7)], overlap)
    assert got == want
    assert [len(v) for v in got.values()] == [40, 23, 7]
    assert core.spec_drafts > 0 and core.spec_accepted_tokens > 0
    assert core.steps < plain.steps
    per_pos = core.spec_accepted_per_pos
    assert sum(per_pos.values()) == core.spec_accepted_tokens
    assert all(per_pos[i] >= per_pos[i + 1] for i in range(4))


def test_a_draft_of_k_counts_1_plus_k_tokens_and_drafts_fit_the_leftover_budget() -> None:
    """Token budget 8, two decodes: the drafts take the 6 tokens left, in admission order."""
    core = make(token_budget=8, speculative_length=DraftLength.FIXED, **SPEC)
    a, b = request("a", prompt=[3, 5, 8, 3, 5]), request("b", prompt=[4, 6, 9, 4, 6])
    core.add(a)
    core.add(b)
    for _ in range(30):
        step = core.schedule(0)
        assert step.num_tokens <= 8
        if len(step.drafts) == 2 and not step.chunks:
            break
        spec_sim.complete(core, step)
    else:
        raise AssertionError("never drafted both")
    lengths = [len(d.token_ids) for d in step.drafts]
    assert lengths == [5, 1] and not step.decodes  # K = 5, then what the budget leaves
    assert step.num_tokens == 8 == sum(1 + k for k in lengths)
    assert step.budget == 0
    assert step.ran() == {"a": 6, "b": 2}


def test_a_draft_is_capped_by_max_tokens_and_the_length_is_exact() -> None:
    core = make(speculative_length=DraftLength.FIXED, **SPEC)
    outputs(core, [r := request("r", 9)])
    assert len(r.output_ids) == 9 and r.finish is Finish.LENGTH
    plain = make()
    outputs(plain, [p := request("r", 9)])
    assert r.output_ids == p.output_ids


def copying(context: list[int]) -> int:
    """A model that says its 10-token prompt again and again."""
    return context[len(context) - 10]


def test_a_stop_token_inside_a_draft_ends_the_request_there_and_frees_its_kv() -> None:
    """The model repeats its prompt, whose 9th token is a stop token: the draft that carries it
    is accepted whole and the worker emits 5 tokens past it; the request keeps the tokens up to
    the stop, as without speculation, finishes with stop, and frees its KV."""
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 99, 19]
    want = prompt[:9]
    stops = frozenset({99})
    core = make(speculative_length=DraftLength.FIXED, **SPEC)
    core.add(r := request("r", 30, prompt=prompt, eos_ids=stops))
    past_stop = []
    for _ in range(20):
        step = core.schedule(0)
        if not step.has_work:
            break
        tokens, emitted = spec_sim.run(step, copying)
        if step.drafts and 99 in tokens[:-1]:
            past_stop.append(len(tokens) - 1 - tokens.index(99))
        core.complete(step, tokens, emitted)
        spec_sim.invariants.check_invariants(core)
    assert r.output_ids == want and r.finish is Finish.STOP
    assert past_stop == [5]
    plain = make()
    plain.add(p := request("r", 30, prompt=prompt, eos_ids=stops))
    spec_sim.drive(plain, copying)
    assert p.output_ids == want
    assert core.workers[0].kv.pool.num_free == core.workers[0].spec.num_blocks


def rejecting(keep: int):
    """A worker that keeps the first `keep` draft tokens of each draft, then its own token."""

    def run(step):
        tokens = [cycling(w.seq.tokens) for w in step.chunks if w.sample]
        tokens += [cycling(s.tokens) for s in step.decodes]
        emitted = []
        for d in step.drafts:
            kept = d.token_ids[:keep]
            tokens += kept + [cycling(d.seq.tokens + kept)]
            emitted.append(len(kept) + 1)
        return tokens, emitted

    return run


def test_blocks_of_rejected_positions_go_back_to_the_pool_and_to_the_worker() -> None:
    """Block size 4: a draft of k from position p holds up to p + 1 + k; one token accepted:
    the position advances by 2 and every block past it is freed, and trimmed on the worker in
    the next step (to a table that still covers every position the worker counts as written)."""
    core = make(block_size=4, speculative_length=DraftLength.FIXED, **SPEC)
    core.add(r := request("r", 40, prompt=[3, 5, 8, 3, 5, 8, 3]))
    ws, run = core.workers[0], rejecting(1)
    drafts = trims = 0
    step = core.schedule(0)
    while step.has_work:
        before = r.num_computed
        tokens, emitted = run(step)
        core.complete(step, tokens, emitted)
        if step.drafts and not r.is_finished:
            d = step.drafts[0]
            keep = blocks_for(r.num_computed, 4)
            assert r.num_computed == before + 1  # the input (counted when planned), one kept
            assert ws.kv.held(r) == keep * 4
            assert ws.kv.pool.num_free == ws.spec.num_blocks - keep
            assert keep * 4 >= r.num_computed  # the worker's own condition for a trim
            past = blocks_for(d.start + 1 + len(d.token_ids), 4) > keep
            expect = [(r.handle, keep)] if past else []
            drafts, trims = drafts + 1, trims + past
        else:
            expect = None
        step = core.schedule(0)
        assert expect is None or step.trims == expect
    assert drafts > 3 and trims > 0
    assert ws.kv.pool.num_free == ws.spec.num_blocks


def test_the_prefix_cache_keeps_only_blocks_of_verified_tokens() -> None:
    """Every block the pool caches, while requests draft and are rejected and after they
    finish, is keyed by a run of a request's verified tokens."""
    core = make(block_size=2, speculative_length=DraftLength.FIXED, **SPEC)
    seqs = [request(f"r{i}", 30, prompt=[3 + i, 5, 8, 3 + i, 5]) for i in range(3)]
    for s in seqs:
        core.add(s)
    run = rejecting(2)
    for _ in range(200):
        steps = core.schedule_all()
        for step in steps:
            tokens, emitted = run(step)
            core.complete(step, tokens, emitted)
        spec_sim.invariants.check_invariants(core)
        if not steps:
            break
    verified = set()
    for s in seqs:
        verified.update(block_keys(s.tokens, 2, [], len(s.tokens) // 2))
    cached = set(core.workers[0].kv.pool.cached)
    assert cached and cached <= verified
    assert core.spec_drafts > 0 and core.spec_accepted_tokens < core.spec_draft_tokens


def test_a_request_whose_draft_is_in_flight_is_planned_into_no_other_step() -> None:
    core = make(speculative_length=DraftLength.FIXED, **SPEC)
    core.add(a := request("a"))
    core.add(b := request("b", prompt=[1, 2]))  # no proposal: its prompt has no repeat
    loop = Overlapped(core)
    for _ in range(60):
        planned = loop.step()
        if any(d.seq is a for d in planned.drafts):
            following = core.schedule(0)  # planned while a's draft is in flight
            assert a not in following.decodes and not following.drafts
            assert b in following.decodes or b.is_finished
            spec_sim.complete(core, loop.inflight)
            loop.inflight = following
            break
    else:
        raise AssertionError("a never drafted")
    loop.drive()
    assert len(a.output_ids) == 40


def test_a_request_preempted_while_its_draft_is_in_flight_loses_only_that_draft() -> None:
    """A pool of 10 blocks: the older request (no proposal: it decodes every step) grows while
    the newer one's draft runs and preempts it; the draft's tokens are dropped, the request is
    recomputed, and every output is as without speculation."""

    def run(**cfg) -> tuple[Scheduler, dict[str, list[int]]]:
        core = make(capacity=40, block_size=4, **cfg)
        seqs = [request("a", 30, prompt=[1, 2, 3]), request("b", 30)]
        for s in seqs:
            core.add(s)
        mid_draft, preempt = [], core._preempt

        def spy(ws, seq, cache=True) -> None:
            mid_draft.append(seq.drafting)
            preempt(ws, seq, cache)
            assert not seq.drafting

        core._preempt = spy
        Overlapped(core, mixed).drive()
        assert core.workers[0].kv.pool.num_free == 10
        core.mid_draft = mid_draft
        return core, {s.request_id: s.output_ids for s in seqs}

    _, want = run()
    core, got = run(speculative_length=DraftLength.FIXED, **SPEC)
    assert got == want and [len(v) for v in got.values()] == [30, 30]
    assert any(core.mid_draft) and core.spec_drafts > 0


def test_a_draft_never_preempts_and_takes_only_free_blocks() -> None:
    """8 blocks of 4 for two requests that may reach 5 each: drafts take the free blocks, down
    to none, and never preempt anyone (the preemptions are the decodes' own); the outputs are
    as without."""
    plain = make(capacity=32, block_size=4)
    want = outputs(plain, [request("a", 12, prompt=[3, 5, 8, 3, 5, 8, 3]), request("b", 12)])
    core = make(capacity=32, block_size=4, speculative_length=DraftLength.FIXED, **SPEC)
    ws, free_after, speculate = core.workers[0], [], core._speculate

    def spy(ws_, step) -> None:
        preempted, running = core.preemptions, list(ws_.running)
        speculate(ws_, step)
        assert core.preemptions == preempted and ws_.running == running
        free_after.append(ws.kv.num_free)

    core._speculate = spy
    got = outputs(core, [request("a", 12, prompt=[3, 5, 8, 3, 5, 8, 3]), request("b", 12)])
    assert got == want and core.spec_drafts > 0
    assert min(free_after) == 0


def test_a_failed_draft_fails_its_request_alone() -> None:
    core = make(speculative_length=DraftLength.FIXED, **SPEC)
    core.add(a := request("a"))
    core.add(b := request("b"))
    for _ in range(20):
        step = core.schedule(0)
        if len(step.drafts) == 2:
            break
        spec_sim.complete(core, step)
    failed = {step.drafts[0].handle: "bad"}
    finishes = core.fail_items(step, failed, "w0")
    assert [f.request_id for f in finishes] == ["a"] and len(step.drafts) == 1
    spec_sim.complete(core, step)
    spec_sim.drive(core)
    assert a.finish is Finish.ERROR and len(b.output_ids) == 40
    assert core.workers[0].kv.pool.num_free == core.workers[0].spec.num_blocks


def test_a_step_with_drafts_runs_once_and_decode_runs_go_on_without_them() -> None:
    core = make(decode_steps=4, speculative_length=DraftLength.FIXED, **SPEC)
    plain = make(decode_steps=4)
    got = outputs(core, [request("a"), request("b", prompt=[1, 2])])
    want = outputs(plain, [request("a"), request("b", prompt=[1, 2])])
    assert got == want and core.spec_drafts > 0


@pytest.mark.parametrize("length", [DraftLength.FIXED, DraftLength.AUTO])
def test_with_overlap_a_run_in_flight_gives_way_to_drafts_once_a_proposal_exists(length) -> None:
    """Runs of 8 (cheap executions, so runs are long) with overlap: the request runs while its
    text has no repeat; once the proposer has a proposal, the step planned while a run is in
    flight (no draft possible then) stays one execution, and the one after drafts. Without
    that, each step planned during a run became a run again and no draft ever came."""
    cheap = CostModel(fixed=0.005, per_token=0.0005)
    plain = make(cost=cheap, decode_steps=8, decode_runs="fixed")
    want = outputs(plain, [request("a", 80)], overlap=True)
    core = make(cost=cheap, decode_steps=8, decode_runs="fixed", speculative_length=length, **SPEC)
    core.add(a := request("a", 80))
    driver, kinds = Overlapped(core), []
    for _ in range(200):
        planned = driver.step()
        if planned.has_work:
            kinds.append("run" if planned.repeat > 1 else "draft" if planned.drafts else "one")
        if driver.inflight is None and not core.workers[0].running:
            break
    assert list(a.output_ids) == want["a"]
    first = kinds.index("run")
    assert "draft" in kinds[first:] and core.spec_accepted_tokens > 0
    assert kinds.count("run") < 8  # 80 tokens: not all of them by runs


def test_with_overlap_runs_go_on_where_auto_would_not_draft_the_proposal() -> None:
    """The same, under auto, for a request whose acceptance rate is 0: the next step would not
    draft its proposal, so the step planned during its run is a run again (no single step
    between runs that no draft follows)."""
    cheap = CostModel(fixed=0.005, per_token=0.0005)
    core = make(cost=cheap, decode_steps=8, decode_runs="fixed", **SPEC)
    core.add(a := request("a", 80))
    driver, kinds = Overlapped(core), []
    for _ in range(200):
        a.acceptance = 0.0
        planned = driver.step()
        if planned.has_work:
            kinds.append("run" if planned.repeat > 1 else "draft" if planned.drafts else "one")
        if driver.inflight is None and not core.workers[0].running:
            break
    first = kinds.index("run")
    assert "draft" not in kinds and set(kinds[first:-1]) == {"run"}, kinds


def test_the_step_message_carries_the_drafts() -> None:
    core = make(speculative_length=DraftLength.FIXED, **SPEC)
    core.add(request("a"))
    for _ in range(10):
        step = core.schedule(0)
        if step.drafts:
            break
        spec_sim.complete(core, step)
    msg = step_message(1, step)
    assert [(d.handle, list(d.token_ids)) for d in msg.drafts] == [
        (d.handle, d.token_ids) for d in step.drafts
    ]
    assert not msg.decodes and msg.repeat <= 1


def test_logprobs_go_to_the_tokens_kept_of_a_draft_only() -> None:
    from llmcommon.sampling import SamplingParams

    core = make(speculative_length=DraftLength.FIXED, **SPEC)
    probe = make()
    outputs(probe, [p := request("a", 12)])
    stop = p.output_ids[6]
    core.add(a := request("a", 12, eos_ids=frozenset({stop}), sampling=SamplingParams(logprobs=1)))
    owned = []
    for _ in range(30):
        step = core.schedule(0)
        if not step.has_work:
            break
        tokens, emitted = spec_sim.run(step)
        owned += [o for o in StepLogprobs.owners(step, tokens, emitted) if o is not None]
        core.complete(step, tokens, emitted)
    assert a.finish is Finish.STOP and len(owned) == len(a.output_ids)


def test_speculation_is_a_live_setting_and_off_drafts_nothing() -> None:
    core = make()
    outputs(core, [request("a")])
    assert core.spec_drafts == 0 and core.proposer is None
    core.reconfigure(apply(core.config, {"speculative": "ngram", "prompt-lookup-min": "2"}))
    assert core.proposer is not None
    outputs(core, [request("b")])
    assert core.spec_drafts > 0
    core.reconfigure(apply(core.config, {"speculative": "off"}))
    drafts = core.spec_drafts
    outputs(core, [request("c")])
    assert core.spec_drafts == drafts


def test_drafts_fit_the_step_time_budget_and_the_prediction_counts_them() -> None:
    """A decode alone is predicted at 50.5 ms; a budget of 52 ms leaves 3 draft tokens of
    0.5 ms: a draft of 5 is cut to 3, and the step's predicted time (what the window and the
    metrics read) includes them."""
    core = make(step_time_budget_ms=52.0, speculative_length=DraftLength.FIXED, **SPEC)
    core.add(r := request("r", 40))
    lengths = []
    while not r.is_finished:
        step = core.schedule(0)
        if step.drafts:
            lengths.append(len(step.drafts[0].token_ids))
            assert step.timer is not None and step.timer.predicted() <= 0.052 + 1e-9
            assert abs(step.timer.predicted() - FLAT.predict(step_shape(step))) < 1e-12
        spec_sim.complete(core, step)
    assert lengths and max(lengths) == 3


def test_the_heads_explanation_plans_a_copy_without_drafts_or_the_one_in_flight() -> None:
    """`explain` plans a copy of the core: it copies no proposer (drafts come after admission),
    and the request whose draft is in flight takes no budget there, as in the core's own plan."""
    from scheduler_svc.explain import copy_of, explain

    core = make(max_running=1, speculative_length=DraftLength.FIXED, **SPEC)
    core.add(a := request("a"))
    for _ in range(20):
        step = core.schedule(0)
        if step.drafts:
            break
        spec_sim.complete(core, step)
    core.add(request("b"))  # waits: one running at most
    assert a.drafting and copy_of(core).proposer is None
    why = explain(core)
    assert why.reason == "max_running" and why.budget_left == 64
    assert core.proposer is not None and a.drafting
    spec_sim.complete(core, step)


def test_a_resubmitted_request_drafts_from_the_tokens_already_streamed() -> None:
    """After a scheduler restart the gateway resubmits with the tokens it streamed: prompt
    lookup reads them too, and the rest of the output is as without speculation."""
    plain = make()
    outputs(plain, [p := request("r", 40)])
    core = make(speculative_length=DraftLength.FIXED, **SPEC)
    resumed = Sequence("r", [3, 5, 8, 4], 40, output_ids=p.output_ids[:7])
    got = outputs(core, [resumed])
    assert got["r"] == p.output_ids and core.spec_accepted_tokens > 0
