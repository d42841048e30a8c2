"""Sampling: determinism under a seed, and distribution properties of top-k / top-p / T."""

from __future__ import annotations

import math

import pytest
import torch

from llmcommon.sampling import GREEDY, Grammar, SamplingParams
from tests.model_support import one_torch_thread  # noqa: F401  (autouse fixture)
from worker_svc.grammar import RowMasks
from worker_svc.sampling import (
    draw_seed,
    fresh_generator,
    sample_one,
    sample_tokens,
    shape_logits,
    token_logprobs,
)

VOCAB = 1000


def random_logits(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3.0


def draws(logits: torch.Tensor, settings: SamplingParams, n: int) -> list[int]:
    rng = fresh_generator()
    return [sample_one(logits, settings, rng) for _ in range(n)]


def test_same_seed_and_index_gives_same_token_regardless_of_batch() -> None:
    logits = random_logits(0)
    s = SamplingParams(temperature=1.5, top_p=0.95, seed=1234)
    alone = sample_tokens(logits[None], [s], [17], fresh_generator())
    batch = torch.stack([random_logits(1), logits, random_logits(2)])
    other = SamplingParams(temperature=1.0)
    mixed = sample_tokens(batch, [other, s, other], [0, 17, 5], fresh_generator())
    assert mixed[1] == alone[0]
    again = [sample_tokens(logits[None], [s], [17], fresh_generator())[0] for _ in range(20)]
    assert set(again) == {alone[0]}


def test_seeded_draws_vary_with_sample_index() -> None:
    logits = torch.zeros(VOCAB)  # uniform
    s = SamplingParams(temperature=1.0, seed=99)
    tokens = [sample_tokens(logits[None], [s], [i], fresh_generator())[0] for i in range(50)]
    assert len(set(tokens)) > 30


def test_unseeded_draws_are_random() -> None:
    tokens = draws(torch.zeros(VOCAB), SamplingParams(temperature=1.0), 50)
    assert len(set(tokens)) > 30


def test_greedy_and_top_k_1_are_argmax() -> None:
    logits = torch.stack([random_logits(i) for i in range(8)])
    argmax = logits.argmax(-1).tolist()
    rng = fresh_generator()
    assert sample_tokens(logits, [GREEDY] * 8, list(range(8)), rng) == argmax
    top1 = [SamplingParams(temperature=2.0, top_k=1, seed=i) for i in range(8)]
    assert sample_tokens(logits, top1, list(range(8)), rng) == argmax


def test_top_k_never_leaves_the_top_k() -> None:
    logits = random_logits(5)
    allowed = set(logits.topk(10).indices.tolist())
    seen = draws(logits, SamplingParams(temperature=5.0, top_k=10), 500)
    assert set(seen) <= allowed
    assert len(set(seen)) >= 8  # hot temperature: most of the ten show up


def test_top_p_keeps_only_the_nucleus() -> None:
    # top token p=0.7: top_p=0.5 always yields it
    probs = torch.full((VOCAB,), 0.3 / (VOCAB - 1))
    probs[42] = 0.7
    logits = probs.log()
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.5), 300)) == {42}
    # p = 0.5, 0.3, 0.2 spread: top_p=0.75 allows exactly the first two, in about 5:3
    probs = torch.zeros(VOCAB) + 1e-12
    probs[[7, 8, 9]] = torch.tensor([0.5, 0.3, 0.2])
    seen = draws(probs.log(), SamplingParams(temperature=1.0, top_p=0.75), 800)
    assert set(seen) == {7, 8}
    share = seen.count(7) / len(seen)
    assert abs(share - 0.625) < 0.07


def test_higher_temperature_spreads_the_draws() -> None:
    logits = random_logits(9)
    distinct = [
        len(set(draws(logits, SamplingParams(temperature=t, seed=None), 400)))
        for t in (0.3, 1.0, 3.0)
    ]
    assert distinct[0] < distinct[1] < distinct[2]


def test_sampling_follows_the_softmax() -> None:
    logits = torch.tensor([0.0, math.log(3.0)] + [-1e9] * 8)  # p = 0.25, 0.75
    seen = draws(logits, SamplingParams(temperature=1.0), 1000)
    assert abs(seen.count(1) / 1000 - 0.75) < 0.06


def test_a_mixed_batch_gives_each_row_its_own_settings() -> None:
    """Greedy, seeded, top-k and plain rows in one call; the plain rows share one batched draw
    but keep their own temperatures."""
    logits = torch.tensor([0.0, math.log(3.0)] + [-1e9] * 8)  # p = 0.25, 0.75
    rows = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.01),  # sharp: always the likelier token
        SamplingParams(temperature=0.0),  # greedy
        SamplingParams(temperature=1.0, seed=5),
        SamplingParams(temperature=1.0, top_k=1),
    ]
    rng = torch.Generator().manual_seed(0)
    seen: list[list[int]] = [[] for _ in rows]
    for _ in range(600):
        tokens = sample_tokens(logits.expand(len(rows), -1), rows, [0] * len(rows), rng)
        for row, token in enumerate(tokens):
            seen[row].append(token)
    assert abs(seen[0].count(1) / 600 - 0.75) < 0.07
    assert set(seen[1]) == {1} and set(seen[2]) == {1} and set(seen[4]) == {1}
    assert len(set(seen[3])) == 1  # same seed and index: the same draw every time


# p = 0.25, 0.75 at T = 1; at T = 0.5 the odds square (1:9), at T = 2 they take the root
TWO_TOKENS = torch.tensor([0.0, math.log(3.0)] + [-1e9] * 8)
SHARE_OF_1 = {0.5: 0.9, 1.0: 0.75, 2.0: 3**0.5 / (1 + 3**0.5)}


def share_of_1(rows: list[SamplingParams]) -> float:
    rng = torch.Generator().manual_seed(1)
    tokens = sample_tokens(TWO_TOKENS.expand(len(rows), -1), rows, [0] * len(rows), rng)
    return tokens.count(1) / len(tokens)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_the_batched_draw_divides_the_logits_by_the_temperature_once(temperature) -> None:
    """Unseeded temperature-only rows share one draw: T = 0.5 gives 0.9 (applied twice, 0.99;
    multiplied, 0.63), T = 2 gives 0.63 (applied twice, 0.57)."""
    rows = [SamplingParams(temperature=temperature)] * 2000
    assert share_of_1(rows) == pytest.approx(SHARE_OF_1[temperature], abs=0.02)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
@pytest.mark.parametrize("path", ["seeded", "top_k", "top_p"])
def test_each_row_drawn_alone_divides_the_logits_by_the_temperature_once(path, temperature) -> None:
    """Seeded rows and rows with top-k or top-p draw one by one (top-k 5 and top-p 0.999 keep
    both tokens): the same shares as the batched draw."""
    extra = {"seeded": {}, "top_k": {"top_k": 5}, "top_p": {"top_p": 0.999}}[path]
    rows = [
        SamplingParams(temperature=temperature, seed=i if path == "seeded" else None, **extra)
        for i in range(1000)
    ]
    assert share_of_1(rows) == pytest.approx(SHARE_OF_1[temperature], abs=0.04)


def test_a_seeded_draw_is_pinned_across_processes_and_versions() -> None:
    """A client that replays a request with its seed gets the same tokens after a restart or
    an upgrade: the generator seed is a fixed function of (seed, sample index)."""
    assert draw_seed(1234, 17) == 2128133252485127613
    assert draw_seed(0, 0) == 7120306904099482837
    assert all(0 <= draw_seed(s, i) < 2**63 for s in (0, 2**64 - 1) for i in (0, 10**6))


def test_different_seeds_give_different_draws() -> None:
    logits = torch.zeros(VOCAB)[None]  # uniform
    tokens = {
        seed: [sample_tokens(logits, [SamplingParams(seed=seed)], [i], fresh_generator())[0]
               for i in range(5)]
        for seed in (1, 2)
    }  # fmt: skip
    assert tokens[1] != tokens[2]


def test_unseeded_draws_come_from_the_generator_given() -> None:
    """The worker's own generator: the same state gives the same draws, on both paths."""
    rows = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_k=500),
        SamplingParams(temperature=1.0),
    ]
    logits = torch.zeros(len(rows), VOCAB)
    runs = [
        [sample_tokens(logits, rows, [0] * 3, torch.Generator().manual_seed(s)) for _ in range(6)]
        for s in (5, 5, 6)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_sample_one_of_a_greedy_row_is_the_argmax() -> None:
    logits = random_logits(4)
    assert sample_one(logits, GREEDY, fresh_generator()) == int(logits.argmax())


@pytest.mark.parametrize(
    "row",
    [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.5)],
    ids=["top_k", "top_p"],
)
def test_unseeded_rows_with_top_k_or_top_p_keep_them_in_a_mixed_batch(row) -> None:
    """Only temperature-only rows share the batched draw; a row with top-k or top-p must not."""
    # p = 0.23, 0.21, 0.19, 0.17, 0.16, then 0.01 each: top-k 3 and top-p 0.5 keep three
    logits = torch.tensor([3.0, 2.9, 2.8, 2.7, 2.6, 0.0, 0.0, 0.0])
    rows = [SamplingParams(temperature=1.0), row] * 200
    tokens = sample_tokens(logits.expand(len(rows), -1), rows, [0] * len(rows), fresh_generator())
    assert set(tokens[1::2]) == {0, 1, 2}
    assert len(set(tokens[0::2])) > 3  # the plain rows draw from all eight


def test_top_p_keeps_the_smallest_prefix_that_reaches_it_and_no_more() -> None:
    """Two tokens of 0.5 each and top_p 0.5: the first one alone reaches 0.5."""
    logits = torch.tensor([0.0, 0.0] + [-1e9] * 8)
    seen = draws(logits, SamplingParams(temperature=1.0, top_p=0.5), 200)
    assert len(set(seen)) == 1 and seen[0] in (0, 1)


def test_top_p_zero_means_off() -> None:
    rows = [SamplingParams(temperature=1.0, top_p=0.0, seed=i) for i in range(1000)]
    assert share_of_1(rows) == pytest.approx(SHARE_OF_1[1.0], abs=0.04)


@pytest.mark.parametrize("seed", [None, 3])
def test_a_temperature_near_the_smallest_float_draws_the_top_token(seed) -> None:
    """Logits over a temperature of 1e-38 overflow to -inf, never to nan: the top token."""
    logits = torch.tensor([[10.0, 0.0, 9.0, -5.0]])
    rows = [SamplingParams(temperature=1e-38, seed=seed)]
    assert sample_tokens(logits, rows, [0], fresh_generator()) == [0]


def test_the_repetition_penalty_shrinks_seen_logits_toward_zero_from_either_side() -> None:
    """Seen tokens: a positive logit is divided by the penalty (0.5 -> 0.25, below 1 as well),
    a negative one multiplied (-0.5 -> -1); unseen tokens keep theirs."""
    logits = torch.tensor([0.5, -0.5, 0.5, 3.0])
    s = SamplingParams(temperature=1.0, repetition_penalty=2.0)
    shaped = shape_logits(logits, s, history=[0, 1, 3], sample_index=0)
    assert shaped.tolist() == [0.25, -1.0, 0.5, 1.5]


def test_frequency_and_presence_penalties_count_generated_tokens_only() -> None:
    """History: prompt [5, 6, 6], then generated [6, 7, 7]: 6 once, 7 twice."""
    s = SamplingParams(temperature=1.0, frequency_penalty=1.0, presence_penalty=0.5)
    logits = torch.zeros(8)
    assert shape_logits(logits, s, history=[5, 6, 6], sample_index=0).tolist() == [0.0] * 8
    shaped = shape_logits(logits, s, history=[5, 6, 6, 6, 7, 7], sample_index=3)
    assert shaped.tolist() == [0.0] * 6 + [-1.5, -2.5]


def test_logprobs_are_the_raw_log_softmax_with_the_top_alternatives_asked() -> None:
    logits = torch.tensor([0.0, math.log(3.0), -1e9])  # p = 0.25, 0.75, 0
    alone = token_logprobs(logits, token=0, top=0)
    assert alone.logprob == pytest.approx(math.log(0.25)) and alone.top_ids == ()
    one = token_logprobs(logits, token=0, top=1)
    assert one.top_ids == (1,) and one.top_logprobs == pytest.approx((math.log(0.75),))
    assert token_logprobs(logits, token=1, top=5).top_ids == (1, 0, 2)  # at most the vocabulary


@pytest.mark.parametrize(
    "row",
    [
        SamplingParams(temperature=1.0, min_p=0.5),
        SamplingParams(temperature=1.0, logit_bias={0: -100.0}),
    ],
    ids=["min_p", "logit_bias"],
)
def test_unseeded_rows_with_min_p_or_shaped_logits_keep_them_in_a_mixed_batch(row) -> None:
    """p = 0.6, 0.2, 0.2: min_p 0.5 keeps token 0 only; a bias of -100 leaves tokens 1 and 2."""
    logits = torch.tensor([math.log(0.6), math.log(0.2), math.log(0.2)])
    rows = [SamplingParams(temperature=1.0), row] * 300
    tokens = sample_tokens(logits.expand(len(rows), -1), rows, [0] * len(rows), fresh_generator())
    assert set(tokens[1::2]) == ({0} if row.min_p else {1, 2})
    assert set(tokens[0::2]) == {0, 1, 2}


@pytest.mark.parametrize("top_k", [VOCAB, VOCAB + 1])
def test_top_k_of_the_whole_vocabulary_draws_what_top_k_off_draws(top_k) -> None:
    """A seeded request gives the same tokens with top-k at or above the vocabulary as without."""
    logits = random_logits(7)
    for seed in range(20):
        on, off = (
            SamplingParams(temperature=1.0, top_k=top_k, seed=seed),
            SamplingParams(temperature=1.0, seed=seed),
        )
        assert sample_one(logits, on, torch.Generator().manual_seed(draw_seed(seed, 0))) == (
            sample_one(logits, off, torch.Generator().manual_seed(draw_seed(seed, 0)))
        )


class AllowOnly:
    """Stands for a request's GrammarState (worker_svc/grammar.py): these tokens next."""

    def __init__(self, tokens: set[int], vocab: int = VOCAB) -> None:
        self.mask = torch.zeros(vocab, dtype=torch.bool)
        self.mask[list(tokens)] = True

    def allowed(self) -> torch.Tensor:
        return self.mask


def test_a_grammar_masks_its_own_row_from_the_state_beside_the_params() -> None:
    logits = torch.arange(float(VOCAB))[None].expand(3, -1)  # argmax: the last token
    s = SamplingParams(temperature=0.0, grammar=Grammar(kind=2, spec="x"))
    masks = RowMasks([0, 2], torch.stack([AllowOnly({3, 5}).mask, AllowOnly({9}).mask]))
    tokens = sample_tokens(logits, [s, s, s], [0, 0, 0], fresh_generator(), None, masks)
    assert tokens == [5, VOCAB - 1, 9]
    shaped = shape_logits(logits[0], s, [], 0, AllowOnly({3}).mask)
    assert torch.isfinite(shaped).nonzero().flatten().tolist() == [3]
    assert torch.isfinite(shape_logits(logits[0], s, [], 0)).all()  # no state: no mask
