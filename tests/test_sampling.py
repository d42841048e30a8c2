"""Sampling: determinism under a seed, and distribution properties of top-k / top-p / T."""

from __future__ import annotations

import math

import torch

from worker_svc.sampling import fresh_generator, sample_one, sample_tokens
from worker_svc.work import SamplingSettings

VOCAB = 1000


def random_logits(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3.0


def draws(logits: torch.Tensor, settings: SamplingSettings, n: int) -> list[int]:
    rng = fresh_generator()
    return [sample_one(logits, settings, rng) for _ in range(n)]


def test_same_seed_and_index_gives_same_token_regardless_of_batch() -> None:
    logits = random_logits(0)
    s = SamplingSettings(temperature=1.5, top_p=0.95, seed=1234)
    alone = sample_tokens(logits[None], [s], [17], fresh_generator())
    batch = torch.stack([random_logits(1), logits, random_logits(2)])
    other = SamplingSettings(temperature=1.0)
    mixed = sample_tokens(batch, [other, s, other], [0, 17, 5], fresh_generator())
    assert mixed[1] == alone[0]
    again = [sample_tokens(logits[None], [s], [17], fresh_generator())[0] for _ in range(20)]
    assert set(again) == {alone[0]}


def test_seeded_draws_vary_with_sample_index() -> None:
    logits = torch.zeros(VOCAB)  # uniform
    s = SamplingSettings(temperature=1.0, seed=99)
    tokens = [sample_tokens(logits[None], [s], [i], fresh_generator())[0] for i in range(50)]
    assert len(set(tokens)) > 30


def test_unseeded_draws_are_random() -> None:
    tokens = draws(torch.zeros(VOCAB), SamplingSettings(temperature=1.0), 50)
    assert len(set(tokens)) > 30


def test_greedy_and_top_k_1_are_argmax() -> None:
    logits = torch.stack([random_logits(i) for i in range(8)])
    argmax = logits.argmax(-1).tolist()
    rng = fresh_generator()
    assert sample_tokens(logits, [SamplingSettings()] * 8, list(range(8)), rng) == argmax
    top1 = [SamplingSettings(temperature=2.0, top_k=1, seed=i) for i in range(8)]
    assert sample_tokens(logits, top1, list(range(8)), rng) == argmax


def test_top_k_never_leaves_the_top_k() -> None:
    logits = random_logits(5)
    allowed = set(logits.topk(10).indices.tolist())
    seen = draws(logits, SamplingSettings(temperature=5.0, top_k=10), 500)
    assert set(seen) <= allowed
    assert len(set(seen)) >= 8  # hot temperature: most of the ten show up


def test_top_p_keeps_only_the_nucleus() -> None:
    # top token p=0.7: top_p=0.5 always yields it
    probs = torch.full((VOCAB,), 0.3 / (VOCAB - 1))
    probs[42] = 0.7
    logits = probs.log()
    assert set(draws(logits, SamplingSettings(temperature=1.0, top_p=0.5), 300)) == {42}
    # p = 0.5, 0.3, 0.2 spread: top_p=0.75 allows exactly the first two, in about 5:3
    probs = torch.zeros(VOCAB) + 1e-12
    probs[[7, 8, 9]] = torch.tensor([0.5, 0.3, 0.2])
    seen = draws(probs.log(), SamplingSettings(temperature=1.0, top_p=0.75), 800)
    assert set(seen) == {7, 8}
    share = seen.count(7) / len(seen)
    assert abs(share - 0.625) < 0.07


def test_higher_temperature_spreads_the_draws() -> None:
    logits = random_logits(9)
    distinct = [
        len(set(draws(logits, SamplingSettings(temperature=t, seed=None), 400)))
        for t in (0.3, 1.0, 3.0)
    ]
    assert distinct[0] < distinct[1] < distinct[2]


def test_sampling_follows_the_softmax() -> None:
    logits = torch.tensor([0.0, math.log(3.0)] + [-1e9] * 8)  # p = 0.25, 0.75
    seen = draws(logits, SamplingSettings(temperature=1.0), 1000)
    assert abs(seen.count(1) / 1000 - 0.75) < 0.06


def test_a_mixed_batch_gives_each_row_its_own_settings() -> None:
    """Greedy, seeded, top-k and plain rows in one call; the plain rows share one batched draw
    but keep their own temperatures."""
    logits = torch.tensor([0.0, math.log(3.0)] + [-1e9] * 8)  # p = 0.25, 0.75
    rows = [
        SamplingSettings(temperature=1.0),
        SamplingSettings(temperature=0.01),  # sharp: always the likelier token
        SamplingSettings(temperature=0.0),  # greedy
        SamplingSettings(temperature=1.0, seed=5),
        SamplingSettings(temperature=1.0, top_k=1),
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
