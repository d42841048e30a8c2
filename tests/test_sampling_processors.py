"""logit_bias, min_tokens, the penalties, min_p and logprobs, checked against transformers' logits
processors (an independent formulation), alone on random logits and through a worker session
on a real model against transformers' own generate()."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from llmcommon.sampling import GREEDY, SamplingParams
from llmcommon.v1 import common_pb2, worker_pb2
from tests.model_support import hf, model, one_torch_thread  # noqa: F401  (autouse fixture)
from worker_svc.runner import ModelRunner
from worker_svc.sampling import fresh_generator, sample_one, sample_tokens, shape_logits
from worker_svc.session import Session

VOCAB = 64


def random_logits(seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


def history(seed: int, prompt: int, generated: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB // 2, (prompt + generated,), generator=gen).tolist()


def test_logit_bias_matches_transformers_sequence_bias() -> None:
    logits = random_logits(0)
    bias = {3: 5.0, 17: -2.5, 40: 100.0}
    s = SamplingParams(temperature=0.0, logit_bias=bias)
    oracle = SequenceBiasLogitsProcessor({(k,): v for k, v in bias.items()})
    expected = oracle(torch.tensor([[1, 2]]), logits[None].clone())[0]
    torch.testing.assert_close(shape_logits(logits, s, [], 0), expected)
    assert sample_tokens(logits[None], [s], [0], fresh_generator()) == [40]


@pytest.mark.parametrize("generated", [0, 2, 3, 5])
def test_min_tokens_masks_the_stop_ids_like_transformers_min_new_tokens(generated: int) -> None:
    logits = random_logits(1)
    stops = (int(logits.argmax()), 7)
    s = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=stops)
    seq = history(1, 6, generated)
    oracle = MinNewTokensLengthLogitsProcessor(6, 3, list(stops))
    expected = oracle(torch.tensor([seq]), logits[None].clone())[0]
    torch.testing.assert_close(shape_logits(logits, s, seq, generated), expected)
    token = sample_tokens(logits[None], [s], [generated], fresh_generator())[0]
    assert (token in stops) == (generated >= 3)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers_over_prompt_and_generated(penalty: float) -> None:
    logits = random_logits(2)
    seq = history(2, 8, 4)
    s = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    oracle = RepetitionPenaltyLogitsProcessor(penalty)
    expected = oracle(torch.tensor([seq]), logits[None].clone())[0]
    torch.testing.assert_close(shape_logits(logits, s, seq, 4), expected)


def test_presence_and_frequency_penalties_follow_openai_over_generated_tokens_only() -> None:
    logits = random_logits(3)
    seq = history(3, 10, 6)
    s = SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4)
    expected = logits.clone()
    generated = seq[10:]
    for token in set(generated):  # OpenAI's documented formula, written out
        expected[token] -= generated.count(token) * 0.4 + 0.7
    torch.testing.assert_close(shape_logits(logits, s, seq, 6), expected)
    prompt_only = set(seq[:10]) - set(generated)
    assert all(shape_logits(logits, s, seq, 6)[t] == logits[t] for t in prompt_only)


def test_a_greedy_row_with_penalties_takes_the_argmax_of_the_penalized_logits() -> None:
    logits = torch.zeros(VOCAB)
    logits[5], logits[9] = 3.0, 2.5
    s = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    plain = GREEDY
    tokens = sample_tokens(
        torch.stack([logits, logits]), [s, plain], [1, 1], fresh_generator(), [[1, 5], [1, 5]]
    )
    assert tokens == [9, 5]


def probabilities(logits: torch.Tensor, s: SamplingParams, draws: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(logits.shape[0])
    for _ in range(draws):
        counts[sample_one(logits, s, gen)] += 1
    return counts / draws


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_draws_follow_transformers_temperature_then_min_p(min_p: float) -> None:
    logits = random_logits(4, 16)
    s = SamplingParams(temperature=0.8, min_p=min_p)
    warped = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(0.8)(None, logits[None]))[0]
    expected = torch.softmax(warped, dim=-1)
    seen = probabilities(logits, s, 4000)
    assert set(seen.nonzero().flatten().tolist()) <= set(expected.nonzero().flatten().tolist())
    assert (seen - expected).abs().max() < 0.03


def test_seeded_draws_with_every_setting_do_not_depend_on_the_batch() -> None:
    logits = random_logits(5)
    seq = history(5, 5, 3)
    s = SamplingParams(
        temperature=1.2,
        top_p=0.9,
        top_k=20,
        min_p=0.02,
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={1: 2.0},
        min_tokens=4,
        stop_token_ids=(2,),
    )
    alone = [sample_tokens(logits[None], [s], [i], fresh_generator(), [seq]) for i in range(8)]
    other = SamplingParams(temperature=1.0, presence_penalty=1.0)
    batch = torch.stack([random_logits(6), logits])
    mixed = [
        sample_tokens(batch, [other, s], [0, i], fresh_generator(), [[1], seq])[1:]
        for i in range(8)
    ]
    assert mixed == alone
    assert len({t for [t] in alone}) > 1  # the index still varies the draw


# Through a worker session on the tiny model, against transformers' generate().

BLOCKS, BLOCK_SIZE, PROMPT = 32, 4, [1, 17, 42, 99, 7, 250, 3, 88, 12]


def session_tokens(steps: int, **sampling) -> tuple[list[int], list[common_pb2.TokenLogprobs]]:
    """A request whose prompt goes in two chunks, then greedy decodes; its tokens and logprobs."""
    config, weights = model("tiny")
    runner = ModelRunner(config, weights, BLOCKS, BLOCK_SIZE, dtype=torch.float32)
    session = Session(runner, BLOCKS)
    first = worker_pb2.Step(step=0)
    first.added.add(
        handle=1,
        request_id="r",
        sampling=common_pb2.SamplingParams(**{"temperature": 0.0, **sampling}),
    )
    first.grants.add(handle=1, blocks=list(range(BLOCKS)))
    first.chunks.add(handle=1, token_ids=PROMPT[:5], start_position=0)
    second = worker_pb2.Step(step=1)
    second.chunks.add(handle=1, token_ids=PROMPT[5:], start_position=5, sample=True)
    results = [session.run(first)[0], session.run(second)[0]]
    results += [session.run(worker_pb2.Step(step=2 + i, decodes=[1]))[0] for i in range(steps - 1)]
    assert not any(r.failed or r.error for r in results)
    return [t for r in results for t in r.tokens], [lp for r in results for lp in r.logprobs]


def hf_generate(steps: int, **kwargs) -> list[int]:
    with torch.inference_mode():
        out = hf("tiny").generate(
            torch.tensor([PROMPT]), max_new_tokens=steps, do_sample=False, **kwargs
        )
    return out[0, len(PROMPT) :].tolist()


def test_a_session_with_repetition_penalty_generates_what_transformers_generates() -> None:
    plain, _ = session_tokens(12)
    penalized, _ = session_tokens(12, repetition_penalty=1.8)
    assert plain == hf_generate(12)
    assert penalized == hf_generate(12, repetition_penalty=1.8)
    assert penalized != plain


def test_a_session_masks_a_favoured_stop_token_until_min_tokens() -> None:
    eos = model("tiny")[0].eos_token_ids[0]
    tokens, _ = session_tokens(6, logit_bias={eos: 100.0}, min_tokens=3, stop_token_ids=[eos])
    expected = hf_generate(6, sequence_bias={(eos,): 100.0}, min_new_tokens=3)  # ends at EOS
    assert tokens[: len(expected)] == expected
    assert eos not in tokens[:3] and tokens[3:] == [eos] * 3


def test_a_session_returns_the_raw_model_logprobs_of_each_token_and_the_top_ones() -> None:
    tokens, logprobs = session_tokens(4, logprobs=3, repetition_penalty=1.5)
    assert len(logprobs) == len(tokens)
    with torch.inference_mode():
        raw = hf("tiny")(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    expected = torch.log_softmax(raw.float(), dim=-1)  # [tokens, vocab]
    for row, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        assert math.isclose(lp.logprob, float(expected[row, token]), abs_tol=1e-3)
        top = expected[row].topk(3)
        assert list(lp.top_ids) == top.indices.tolist()
        torch.testing.assert_close(list(lp.top_logprobs), top.values.tolist(), atol=1e-3, rtol=0)


def test_a_step_without_logprobs_requests_returns_none() -> None:
    _, logprobs = session_tokens(3)
    assert logprobs == []


def test_bad_new_sampling_values_fail_the_request_with_a_reason() -> None:
    config, weights = model("tiny")
    runner = ModelRunner(config, weights, BLOCKS, BLOCK_SIZE, dtype=torch.float32)
    bad = {
        "min_p": 1.5,
        "repetition_penalty": -1.0,
        "logit_bias": {config.vocab_size: 1.0},
        "stop_token_ids": [config.vocab_size + 3],
        "logprobs": 21,
        "presence_penalty": math.inf,
    }
    for field, value in bad.items():
        step = worker_pb2.Step(step=0)
        sampling = common_pb2.SamplingParams(**{"temperature": 0.0, field: value})
        step.added.add(handle=1, request_id="r", sampling=sampling)
        result = Session(runner, BLOCKS).run(step)[0]
        assert field.split("_")[0] in result.failed[1] or "vocabulary" in result.failed[1]
