"""Without llguidance (the GPU machine's own packages have none) the services still run, and a
grammar is refused with a message that names the missing package, never served unconstrained."""

import pytest

from gateway import structured
from llmcommon.v1 import common_pb2
from worker_svc import grammar

SCHEMA = common_pb2.Grammar(kind=common_pb2.Grammar.JSON_SCHEMA, spec='{"type": "object"}')


def test_the_gateway_refuses_a_grammar_without_the_engine(monkeypatch) -> None:
    structured.grammar_problem.cache_clear()
    assert structured.grammar_problem(SCHEMA.kind, SCHEMA.spec) is None  # with it: valid
    monkeypatch.setattr(structured, "llguidance", None)
    structured.grammar_problem.cache_clear()  # compiled results are cached by text
    try:
        assert "llguidance" in structured.grammar_problem(SCHEMA.kind, SCHEMA.spec)
        assert "llguidance" in structured.grpc_grammar_problem(SCHEMA)
    finally:
        structured.grammar_problem.cache_clear()


def test_the_worker_fails_a_constrained_request_without_the_engine(monkeypatch) -> None:
    assert grammar.grammar_text(SCHEMA)  # with it: a grammar
    monkeypatch.setattr(grammar, "llguidance", None)
    with pytest.raises(ValueError, match="llguidance"):
        grammar.grammar_text(SCHEMA)
    with pytest.raises(RuntimeError, match="llguidance"):
        grammar.model_tokenizer("tiny", 49152, [2])
