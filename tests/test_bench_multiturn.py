"""The multi-turn chat workload: history resent every turn, shared system prompts, think times;
in the simulation, turns arrive after the previous answer and prefix caching saves the prefill."""

from __future__ import annotations

import pytest

from llmserve.bench.cost_model import CostModel
from llmserve.bench.multiturn import MultiTurn, multiturn
from llmserve.bench.policy import Policy
from llmserve.bench.simulate import SimSettings, Simulation
from llmserve.bench.stats import summarize
from llmserve.bench.tokens import SIM_VOCAB, TokenSource

SHAPE = MultiTurn(
    conversations=6,
    turns=5,
    system_prompts=2,
    system_tokens=96,
    user_tokens=20,
    answer_tokens=12,
    think_s=1.0,
    rate=2.0,
    seed=3,
)
COST = CostModel(fixed=0.005, per_token=1e-4, per_sampled=1e-5, per_kv_read=1e-8)
SMALL = SimSettings(workers=1, kv_capacity=8192, token_budget=512, max_running=16)


def conversation_prompts(shape: MultiTurn, c: int, answers: list[list[int]]) -> list[list[int]]:
    """Turn by turn, as the simulation builds them: history = prompt + answer."""
    workload = multiturn(shape, TokenSource(seed=shape.seed))
    content = workload.content
    prompts: list[list[int]] = []
    history: list[int] = []
    for t in range(shape.turns):
        prompt = content.prompt_ids(workload.requests[shape.index(c, t)], history)
        prompts.append(prompt)
        history = prompt + answers[t]
    return prompts


def test_every_turn_starts_with_the_previous_prompt_and_its_answer() -> None:
    answers = [[1000 + 10 * t + i for i in range(SHAPE.answer_tokens)] for t in range(5)]
    prompts = conversation_prompts(SHAPE, 1, answers)
    for t in range(1, SHAPE.turns):
        before = prompts[t - 1] + answers[t - 1]
        assert prompts[t][: len(before)] == before
        assert len(prompts[t]) == len(before) + SHAPE.user_tokens == SHAPE.nominal_prompt(t)
        assert prompts[t][len(before) :] != prompts[t - 1][-SHAPE.user_tokens :]  # a new message


def test_conversations_share_one_of_the_system_prompts_and_nothing_else() -> None:
    none: list[list[int]] = [[] for _ in range(SHAPE.turns)]
    firsts = [conversation_prompts(SHAPE, c, none)[0] for c in range(4)]
    n = SHAPE.system_tokens
    assert firsts[0][:n] == firsts[2][:n] and firsts[1][:n] == firsts[3][:n]
    assert firsts[0][:n] != firsts[1][:n]
    assert len({tuple(p[n:]) for p in firsts}) == 4  # each its own user message
    assert all(t in SIM_VOCAB for p in firsts for t in p)  # no special or end-of-sequence id


def test_turns_follow_their_conversation_and_arrivals_repeat_with_the_seed() -> None:
    workload = multiturn(SHAPE, TokenSource())
    assert [r.index for r in workload.roots] == [SHAPE.index(c, 0) for c in range(6)]
    followers = workload.followers()
    assert len(followers) == 6 * 4
    assert all(followers[i].index == i + 1 and followers[i].turn >= 1 for i in followers)
    assert all(r.think_s == 0 for r in workload.roots)
    again = multiturn(SHAPE, TokenSource())
    assert [(r.arrival_s, r.think_s) for r in again.requests] == [
        (r.arrival_s, r.think_s) for r in workload.requests
    ]
    other = multiturn(MultiTurn(**{**_fields(SHAPE), "seed": 4}), TokenSource())
    assert [r.think_s for r in other.requests] != [r.think_s for r in workload.requests]


def test_the_knobs_are_checked() -> None:
    with pytest.raises(ValueError, match="turns"):
        MultiTurn(turns=0)
    with pytest.raises(ValueError, match="think_s"):
        MultiTurn(think_s=-1)


def test_served_turns_resend_the_messages_and_the_answer() -> None:
    texts: list[list[int]] = []

    def text(ids: list[int]) -> str:
        texts.append(ids)
        return f"<{len(texts)}>"

    workload = multiturn(SHAPE, TokenSource(), text)
    first = workload.content.served_input(workload.requests[0], [])
    assert [role for role, _ in first] == ["system", "user"]
    history = [*first, ("assistant", "an answer")]
    second = workload.content.served_input(workload.requests[1], history)
    assert second[:3] == history and second[3][0] == "user" and second[3][1] != first[1][1]


def _run(caching: bool):
    workload = multiturn(SHAPE, TokenSource(seed=SHAPE.seed))
    policy = Policy("continuous", "paged", caching)
    return workload, Simulation(SMALL, policy, COST).run(workload, progress=False)


@pytest.fixture(scope="module")
def on_off():
    return _run(True), _run(False)


def test_a_turn_arrives_its_think_time_after_the_answer_before_it(on_off) -> None:
    (workload, result), _ = on_off
    records = {r.index: r for r in result.records}
    for spec in workload.requests:
        if spec.follows >= 0:
            before = records[spec.follows]
            assert records[spec.index].scheduled_s == pytest.approx(before.end_s + spec.think_s)
    assert all(r.ok and r.completion_tokens == SHAPE.answer_tokens for r in result.records)


def test_prefix_caching_computes_less_of_the_prompts_and_answers_sooner(on_off) -> None:
    (_, on), (_, off) = on_off
    s_on, s_off = summarize(on), summarize(off)
    assert s_on["prompt_tokens"] == s_off["prompt_tokens"]  # the same prompts
    assert s_off["prefix"]["prefill_computed"] == s_off["prompt_tokens"]
    assert s_off["prefix"]["hit_rate"] in (0.0, None)
    # turn t > 0 needs only its new message (and the block the unwritten last answer token
    # leaves partial); each system prompt is computed once
    assert s_on["prefix"]["prefill_computed"] < 0.4 * s_off["prefix"]["prefill_computed"]
    assert s_on["prefix"]["hit_rate"] > 0.6
    assert s_on["ttft_later_turns_s"]["p50"] < s_off["ttft_later_turns_s"]["p50"]


def _fields(shape: MultiTurn) -> dict:
    return {k: getattr(shape, k) for k in shape.__dataclass_fields__}


def test_a_refused_turn_ends_its_conversation() -> None:
    workload = multiturn(SHAPE, TokenSource())
    settings = SimSettings(workers=1, kv_capacity=8192, token_budget=512, max_context=200)
    result = Simulation(settings, Policy("continuous", "paged", True), COST).run(
        workload, progress=False
    )
    by_turn = {t: [r for r in result.records if r.turn == t] for t in range(SHAPE.turns)}
    assert len(result.records) == len(workload.requests)
    assert all(r.ok for t in (0, 1, 2) for r in by_turn[t])  # prompts of 116, 148, 180
    assert all(r.error.startswith("refused") for r in by_turn[3])  # 212 tokens > 200
    assert all(r.error.startswith("not sent") for r in by_turn[4])
