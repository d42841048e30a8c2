"""A small client of Prometheus's HTTP API for tests: instant and range queries."""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request


def api(url: str, path: str, **params: str | float) -> list[dict]:
    query = urllib.parse.urlencode({k: str(v) for k, v in params.items()})
    with urllib.request.urlopen(f"{url}/api/v1/{path}?{query}", timeout=10) as reply:
        body = json.load(reply)
    assert body["status"] == "success", body
    return body["data"]["result"]


def query(url: str, expr: str, at: float) -> dict[str, float]:
    """An instant query at time `at`: {the labels as text: value}."""
    return {
        _labels(r["metric"]): float(r["value"][1]) for r in api(url, "query", query=expr, time=at)
    }


def value(url: str, expr: str, at: float) -> float:
    """The value of a query that yields one series (0 when it yields none)."""
    result = query(url, expr, at)
    assert len(result) <= 1, f"{expr} gave several series: {result}"
    return next(iter(result.values()), 0.0)


def series(url: str, expr: str, start: float, end: float, step: str = "1s") -> dict[str, list]:
    """A range query: {the labels as text: [finite values]} (NaN points left out)."""
    result = api(url, "query_range", query=expr, start=start, end=end, step=step)
    return {
        _labels(r["metric"]): [v for _, text in r["values"] if not math.isnan(v := float(text))]
        for r in result
    }


def _labels(metric: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(metric.items()))
