"""Outcomes of worker_svc/sampling.py that its mutation run (issue 21) showed unpinned: the
grammar's mask beside min_tokens, constrained rows whose logits change by more than their
grammar, the narrow/wide boundary, the worker's generator in the grammar-only draws, and
min_p's threshold."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from llmcommon.sampling import SamplingParams
from tests import grammar_rows
from tests.grammar_rows import constrained
from tests.model_support import one_torch_thread  # noqa: F401  (autouse fixture)
from worker_svc.grammar import RowMasks
from worker_svc.sampling import (
    NARROW_SHARE,
    draw_seed,
    fresh_generator,
    grammar_masked,
    sample_one,
    sample_tokens,
    shape_logits,
)

VOCAB = 64
EOS = 7
INF = math.inf

mask = partial(grammar_rows.mask, vocab=VOCAB)
random_logits = partial(grammar_rows.random_logits, vocab=VOCAB)


def test_the_grammar_mask_keeps_the_allowed_logits_and_drops_the_rest() -> None:
    logits = torch.tensor([1.0, -2.0, 3.0, 0.5])
    allowed = torch.tensor([True, False, True, False])
    assert grammar_masked(logits, allowed).tolist() == [1.0, -INF, 3.0, -INF]


def test_where_min_tokens_took_all_the_grammar_allows_the_grammars_tokens_stay_at_0() -> None:
    """Row 0: the grammar allows EOS and 2, min_tokens masked both; row 1: something is left."""
    logits = torch.tensor([[1.0, 2.0, -INF, 4.0, -INF], [1.0, 2.0, -INF, 4.0, -INF]])
    allowed = torch.tensor([[False, False, True, False, True], [True, False, True, False, False]])
    assert grammar_masked(logits, allowed).tolist() == [
        [-INF, -INF, 0.0, -INF, 0.0],
        [1.0, -INF, -INF, -INF, -INF],
    ]
    assert grammar_masked(logits[0], allowed[0]).tolist() == [-INF, -INF, 0.0, -INF, 0.0]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "drawn"])
def test_a_complete_answer_ends_with_eos_even_before_min_tokens(temperature: float) -> None:
    """The grammar allows only EOS, min_tokens masks EOS: the grammar wins, EOS is drawn."""
    s = constrained(temperature=temperature, min_tokens=5, stop_token_ids=[EOS], seed=3)
    logits = random_logits(2, 1)
    masks = RowMasks([1], mask({EOS})[None])
    plain = SamplingParams(temperature=0.0)
    for index in range(4):
        assert (
            sample_tokens(logits, [plain, s], [0, index], fresh_generator(), None, masks)[1] == EOS
        )


def test_min_tokens_with_a_grammar_leaves_the_allowed_tokens_but_eos() -> None:
    s = constrained(min_tokens=3, stop_token_ids=[EOS])
    allowed = {EOS, 10, 11, 12}
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 20.0  # far likelier than the rest
    masks = RowMasks([0], mask(allowed)[None])
    early = {
        sample_tokens(logits, [s], [1], torch.Generator().manual_seed(i), None, masks)[0]
        for i in range(200)
    }
    assert early == {10, 11, 12}
    late = sample_tokens(logits, [s], [3], torch.Generator().manual_seed(0), None, masks)
    assert late == [EOS]


@pytest.mark.parametrize(
    "extra",
    [{"logit_bias": {0: 50.0}}, {"repetition_penalty": 1.5}, {"presence_penalty": 0.5}],
    ids=["logit_bias", "repetition", "presence"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "drawn"])
def test_a_constrained_row_shaped_beyond_its_grammar_draws_only_what_it_allows(
    extra: dict, temperature: float
) -> None:
    """Its grammar's mask goes through shape_logits: the bias toward token 0, outside the
    grammar, never wins; greedy it is the argmax over the allowed tokens."""
    allowed = {20, 21, 22}
    logits = random_logits(3, 4)
    logits[1, 0] = 30.0
    rows = [SamplingParams(temperature=1.0), constrained(temperature=temperature, **extra)]
    rows.append(constrained(seed=1))
    masks = RowMasks([1, 2], torch.stack([mask(allowed), mask(range(40))]))
    histories = [[1, 2], [0, 20, 5], [3]]
    for i in range(50):
        gen = torch.Generator().manual_seed(i)
        token = sample_tokens(logits, rows, [0, 1, 0], gen, histories, masks)[1]
        assert token in allowed
    if temperature == 0.0:
        shaped = shape_logits(logits[1], rows[1], histories[1], 1)
        best = max(allowed, key=lambda t: float(shaped[t]))
        assert token == best


def test_rows_and_masks_of_different_counts_are_refused() -> None:
    logits = random_logits(2, 0)
    masks = RowMasks([1], torch.stack([mask({1, 2}), mask({3})]))
    rows = [SamplingParams(temperature=1.0), constrained(logit_bias={1: 1.0})]
    with pytest.raises(ValueError):
        sample_tokens(logits, rows, [0, 0], fresh_generator(), [[], []], masks)


@pytest.mark.parametrize(
    "allowed",
    [set(range(0, VOCAB, NARROW_SHARE)), set(range(3, 3 + VOCAB // NARROW_SHARE))],
    ids=["spread", "run"],
)
def test_a_row_allowing_exactly_a_narrow_share_is_drawn_over_its_ids(allowed: set[int]) -> None:
    """vocab / NARROW_SHARE allowed tokens: still narrow (the seeded draw over the ids alone)."""
    assert len(allowed) * NARROW_SHARE == VOCAB
    ids = sorted(allowed)
    logits = random_logits(1, 8)
    masks = RowMasks([0], mask(allowed)[None])
    for seed in range(40):
        s = constrained(seed=seed, temperature=3.0)
        gen = torch.Generator().manual_seed(draw_seed(seed, 2))
        expected = ids[sample_one(logits[0, ids], s, gen)]
        assert sample_tokens(logits, [s], [2], fresh_generator(), None, masks) == [expected]


def test_a_wide_row_is_drawn_as_a_row_masked_alone() -> None:
    """More than vocab / NARROW_SHARE allowed: the seeded draw over the whole masked row."""
    allowed = set(range(0, VOCAB, 2))
    logits = random_logits(1, 9)
    full = logits[0].masked_fill(~mask(allowed), -INF)
    masks = RowMasks([0], mask(allowed)[None])
    for seed in range(40):
        s = constrained(seed=seed, temperature=3.0)
        gen = torch.Generator().manual_seed(draw_seed(seed, 5))
        expected = sample_one(full, s, gen)
        assert sample_tokens(logits, [s], [5], fresh_generator(), None, masks) == [expected]


def test_an_unseeded_wide_row_is_the_workers_generators_draw_over_the_masked_row() -> None:
    """Its one draw: the worker's generator is used for nothing else first."""
    allowed = set(range(0, VOCAB, 2))
    logits = random_logits(1, 10)
    full = logits[0].masked_fill(~mask(allowed), -INF)
    masks = RowMasks([0], mask(allowed)[None])
    s = constrained(temperature=2.0)
    for seed in range(40):
        expected = sample_one(full, s, torch.Generator().manual_seed(seed))
        gen = torch.Generator().manual_seed(seed)
        assert sample_tokens(logits, [s], [0], gen, None, masks) == [expected]


def test_unseeded_constrained_rows_draw_from_the_workers_generator() -> None:
    """The same worker generator state gives the same tokens, whatever torch's global one."""
    logits = torch.zeros(6, VOCAB)  # flat: every allowed token as likely
    narrow, wide = mask({1, 5, 9, 30, 31}), mask(range(0, VOCAB, 2))
    masks = RowMasks(list(range(6)), torch.stack([narrow, wide] * 3))
    rows = [constrained(temperature=1.0 + i / 10) for i in range(6)]

    def draws(global_seed: int) -> list[list[int]]:
        torch.manual_seed(global_seed)
        gen = torch.Generator().manual_seed(123)
        return [sample_tokens(logits, rows, [0] * 6, gen, None, masks) for _ in range(8)]

    first = draws(1)
    assert draws(2) == first
    assert all(t in {1, 5, 9, 30, 31} for step in first for t in step[0::2])
    assert all(t % 2 == 0 for step in first for t in step[1::2])
    assert len({tuple(step) for step in first}) > 1


def test_min_p_keeps_a_token_exactly_at_its_threshold() -> None:
    """p == min_p * p_max stays (vLLM drops p < min_p * p_max): min_p e^-1, logits 0 and -1."""
    logits = torch.full((VOCAB,), -100.0)
    logits[4], logits[9] = 0.0, -1.0
    s = SamplingParams(temperature=1.0, min_p=math.exp(-1.0), seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = {sample_one(logits, s, gen) for _ in range(200)}
    assert tokens == {4, 9}
