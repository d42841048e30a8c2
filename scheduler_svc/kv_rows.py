"""A worker's KV figures as a row of a reply, packed one way: the Status' WorkerKv rows
(scheduler_svc/output.py's WorkerKv) and the explanation's WorkerRoom rows (with their holders,
scheduler_svc/explain.py) copy each field of the figures into the message's field of the same
name."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

__all__ = ["add_row"]


def add_row(rows: Any, row: Any) -> Any:
    """A new message in the repeated message field `rows`, holding the dataclass `row`'s fields
    by name (a map updated, a list of dataclasses added row by row); a field the message does
    not have stays out. Returns the message, for what the caller adds beside."""
    out = rows.add()
    wire = out.DESCRIPTOR.fields_by_name
    for f in fields(row):
        if f.name not in wire:
            continue
        value = getattr(row, f.name)
        if isinstance(value, dict):
            getattr(out, f.name).update(value)
        elif isinstance(value, list):
            for item in value:
                if is_dataclass(item):
                    add_row(getattr(out, f.name), item)
                else:
                    getattr(out, f.name).append(item)
        else:
            setattr(out, f.name, value)
    return out
