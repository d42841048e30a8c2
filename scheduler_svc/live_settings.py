"""Changes of the core's settings at run time: `key=value` texts read into a new CoreConfig.

Every CoreConfig field is a live setting (the core's settings are defined once there); a name
takes `_` or `-`. A change is all or nothing: a bad key or value names the field, and no field
changes."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import Any

from llmcommon.flags import field_name, given_twice, parse_field
from scheduler_svc.config import BatchMode, CoreConfig
from scheduler_svc.sequence import Sequence

NAMES = tuple(f.name for f in dataclasses.fields(CoreConfig))


class SettingError(ValueError):
    """A change names an unknown setting or gives a value the setting does not take."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


def shown(value: Any) -> str:
    """A value as `llmserve get` prints it and `llmserve set` takes it back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value.value if isinstance(value, enum.Enum) else value)


def current(config: CoreConfig) -> dict[str, str]:
    """Every live setting and its value, in field order."""
    return {name: shown(getattr(config, name)) for name in NAMES}


def changes_of(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """(name, text) pairs as a mapping; a name given twice (`token_budget` and `token-budget`
    are one name) is a SettingError: which value was meant is not the server's to guess."""
    pairs = list(pairs)
    twice = given_twice(key for key, _ in pairs)
    if twice is not None:
        sent = " and ".join(f"{k}={t}" for k, t in pairs if field_name(k) == field_name(twice))
        raise SettingError(twice, f"given twice ({sent}): give it once")
    return dict(pairs)


def parse_pairs(pairs: Iterable[str]) -> dict[str, str]:
    """`key=value` texts (as the CLI takes them) as a mapping; a key given twice is refused."""
    split = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SettingError(pair or "?", "expected key=value")
        split.append((key.strip(), value.strip()))
    return changes_of(split)


def apply(config: CoreConfig, changes: dict[str, str]) -> CoreConfig:
    """`config` with `changes` (name -> text) applied; SettingError naming the first bad field,
    and `config` itself is never touched (it is frozen; the caller keeps it on error)."""
    values: dict[str, Any] = {}
    for key, text in changes.items():
        name = field_name(key)
        if name not in NAMES:
            raise SettingError(key, f"not a live setting (one of {', '.join(NAMES)})")
        if name in values:  # a mapping may still name one setting in both spellings
            raise SettingError(key, "given twice: give it once")
        try:
            values[name] = parse_field(CoreConfig, name, text)
        except ValueError as err:
            raise SettingError(name, str(err)) from None
    try:  # the changes together: a rule across fields holds for them, not one at a time
        return dataclasses.replace(config, **values)
    except ValueError as err:
        together = str(err)
    for name, value in values.items():  # the first field whose own change is refused as
        try:  # the changes together are (its value, not the others' old ones, at fault) ...
            dataclasses.replace(config, **{name: value})
        except ValueError as err:
            if str(err) == together:
                raise SettingError(name, together) from None
    raise SettingError(", ".join(values), together)  # ... else a rule across them


def stranded(config: CoreConfig, seqs: Iterable[Sequence]) -> str | None:
    """Why `config` would leave one of `seqs` unable to ever run: a prompt beyond the token
    budget without chunked prefill, once it (re)starts from the beginning (waiting, or running
    and preempted later, before its first token); None if none."""
    if config.chunked_prefill or config.mode is BatchMode.STATIC:
        return None
    unsampled = (s for s in seqs if not s.output_ids and not s.is_finished)
    longest = max((len(s.prompt_ids) for s in unsampled), default=0)
    if longest <= config.token_budget:
        return None
    return (
        f"token_budget / chunked_prefill: a waiting prompt of {longest} tokens would exceed the "
        f"token budget of {config.token_budget} without chunked prefill and never run"
    )


def changed(old: CoreConfig, new: CoreConfig) -> dict[str, tuple[str, str]]:
    """name -> (old, new) of each setting that differs."""
    return {
        name: (shown(getattr(old, name)), shown(getattr(new, name)))
        for name in NAMES
        if getattr(old, name) != getattr(new, name)
    }
