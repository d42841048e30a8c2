"""Command-line flags derived from a config dataclass: one flag per field, same defaults."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def add_flags(parser: argparse.ArgumentParser, cls: type, helps: dict[str, str] | None = None):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        help_text = (helps or {}).get(f.name, "") + f" (default: {_shown(f.default)})"
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        elif choices := _choices(kind):
            parser.add_argument(
                flag,
                choices=choices,
                default=getattr(f.default, "value", f.default),
                help=help_text,
            )
        else:
            parser.add_argument(flag, type=_scalar(kind), default=f.default, help=help_text)
    return parser


def from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    return cls(**(values | overrides))


def _choices(kind: Any) -> list[str]:
    """The values an Enum or a Literal of strings allows; [] for any other type."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return [m.value for m in kind]
    return list(typing.get_args(kind)) if typing.get_origin(kind) is typing.Literal else []


def _scalar(kind: Any):
    if kind in (int, float, str):
        return kind
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if args else str


def _shown(value: Any) -> str:
    return value.value if isinstance(value, enum.Enum) else repr(value)
