"""The Grafana dashboard's panels and their queries, with template variables filled in."""

from __future__ import annotations

import json
from collections.abc import Iterator

from llmserve.prometheus import DASHBOARD

VARIABLES = {"$__rate_interval": "5s", "$worker": ".*"}  # also as ${name}


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(items: list[dict] | None = None) -> Iterator[dict]:
    """Every panel, those inside rows included."""
    for panel in load()["panels"] if items is None else items:
        yield panel
        yield from panels(panel.get("panels", []))


def queries(variables: dict[str, str] = VARIABLES) -> list[tuple[str, str]]:
    """(panel title, query) for every target of every panel."""
    found = []
    for panel in panels():
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in variables.items():
                expr = expr.replace("${" + name[1:] + "}", value).replace(name, value)
            found.append((panel["title"], expr))
    return found
