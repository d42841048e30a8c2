"""What the sampler's grammar tests build rows from (test_sampling_narrow, test_sampling_pins):
a grammar, a row's mask over a vocabulary, seeded logits, constrained settings."""

from __future__ import annotations

import torch

from llmcommon.sampling import Grammar, SamplingParams

GRAMMAR = Grammar(kind=2, spec="x")  # the sampler reads only that there is one


def mask(tokens: set[int] | range, vocab: int) -> torch.Tensor:
    """[vocab] bool: the tokens a grammar allows."""
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[list(tokens)] = True
    return allowed


def random_logits(rows: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


def constrained(**kw) -> SamplingParams:
    """Under GRAMMAR, temperature 1 unless told."""
    return SamplingParams(grammar=GRAMMAR, **({"temperature": 1.0} | kw))
