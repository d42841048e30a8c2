"""A step's grammar masks as one bitmask (worker_svc/grammar.py, allowed_rows): each row is what
its matcher alone allows (llguidance's own bitmask, unpacked bit by bit), for rows at different
points of different grammars, one row or several."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gateway.tokenizer import load_default_tokenizer
from worker_svc.grammar import (
    GrammarCache,
    GrammarState,
    TokenTable,
    allowed_rows,
    model_tokenizer,
    spec_of,
)

VOCAB, EOS = 49152, 2
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammars() -> GrammarCache:
    cache = GrammarCache(TokenTable(lambda: model_tokenizer("tiny", VOCAB, (EOS,))))
    cache.table.get()
    return cache


def alone(state: GrammarState) -> torch.Tensor:
    packed = np.frombuffer(state.matcher.compute_bitmask(), dtype=np.uint8)
    return torch.from_numpy(np.unpackbits(packed, bitorder="little")[:VOCAB].astype(np.bool_))


def state_after(grammars: GrammarCache, grammar, text: str) -> GrammarState:
    state = GrammarState(grammars.matcher(grammar), VOCAB)
    tokens = load_default_tokenizer().encode(text, add_special_tokens=False)
    state.sync(tokens, len(tokens))
    return state


def test_one_bitmask_holds_each_rows_own_mask(grammars) -> None:
    person, choice = spec_of("json_schema", PERSON), spec_of("choice", '["red", "green"]')
    states = [
        state_after(grammars, person, ""),
        state_after(grammars, person, '{"name": "Al'),
        state_after(grammars, person, '{"name": "Ann", "age": 3'),
        state_after(grammars, choice, "gr"),
        state_after(grammars, choice, "green"),  # complete: EOS only
    ]
    rows = allowed_rows(states, VOCAB)
    assert rows.shape == (5, VOCAB) and rows.dtype == torch.bool
    for row, state in zip(rows, states, strict=True):
        assert torch.equal(row, alone(state)) and row.any()
    assert rows[4].nonzero().flatten().tolist() == [EOS]
    assert torch.equal(allowed_rows(states[1:2], VOCAB)[0], rows[1])
    assert torch.equal(states[2].allowed(), rows[2])
    assert allowed_rows([], VOCAB).shape == (0, VOCAB)


def test_rows_masked_in_one_op_draw_only_what_their_grammar_allows() -> None:
    """Grammar-only rows (greedy, seeded, unseeded in the batched draw) and a row whose grammar
    comes with a penalty (masked on its own) beside a free row: each draws from its own mask."""
    from llmcommon.sampling import Grammar, SamplingParams
    from worker_svc.grammar import RowMasks
    from worker_svc.sampling import fresh_generator, sample_tokens

    grammar = Grammar(kind=2, spec="x")
    rows = [
        SamplingParams(temperature=0.0, grammar=grammar),
        SamplingParams(temperature=1.0, grammar=grammar),
        SamplingParams(temperature=1.0, seed=7, grammar=grammar),
        SamplingParams(temperature=1.0, presence_penalty=1.0, grammar=grammar),
        SamplingParams(temperature=1.0),
    ]
    sets = [{3, 5}, {7, 8}, {11}, {12, 13}]
    allowed = torch.zeros(4, 16, dtype=torch.bool)
    for k, tokens in enumerate(sets):
        allowed[k, list(tokens)] = True
    logits = torch.arange(16.0)[None].expand(5, -1)
    masks = RowMasks([0, 1, 2, 3], allowed)
    for _ in range(20):
        tokens = sample_tokens(logits, rows, [0] * 5, fresh_generator(), [[1]] * 5, masks)
        assert tokens[0] == 5 and all(t in s for t, s in zip(tokens[1:4], sets[1:], strict=True))
