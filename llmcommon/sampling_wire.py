"""The one conversion of SamplingParams (llmcommon/sampling.py) to and from the wire's
common.SamplingParams, field by field by name: the gateway's gRPC requests, its Submit to the
scheduler and the scheduler's Added to a worker all carry that message. An unset optional field
(proto3 `optional`) is the dataclass's default."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields

from llmcommon.sampling import Grammar, SamplingParams
from llmcommon.v1 import common_pb2

__all__ = ["from_wire", "grammar_of", "params_of", "to_wire"]

_WIRE = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name


def params_of(s: common_pb2.SamplingParams) -> SamplingParams:
    """The settings as sent, not checked (the gateway checks them with the request)."""
    values: dict[str, object] = {}
    for f in fields(SamplingParams):
        if _WIRE[f.name].has_presence and not s.HasField(f.name):
            continue  # unset: the default
        value = getattr(s, f.name)
        if f.name == "grammar":
            value = grammar_of(value)
        elif hasattr(value, "items"):  # a map
            value = dict(value)
        elif hasattr(value, "extend"):  # a repeated field
            value = tuple(value)
        values[f.name] = value
    return SamplingParams(**values)  # type: ignore[arg-type]


def from_wire(s: common_pb2.SamplingParams) -> SamplingParams:
    """The settings checked and canonical; InvalidSampling naming the field out of range."""
    return params_of(s).checked()


def to_wire(params: SamplingParams) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams()
    for f in fields(params):
        value = getattr(params, f.name)
        if value is None:
            continue  # unset
        if isinstance(value, Grammar):
            s.grammar.CopyFrom(common_pb2.Grammar(kind=value.kind, spec=value.spec))  # type: ignore[arg-type]
        elif isinstance(value, Mapping):
            getattr(s, f.name).update(value)
        elif isinstance(value, tuple | list):
            getattr(s, f.name).extend(value)
        else:
            setattr(s, f.name, value)
    return s


def grammar_of(grammar: common_pb2.Grammar) -> Grammar:
    return Grammar(kind=int(grammar.kind), spec=grammar.spec)
