"""Speculative decoding's verification: which of a draft's tokens the target model keeps.

A draft row's logits are scored at every position in one execution: its last sampled token,
then its draft d1..dk. Position by position ("depth"), each row samples its next token exactly
as an ordinary decode would sample it there (sampling.py: the same settings, its sample index
plus the depth, the history with the draft tokens before it, the grammar advanced through
them, a seeded row's own generator for that index). Where the token sampled equals the draft's
next token, the row goes on to the next depth; else it stops, and what it sampled is its last
token. So a row emits from 1 (its first draft token rejected) to k + 1 tokens (all accepted,
and the one after).

This is the standard rule for a deterministic draft (n-gram and suffix lookups propose one
token, no distribution): accept d with the target's probability p(d), else draw from p with d
removed, renormalised. Drawing t ~ p and keeping d where t == d does both at once: P(keep d) =
p(d), and given t != d, t is distributed as p without d. The output is the target's
distribution, token for token; and as each depth's draw is the one an ordinary decode makes at
that index, a seeded request's output is the same with or without speculation, whatever the
draft. Greedy keeps the longest prefix equal to the argmax, plus the argmax after it. A grammar
rejects a draft token it forbids (the sampled token is always allowed). A stop token ends the
row where it is sampled.
"""

from __future__ import annotations

import torch

from worker_svc.grammar import row_masks
from worker_svc.sampling import sample_tokens, token_logprobs
from worker_svc.work import TokenLogprobs, WorkItem

Emitted = list[tuple[int, TokenLogprobs | None]]


def emit(
    logits: torch.Tensor,  # [rows, vocab] fp32 on the host: each item's rows, in item order
    items: list[WorkItem],  # the sampled items: one row each, 1 + drafted for a draft
    first_rows: list[int],  # each item's first row in `logits`
    rng: torch.Generator,
) -> list[Emitted]:
    """Each item's emitted tokens (and logprobs, where asked), depth by depth."""
    out: list[Emitted] = [[] for _ in items]
    alive, depth = list(range(len(items))), 0
    vocab = logits.shape[-1]
    while alive:
        rows = [first_rows[j] + depth for j in alive]
        batch = [items[j] for j in alive]
        tokens = sample_tokens(
            logits[rows],
            [item.sampling for item in batch],
            [item.sample_index + depth for item in batch],
            rng,
            [item.history + item.token_ids[: item.fed + depth] for item in batch],
            row_masks([item.grammar for item in batch], vocab),
        )
        going = []
        for j, item, row, token in zip(alive, batch, rows, tokens, strict=True):
            top = item.sampling.logprobs
            out[j].append((token, None if top is None else token_logprobs(logits[row], token, top)))
            if depth < item.drafted and kept(item, depth, token):
                if item.grammar is not None:  # the next depth's mask follows the kept token
                    item.grammar.advance(token)
                going.append(j)
        alive, depth = going, depth + 1
    return out


def kept(item: WorkItem, depth: int, token: int) -> bool:
    """The token sampled at `depth` is the draft's next one, and does not end the request."""
    return token == item.token_ids[item.fed + depth] and token not in item.sampling.stop_token_ids


def greedy_emit(argmax: list[int], items: list[WorkItem], first_rows: list[int]) -> list[Emitted]:
    """emit() for plain greedy rows (no logprobs, nothing shaping the logits), from each
    row's argmax alone (on a device: one copy to the host)."""
    out: list[Emitted] = []
    for item, first in zip(items, first_rows, strict=True):
        tokens = [(argmax[first], None)]
        depth = 0
        while depth < item.drafted and kept(item, depth, tokens[-1][0]):
            depth += 1
            tokens.append((argmax[first + depth], None))
        out.append(tokens)
    return out
