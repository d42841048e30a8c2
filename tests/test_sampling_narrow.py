"""Constrained rows whose grammar allows few tokens (worker_svc/sampling.py, NARROW_SHARE) are
drawn over those ids alone: what the grammar allows only, the softmax over them, reproducible
under a seed whatever the batch; wider rows draw as a row masked alone."""

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
    sample_one,
    sample_tokens,
)

VOCAB = 1000

mask = partial(grammar_rows.mask, vocab=VOCAB)
random_logits = partial(grammar_rows.random_logits, vocab=VOCAB)


def test_a_seeded_narrow_row_draws_the_same_token_alone_and_in_any_batch() -> None:
    """Beside free rows, a wide constrained row and other narrow ones, in another position."""
    allowed = {3, 17, 400, 401, 999}
    s = constrained(seed=11, temperature=1.5)
    logits = random_logits(4, 0)
    alone = sample_tokens(
        logits[1:2], [s], [9], fresh_generator(), None, RowMasks([0], mask(allowed)[None])
    )
    batch_masks = RowMasks([0, 2, 3], torch.stack([mask(range(500)), mask(allowed), mask({5, 6})]))
    rows = [constrained(), SamplingParams(temperature=1.0), s, constrained(seed=2)]
    batch = torch.stack([logits[0], logits[2], logits[1], logits[3]])
    for _ in range(5):
        mixed = sample_tokens(batch, rows, [0, 3, 9, 4], fresh_generator(), None, batch_masks)
        assert mixed[2] == alone[0] and alone[0] in allowed


def test_a_seeded_narrow_row_is_its_generators_draw_over_the_allowed_ids() -> None:
    """Pinned: the draw is sample_one over the allowed ids' logits (ascending) with the
    generator of (seed, sample_index), so a replay gives the same tokens."""
    allowed = [2, 40, 41, 700, 901, 902]
    logits = random_logits(1, 3)
    for seed in range(30):
        s = constrained(seed=seed, temperature=2.0)
        gen = torch.Generator().manual_seed(draw_seed(seed, 7))
        expected = allowed[sample_one(logits[0, allowed], s, gen)]
        masks = RowMasks([0], mask(set(allowed))[None])
        assert sample_tokens(logits, [s], [7], fresh_generator(), None, masks) == [expected]


@pytest.mark.parametrize("seed", [None, 4], ids=["unseeded", "seeded"])
def test_a_narrow_row_follows_the_softmax_over_its_allowed_tokens(seed) -> None:
    """Allowed 10 and 20 with p 0.25 and 0.75 among them; the disallowed tokens are far likelier."""
    logits = torch.full((VOCAB,), 50.0)
    logits[10], logits[20] = 0.0, math.log(3.0)
    rows = [constrained(seed=None if seed is None else seed + i) for i in range(1500)]
    masks = RowMasks(list(range(1500)), mask({10, 20})[None].expand(1500, -1))
    tokens = sample_tokens(
        logits.expand(1500, -1), rows, [0] * 1500, fresh_generator(), None, masks
    )
    assert set(tokens) == {10, 20}
    assert tokens.count(20) / 1500 == pytest.approx(0.75, abs=0.04)


def test_top_k_top_p_and_greedy_apply_among_the_allowed_tokens() -> None:
    """Allowed 1..5 with logits 5, 4, 3, 2, 1: top-k 2 keeps 1 and 2; top-p 0.5 keeps 1 only
    (p 0.64); greedy takes 1, also where the disallowed tokens score higher."""
    logits = torch.full((VOCAB,), 9.0)
    logits[1:6] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    allowed = mask(range(1, 6))
    rows = [constrained(top_k=2), constrained(top_p=0.5), constrained(temperature=0.0)] * 100
    masks = RowMasks(list(range(300)), allowed[None].expand(300, -1))
    tokens = sample_tokens(logits.expand(300, -1), rows, [0] * 300, fresh_generator(), None, masks)
    assert set(tokens[0::3]) == {1, 2} and set(tokens[1::3]) == {1} and set(tokens[2::3]) == {1}


@pytest.mark.parametrize("temperature", [0.0, 1.0, 5.0])
def test_a_token_the_grammar_forces_is_taken_whatever_the_settings(temperature) -> None:
    rows = [constrained(temperature=temperature, seed=1), constrained(temperature=temperature)]
    masks = RowMasks([0, 1], torch.stack([mask({777}), mask({0})]))
    tokens = sample_tokens(random_logits(2, 5), rows, [0, 0], fresh_generator(), None, masks)
    assert tokens == [777, 0]


def test_a_wide_row_draws_as_the_row_masked_alone() -> None:
    """Over vocab / NARROW_SHARE allowed: the seeded draw over the whole masked row, as before."""
    allowed = mask(range(0, VOCAB, 2))
    assert int(allowed.sum()) * NARROW_SHARE > VOCAB
    logits = random_logits(1, 8)
    for seed in range(10):
        s = constrained(seed=seed)
        gen = torch.Generator().manual_seed(draw_seed(seed, 2))
        expected = sample_one(logits[0].masked_fill(~allowed, -math.inf), s, gen)
        got = sample_tokens(logits, [s], [2], fresh_generator(), None, RowMasks([0], allowed[None]))
        assert got == [expected] and expected % 2 == 0
