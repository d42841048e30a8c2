"""Command-line flags derived from a settings dataclass: one flag per field, same defaults, the
help text from the field's own `setting(default, help)`, and the same setting from an
environment variable (for containers): flag > environment > default."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
import typing
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def field_name(name: str) -> str:
    """A setting's field, however a flag or a live change spells it (`token-budget`)."""
    return name.replace("-", "_")


def given_twice(names: typing.Iterable[str]) -> str | None:
    """The first name given again (`token_budget` and `token-budget` are one name), or None:
    a live change names each setting once (the scheduler's and the gateway's `set`)."""
    seen: set[str] = set()
    for name in names:
        key = field_name(name)
        if key in seen:
            return name
        seen.add(key)
    return None


def setting(default: Any, help: str = "") -> Any:
    """A settings field with its documentation: the flag's help text (and `llmserve up`'s)."""
    return dataclasses.field(default=default, metadata={"help": help})


def help_of(cls: type, name: str) -> str:
    return next(f.metadata.get("help", "") for f in dataclasses.fields(cls) if f.name == name)


def env_name(prefix: str, name: str) -> str:
    return prefix + name.upper()


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    helps: dict[str, str] | None = None,
    env_prefix: str | Callable[[str], str] = "",
):
    """One flag per field of `cls`; `helps` adds to or replaces the fields' own help; with
    `env_prefix`, $PREFIX_FIELD_NAME sets a field's default (a flag still wins). A function
    gives each field's prefix ("" = none)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        default = f.default
        prefix = env_prefix(f.name) if callable(env_prefix) else env_prefix
        env = env_name(prefix, f.name) if prefix else ""
        if env and env in os.environ:
            try:
                default = _parse(kind, os.environ[env])
            except ValueError as err:
                parser.error(f"${env}: {err}")
        text = (helps or {}).get(f.name) or f.metadata.get("help", "")
        shown = f"default: {_shown(default)}" + (f"; env {env}" if env else "")
        help_text = f"{text} ({shown})".lstrip()
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        elif choices := _choices(kind):
            parser.add_argument(
                flag, choices=choices, default=getattr(default, "value", default), help=help_text
            )
        else:
            parser.add_argument(flag, type=_scalar(kind), default=default, help=help_text)
    return parser


def from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    return cls(**(values | overrides))


def to_flags(settings: Any, cls: type | None = None) -> list[str]:
    """The flags that give `settings`' values to a process whose settings class is `cls` (by
    default the class of `settings`): every field of `cls`, read from `settings` by name."""
    out: list[str] = []
    for f in dataclasses.fields(cls or type(settings)):
        value = getattr(settings, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(getattr(value, "value", value))]
    return out


def parse_field(cls: type, name: str, text: str) -> Any:
    """Field `name` of `cls` from text, as a flag or an environment variable reads it."""
    return _parse(typing.get_type_hints(cls)[name], text)


def _parse(kind: Any, text: str) -> Any:
    """A field's value from an environment variable's text."""
    if kind is bool:
        if text.strip().lower() in TRUE | FALSE:
            return text.strip().lower() in TRUE
        raise ValueError(f"{text!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")
    if choices := _choices(kind):
        if text not in choices:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return text
    try:
        return _scalar(kind)(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a valid {_scalar(kind).__name__}") from None


def _choices(kind: Any) -> list[str]:
    """The values an Enum or a Literal of strings allows; [] for any other type."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return [m.value for m in kind]
    return list(typing.get_args(kind)) if typing.get_origin(kind) is typing.Literal else []


def _scalar(kind: Any):
    if kind is float:
        return number
    if kind in (int, str):
        return kind
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if args else str


def number(text: str) -> float:
    """A float setting: NaN is no value any setting can run with (it compares false with every
    bound, so a `>= 0` check lets it through): refused here for every one."""
    value = float(text)
    if math.isnan(value):
        raise ValueError(f"{text!r} is not a number")
    return value


number.__name__ = "float"  # argparse names the type in its message: "invalid float value"


def _shown(value: Any) -> str:
    return value.value if isinstance(value, enum.Enum) else repr(value)
