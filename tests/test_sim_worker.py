"""The simulated worker honours the settings that decide when a request ends and what it
returns (logit_bias, min_tokens with stop ids, logprobs), as a real worker's logits would, and
stays a function of the request alone."""

from __future__ import annotations

import math

import pytest

from llmcommon.sampling import GREEDY, SamplingParams
from worker_svc.sim import FIRST_TOKEN, SPREAD, SimRunner, sim_config, sim_token
from worker_svc.work import WorkItem

VOCAB = sim_config().vocab_size


def run(settings: SamplingParams, steps: int = 1, prompt=(5, 6, 7)) -> list[WorkItem]:
    """Decode `steps` tokens of one request alone; the item after each step."""
    runner = SimRunner(sim_config(), num_blocks=8, block_size=16, step_seconds=0.0)
    item = WorkItem("r", list(prompt), 0, [0], sampling=settings)
    seen = []
    for _ in range(steps):
        (token,) = runner.execute([item])
        seen.append(WorkItem("r", [token], 0, [0], sampling=settings, logprobs=item.logprobs))
        item.start_position += len(item.token_ids)
        item.token_ids, item.sample_index = [token], item.sample_index + 1
    return seen


def tokens(settings: SamplingParams, steps: int = 1) -> list[int]:
    return [i.token_ids[0] for i in run(settings, steps)]


def test_without_settings_the_sim_samples_its_hashed_tokens() -> None:
    item = WorkItem("r", [5, 6, 7], 0, [0])
    assert tokens(GREEDY) == [sim_token(item)]


def test_a_large_logit_bias_forces_a_token_outside_the_spread_and_a_small_one_does_not() -> None:
    assert tokens(SamplingParams(temperature=0.0, logit_bias={77: 100.0}), 3) == [77, 77, 77]
    assert tokens(SamplingParams(temperature=0.0, logit_bias={77: 5.0})) == tokens(GREEDY)


def test_a_negative_bias_on_the_hashed_token_moves_the_draw_to_the_next_in_the_spread() -> None:
    plain = tokens(GREEDY)[0]
    moved = tokens(SamplingParams(temperature=0.0, logit_bias={plain: -1.0}))[0]
    assert moved == FIRST_TOKEN + (plain - FIRST_TOKEN + 1) % SPREAD


def test_a_forced_stop_id_is_masked_until_min_tokens() -> None:
    forced = dict(logit_bias={77: 100.0}, stop_token_ids=(77,))
    drawn = tokens(SamplingParams(temperature=0.0, min_tokens=2, **forced), 3)
    assert 77 not in drawn[:2] and drawn[2] == 77
    assert tokens(SamplingParams(temperature=0.0, **forced))[0] == 77


def test_a_hashed_stop_id_is_masked_until_min_tokens() -> None:
    plain = tokens(GREEDY)[0]
    masked = tokens(SamplingParams(temperature=0.0, stop_token_ids=(plain,), min_tokens=1))[0]
    assert masked != plain and FIRST_TOKEN <= masked < FIRST_TOKEN + SPREAD


@pytest.mark.parametrize("top", [0, 1, 5])
def test_logprobs_have_the_real_workers_shape_and_sum_to_one_over_the_vocabulary(top) -> None:
    (item,) = run(SamplingParams(temperature=0.0, logprobs=top))
    lp = item.logprobs
    assert lp is not None and len(lp.top_ids) == len(lp.top_logprobs) == top
    assert lp.top_ids[:1] == tuple(item.token_ids[:1]) if top else lp.top_ids == ()
    spread_p, off_p = math.exp(lp.logprob), math.exp(lp.logprob - 30.0)
    assert SPREAD * spread_p + (VOCAB - SPREAD) * off_p == pytest.approx(1.0)


def test_logprobs_of_a_forced_token_are_of_the_raw_logits() -> None:
    (forced,) = run(SamplingParams(temperature=0.0, logit_bias={77: 100.0}, logprobs=2))
    (plain,) = run(SamplingParams(temperature=0.0, logprobs=2))
    assert forced.token_ids == [77] and forced.logprobs.logprob == pytest.approx(
        plain.logprobs.logprob - 30.0
    )
    assert forced.logprobs.top_ids == plain.logprobs.top_ids


def test_without_logprobs_asked_none_come() -> None:
    assert run(GREEDY)[0].logprobs is None
