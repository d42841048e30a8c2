"""The Grafana dashboard without Grafana: the panels the operators need are there, every query
names metrics that the services export, and every panel uses the datasource variable."""

from __future__ import annotations

import re

from tests import dashboard
from tests.test_metrics import all_families

REQUIRED = [
    "Admission stalls by reason",
    "KV positions on $worker: written, reserved but unwritten, free",
    "Waiting requests",
    "Waiting tokens",
    "Oldest wait",
    "Running requests and batch size",
    "Tokens per execution vs budget",
    "Time to first token",
    "Inter-token latency",
    "End-to-end latency",
    "Token throughput",
    "Preemptions",
    "Errors by code",
    "Prefix cache hit rate",
    "Prefix cache blocks: cached, evictable",
    "Prefix cache evictions",
]


def test_the_dashboard_has_the_panels_operators_need() -> None:
    titles = [p["title"] for p in dashboard.panels()]
    assert [t for t in REQUIRED if t not in titles] == []
    ids = [p["id"] for p in dashboard.panels()]
    assert len(ids) == len(set(ids))


def test_every_query_names_metrics_the_services_export() -> None:
    exported = {s.name for family in all_families() for s in family.samples} | {"up"}
    unknown = [
        (title, name)
        for title, expr in dashboard.queries()
        for name in re.findall(r"\b(llmserve_[a-z0-9_]+|up)\b", expr)
        if name not in exported
    ]
    assert unknown == []


def test_kv_panel_stacks_written_reserved_free_per_worker_against_capacity() -> None:
    kv = next(p for p in dashboard.panels() if p["title"].startswith("KV positions"))
    assert kv["repeat"] == "worker"
    assert kv["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    states = [re.search(r'state="(\w+)"', t["expr"]) for t in kv["targets"]]
    assert [s.group(1) for s in states if s] == ["written", "reserved_unwritten", "free"]
    unstacked = kv["fieldConfig"]["overrides"][0]["matcher"]["options"]
    assert "capacity" in next(t["expr"] for t in kv["targets"] if t["refId"] == unstacked)


def test_every_panel_queries_the_datasource_variable() -> None:
    variables = {v["name"]: v for v in dashboard.load()["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["worker"]["includeAll"] and variables["worker"]["allValue"] == ".*"
    for panel in dashboard.panels():
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])


def test_prefix_cache_hit_rate_is_hit_tokens_over_prompt_tokens_per_worker() -> None:
    hit = next(p for p in dashboard.panels() if p["title"] == "Prefix cache hit rate")
    [expr] = [t["expr"] for t in hit["targets"]]
    over, under = expr.split(" / ")
    assert "rate(llmserve_scheduler_prefix_hit_tokens_total" in over and "by (worker)" in over
    assert "rate(llmserve_scheduler_prefix_prompt_tokens_total" in under
    assert "by (worker)" in under and hit["fieldConfig"]["defaults"]["unit"] == "percentunit"
