"""docs/observability.md's metrics tables and what the services export say the same thing: every
family has a row with its name, type and labels, the row's meaning starts with the family's help
text (`# HELP` on /metrics) word for word, and no row names a family that is not exported."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_metrics import all_families

DOCS = Path(__file__).resolve().parent.parent / "docs" / "observability.md"
# | `llmserve_name_total{label,label}` | type | meaning |
ROW = re.compile(r"^\| `(llmserve_\w+)(?:\{([\w,]+)\})?` \| (\w+) \| (.+) \|$")


def documented() -> dict[str, tuple[str, frozenset[str], str]]:
    """name (as it appears in samples: counters with `_total`) -> (type, labels, meaning)."""
    rows: dict[str, tuple[str, frozenset[str], str]] = {}
    for line in DOCS.read_text().splitlines():
        if match := ROW.match(line):
            name, labels, kind, meaning = match.groups()
            assert name not in rows, f"{name} has two rows"
            rows[name] = (kind, frozenset(labels.split(",") if labels else ()), meaning)
    return rows


def exported() -> dict[str, tuple[str, frozenset[str], str]]:
    return {
        family.name + ("_total" if family.type == "counter" else ""): (
            family.type,
            frozenset(k for s in family.samples for k in s.labels) - {"le"},
            family.documentation,
        )
        for family in all_families()
    }


def test_every_exported_family_has_its_row_with_its_help_text() -> None:
    rows = documented()
    for name, (kind, labels, help_text) in exported().items():
        row = f"| `{name}{{{','.join(sorted(labels))}}}` | {kind} | {help_text} ... |"
        assert name in rows, f"docs/observability.md has no row for {name}; add: {row}"
        doc_kind, doc_labels, meaning = rows[name]
        assert (doc_kind, doc_labels) == (kind, labels), f"{name}: the docs say {rows[name][:2]}"
        assert meaning.startswith(help_text), (
            f"{name}: the docs' meaning must start with the help text {help_text!r}, "
            f"not {meaning!r}"
        )


def test_every_documented_metric_is_exported() -> None:
    assert documented().keys() <= exported().keys()
