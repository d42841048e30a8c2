"""Structured output on the HTTP API: OpenAI's `response_format` (json_object, json_schema) and
vLLM's `structured_outputs` (json, regex, choice, grammar) and older `guided_*` fields, read into
one Grammar message that travels with the request's sampling settings to the worker, whose
llguidance matcher masks every step (worker_svc/grammar.py).

The gateway compiles each grammar once to refuse an invalid one (400 naming the field) before it
queues anything; compiled grammars are cached by text (`grammar_problem`)."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import grpc

try:
    import llguidance
except ImportError:  # e.g. the GPU machine's own packages (the GPU check): grammars refused
    llguidance = None

from llmcommon.v1 import common_pb2

Grammar = common_pb2.Grammar
GRAMMAR_CACHE_SIZE = 1024
# as worker_svc/grammar.py compiles them: no free whitespace, one space after ',' and ':'
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = '{"type": "object"}'
# vLLM's structured_outputs keys (and its older guided_* fields) -> the grammar kind
VLLM_KINDS = {
    "json": Grammar.JSON_SCHEMA,
    "regex": Grammar.REGEX,
    "choice": Grammar.CHOICE,
    "grammar": Grammar.LARK,
}


def grammar_text(kind: int, spec: str) -> str:
    """The llguidance grammar of (kind, spec), as the worker builds it; ValueError if malformed."""
    if kind == Grammar.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == Grammar.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == Grammar.CHOICE:
        return llguidance.grammar_from("choice", spec)
    if kind == Grammar.LARK:
        return llguidance.grammar_from("grammar", spec)
    raise ValueError("the grammar's kind is not set (JSON_SCHEMA, REGEX, CHOICE or LARK)")


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def grammar_problem(kind: int, spec: str) -> str | None:
    """Why the grammar cannot be compiled, or None: compiled once per (kind, spec)."""
    if llguidance is None:
        return "structured output needs the llguidance package, which is not installed here"
    if kind == Grammar.CHOICE:
        problem = _choice_problem(spec)
        if problem:
            return problem
    try:
        text = grammar_text(kind, spec)
    except (ValueError, TypeError) as err:
        return str(err) or type(err).__name__
    message = llguidance.LLMatcher.validate_grammar(text)
    return message or None


def _choice_problem(spec: str) -> str | None:
    try:
        choices = json.loads(spec)
    except ValueError:
        return "a choice grammar is a JSON list of strings"
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        return "a choice grammar is a non-empty list of strings"
    return None


def checked(grammar: common_pb2.Grammar, param: str) -> common_pb2.Grammar:
    """The grammar, or ApiError 400 naming `param` when it does not compile."""
    problem = grammar_problem(grammar.kind, grammar.spec)
    if problem:
        raise invalid(f"{param} is not a valid grammar: {problem}", param)
    return grammar


def invalid(message: str, param: str) -> Exception:
    """ApiError 400 naming `param` (imported here: http_errors imports starlette, which a
    gateway without its HTTP API never loads, and gateway.core imports this module)."""
    from gateway.http_errors import ApiError

    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param=param)


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise invalid(f"{param} is not JSON", param) from None
    if not isinstance(schema, dict):
        raise invalid(f"{param} must be a JSON Schema object", param)
    return json.dumps(schema)


def from_response_format(fmt: Any) -> common_pb2.Grammar | None:
    """OpenAI's response_format: text (none), json_object (any object), json_schema."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise invalid("response_format must be an object with a type", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar(kind=Grammar.JSON_SCHEMA, spec=ANY_OBJECT)
    if kind != "json_schema":
        message = f"response_format.type {kind!r} is not one of text, json_object, json_schema"
        raise invalid(message, "response_format.type")
    body = fmt.get("json_schema")
    if not isinstance(body, dict):
        raise invalid(
            "response_format.json_schema must be an object", "response_format.json_schema"
        )
    param = "response_format.json_schema.schema"
    if "schema" not in body:  # OpenAI allows it absent: any JSON object
        return Grammar(kind=Grammar.JSON_SCHEMA, spec=ANY_OBJECT)
    return checked(
        Grammar(kind=Grammar.JSON_SCHEMA, spec=_schema_text(body["schema"], param)), param
    )


def from_vllm(fields: dict[str, Any], prefix: str) -> common_pb2.Grammar | None:
    """vLLM's structured_outputs {json|regex|choice|grammar: ...} (prefix "structured_outputs.")
    or its guided_json / guided_regex / guided_choice / guided_grammar (prefix "guided_")."""
    asked = {key: value for key, value in fields.items() if value is not None}
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(prefix + key for key in asked)
        raise invalid(
            f"set one structured output at a time, not {names}", prefix + next(iter(asked))
        )
    key, value = next(iter(asked.items()))
    param = prefix + key
    if key == "json":
        spec = _schema_text(value, param)
    elif key == "choice":
        if not isinstance(value, list):
            raise invalid(f"{param} must be a list of strings", param)
        spec = json.dumps(value)
    elif isinstance(value, str):
        spec = value
    else:
        raise invalid(f"{param} must be a string", param)
    return checked(Grammar(kind=VLLM_KINDS[key], spec=spec), param)


def grpc_grammar_problem(grammar: common_pb2.Grammar) -> str | None:
    """The gRPC API's check of SamplingParams.grammar: the message names the field."""
    problem = grammar_problem(grammar.kind, grammar.spec)
    return None if problem is None else f"sampling.grammar is not a valid grammar: {problem}"
