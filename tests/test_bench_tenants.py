"""Tenants in `bench sim`: the spec parser takes what it should and names what is wrong; each
simulated request carries its tenant's Tenancy into the core; the report per tenant and per class
adds up to the run's totals; identical tenants under fair get equal service (Jain's index 1); fair
share gives a tenant beside another's burst a lower TTFT than FCFS does; two backlogged tenants
stay within VTC's bound and weights 2:1 give 2:1 service."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from llmcommon.tenancy import parse_slo_classes
from llmserve.bench.cost_model import CostModel
from llmserve.bench.fairness import PairGap, jain, vtc_bound
from llmserve.bench.policy import Policy, parse_policies
from llmserve.bench.simulate import SimSettings
from llmserve.bench.stats import summarize
from llmserve.bench.tenant_report import tenant_summary
from llmserve.bench.tenant_sim import TenantSimulation
from llmserve.bench.tenants import (
    TenantSpec,
    TenantSpecError,
    load_tenants_file,
    parse_tenants,
    tenant_workload,
)
from llmserve.bench.workload import Workload
from llmserve.cli import main as llmserve

COST = CostModel(fixed=0.01, per_token=1e-4, per_sampled=1e-5, per_kv_read=1e-8)
SMALL = SimSettings(workers=1, kv_capacity=8192, token_budget=64, max_running=8, speedup=1)
CLASSES = parse_slo_classes("interactive=ttft:1,tpot:0.1 batch=ttft:30,tpot:1")


def simulate(workload: Workload, queue: str, settings: SimSettings = SMALL) -> dict:
    result = TenantSimulation(settings, Policy("continuous", "paged", queue=queue), COST).run(
        workload, progress=False
    )
    return {"result": result, **tenant_summary(result, workload, settings)}


def test_the_issues_two_tenants_parse_with_their_kinds_inferred():
    chat, batch = parse_tenants(
        "chat:weight=1,priority=0,class=interactive,workload=poisson,rate=2,prompt=24,output=24;"
        " batch:weight=2,priority=5,class=batch,concurrency=64,prompt=600,output=256"
    )
    assert chat == TenantSpec("chat", 1.0, 0, "interactive", "poisson", rate=2.0, prompt=24,
                              output=24)  # fmt: skip
    assert (batch.workload, batch.concurrency, batch.weight, batch.priority) == ("closed", 64, 2, 5)
    assert parse_tenants("t:trace=x.csv,time_scale=0.5")[0].workload == "trace"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "no tenants"),
        ("chat:colour=red", "unknown key 'colour'"),
        ("chat:rate=fast", "rate='fast' is not a float"),
        ("chat:concurrency=1.5", "concurrency='1.5' is not an int"),
        ("chat:rate", "'rate' is not key=value"),
        ("chat:weight=0", "weight must be a number > 0"),
        ("chat:workload=closed", "needs concurrency=N"),
        ("chat:workload=burst", "workload must be one of poisson, closed, trace"),
        ("a:rate=1;a:rate=2", "tenant 'a' is given twice"),
        ("bad name:rate=1", "a name is letters"),
        ("chat:prompt=0", "prompt and output must be >= 1"),
    ],
)
def test_a_bad_tenant_spec_names_the_tenant_and_what_is_wrong(text: str, says: str):
    with pytest.raises(TenantSpecError, match=says):
        parse_tenants(text)


def test_a_tenant_of_an_undefined_class_or_without_a_count_is_refused():
    with pytest.raises(TenantSpecError, match="SLO class 'gold' is not defined"):
        tenant_workload(parse_tenants("chat:class=gold,requests=3"), CLASSES)
    with pytest.raises(TenantSpecError, match="give requests=N"):
        tenant_workload(parse_tenants("chat:rate=1"), CLASSES)


def test_a_tenants_file_is_a_json_or_yaml_list_with_the_same_keys(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps([{"name": "a", "concurrency": 2, "class": "batch"},
                                {"name": "b", "rate": 3}]))  # fmt: skip
    a, b = load_tenants_file(path)
    assert (a.workload, a.concurrency, a.slo_class, b.workload, b.rate) == (
        "closed", 2, "batch", "poisson", 3.0)  # fmt: skip
    pytest.importorskip("yaml")
    path.write_text("tenants:\n  - name: c\n    concurrency: 4\n    weight: 2\n")
    (c,) = load_tenants_file(path)
    assert (c.name, c.workload, c.concurrency, c.weight) == ("c", "closed", 4, 2.0)
    path.write_text(json.dumps({"tenants": [{"rate": 3}]}))
    with pytest.raises(TenantSpecError, match="each with a name"):
        load_tenants_file(path)


def test_a_closed_loop_tenant_is_chains_and_each_request_carries_its_tenancy():
    w = tenant_workload(
        parse_tenants(
            "chat:class=interactive,priority=-1,rate=4,requests=3;"
            "batch:weight=2,concurrency=2,requests=5"
        ),  # fmt: skip
        CLASSES,
        load=2.0,
    )
    chat, batch = w.requests[:3], w.requests[3:]
    assert [r.index for r in w.requests] == list(range(8))
    assert [r.follows for r in batch] == [-1, -1, 3, 4, 5]
    assert [r.arrival_s for r in batch] == [0.0, 0.0, None, None, None]
    t = chat[0].tenancy
    assert (t.tenant, t.priority, t.slo_class, t.ttft_s, t.tpot_s) == ("chat", -1, "interactive",
                                                                       1.0, 0.1)  # fmt: skip
    assert batch[0].tenancy.weight == 2.0 and batch[0].tenancy.slo_class == ""
    assert "distinct per request" in w.prompts
    later = tenant_workload(parse_tenants("chat:rate=8,requests=3,seed=1"), {}, load=2.0)
    assert later.requests[2].arrival_s < tenant_workload(
        parse_tenants("chat:rate=8,requests=3,seed=1"), {}).requests[2].arrival_s  # fmt: skip


def test_the_queue_policies_run_side_by_side_and_unknown_ones_are_refused():
    labels = [p.label for p in parse_policies("continuous+paged", "off", "fcfs,fair")]
    assert labels == ["continuous+paged cache off fcfs", "continuous+paged cache off fair"]
    with pytest.raises(ValueError, match="want one or more of fcfs, priority, fair, deadline"):
        parse_policies("continuous+paged", "", "fcfs,lottery")


IDENTICAL = (
    "a:concurrency=6,prompt=40,output=12,requests=30;"
    + "b:concurrency=6,prompt=40,output=12,requests=30"
)


def test_identical_tenants_under_fair_get_equal_service_and_the_figures_add_up():
    w = tenant_workload(parse_tenants(IDENTICAL), CLASSES)
    run = simulate(w, "fair")
    summary = summarize(run["result"])
    a, b = run["tenants"]["a"], run["tenants"]["b"]
    assert a["ok"] == b["ok"] == 30
    assert a["served_tokens"] + b["served_tokens"] == (
        summary["prompt_tokens"] + summary["output_tokens"])  # fmt: skip
    assert a["output_tokens"] + b["output_tokens"] == summary["output_tokens"] == 60 * 12
    assert run["jain_index"] == pytest.approx(1.0, abs=1e-3)
    for f in (a, b):
        assert set(f) >= {"served_tokens_per_s", "ttft_s", "tpot_s", "goodput", "weighted_service"}
        assert f["goodput"] is None  # no class: no targets to meet
    assert set(run["classes"]) == {"(none)"} and run["classes"]["(none)"]["ok"] == 60
    pair = run["service_difference"]["pairs"][0]
    assert pair["backlogged_steps"] > 0
    assert pair["max_difference"] <= run["service_difference"]["vtc_bound"]


def test_goodput_counts_each_request_against_its_own_class():
    w = tenant_workload(
        parse_tenants(
            "fast:class=interactive,concurrency=2,prompt=8,output=4,requests=6;"
            "slow:class=batch,concurrency=2,prompt=8,output=4,requests=6"
        ),  # fmt: skip
        parse_slo_classes("interactive=ttft:0.000001 batch=ttft:100"),
    )
    run = simulate(w, "fcfs")
    assert run["tenants"]["fast"]["goodput"]["met"] == 0
    assert run["tenants"]["fast"]["goodput"]["missed_ttft"] == 6
    assert run["tenants"]["slow"]["goodput"]["share"] == 1.0
    assert run["classes"]["batch"]["goodput"]["met"] == 6


BURST = ("chat:class=interactive,concurrency=1,prompt=8,output=8,requests=8;"
         "batch:class=batch,concurrency=24,prompt=200,output=40,requests=48")  # fmt: skip


def test_fair_share_gives_a_tenant_beside_a_burst_a_lower_ttft_than_fcfs():
    w = tenant_workload(parse_tenants(BURST), CLASSES)
    fcfs, fair = simulate(w, "fcfs"), simulate(w, "fair")
    chat_fcfs, chat_fair = fcfs["tenants"]["chat"], fair["tenants"]["chat"]
    assert chat_fair["ok"] == chat_fcfs["ok"] == 8
    assert chat_fair["ttft_s"]["p90"] < chat_fcfs["ttft_s"]["p90"] / 3
    assert fair["tenants"]["batch"]["ok"] == 48  # nothing lost to the preemptions


def test_two_backlogged_tenants_stay_within_the_vtc_bound_and_weights_split_service():
    one = "concurrency=16,prompt=30,output=10,requests=200"
    spec = f"a:{one};b:{one}"
    run = simulate(tenant_workload(parse_tenants(spec), {}), "fair")
    pair = run["service_difference"]["pairs"][0]
    assert run["service_difference"]["vtc_bound"] == vtc_bound(30, 10, SMALL.token_budget)
    assert pair["backlogged_steps"] > 100
    assert pair["max_difference"] <= run["service_difference"]["vtc_bound"]
    assert pair["service_ratio"] == pytest.approx(1.0, abs=0.05)
    weighted = spec.replace("a:", "a:weight=2,")
    pair = simulate(tenant_workload(parse_tenants(weighted), {}), "fair")["service_difference"]
    assert pair["pairs"][0]["service_ratio"] == pytest.approx(2.0, rel=0.05)


def test_a_tenant_stops_sending_at_its_until():
    w = tenant_workload(
        parse_tenants("a:concurrency=1,prompt=8,output=4,requests=1000,until=0.5"), {}
    )
    run = simulate(w, "fcfs")
    assert 1 < run["tenants"]["a"]["requests"] < 1000
    assert max(r.scheduled_s for r in run["result"].records) <= 0.5


def test_jain_is_one_for_equal_rates_and_one_over_n_for_one_taking_all():
    assert jain([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain([5.0, 0.0]) == pytest.approx(0.5)
    assert jain([0.0, 0.0]) is None


def test_bench_sim_reports_tenants_in_its_json_and_tables(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        llmserve(
            ["bench", "sim", "--tenants", BURST, "--slo-classes",
             "interactive=ttft:1 batch=ttft:30",
             "--queue-policies", "fcfs,fair", "--policies", "continuous+paged,static+reserve",
             "--sim-workers",
             "1", "--max-running", "8", "--token-budget", "64", "--kv-capacity", "8192",
             "--speedup", "1", "--out", str(tmp_path), "--no-progress"]
        )  # fmt: skip
    assert done.value.code == 0
    report = json.loads((tmp_path / "sim-load1.json").read_text())
    runs = report["tenants"]["runs"]
    assert list(runs) == ["continuous+paged fcfs", "continuous+paged fair", "static+reserve fcfs",
                          "static+reserve fair"]  # fmt: skip
    assert set(runs["continuous+paged fair"]["tenants"]) == {"chat", "batch"}
    ratios = report["tenants"]["output_tokens_per_s_vs_fcfs"]
    same = {"chat": 1.0, "batch": 1.0}
    assert ratios["continuous+paged fcfs"] == ratios["static+reserve fcfs"] == same
    static = runs["static+reserve fair"]["tenants"]["batch"]["output_tokens_per_s"]
    static_fcfs = runs["static+reserve fcfs"]["tenants"]["batch"]["output_tokens_per_s"]
    assert ratios["static+reserve fair"]["batch"] == pytest.approx(static / static_fcfs)
    out = capsys.readouterr().out
    assert "per tenant and per SLO class (prompts: distinct per request" in out
    assert "VTC bound" in out and "Jain's index" in out
    with pytest.raises(SystemExit) as usage:
        llmserve(["bench", "sim", "--tenants", BURST, "--queue-policies", "lottery"])
    assert usage.value.code == 2
    assert "want one or more of fcfs, priority, fair, deadline" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="SLO class 'interactive' is not defined"):
        llmserve(["bench", "sim", "--tenants", BURST, "--out", str(tmp_path), "--no-progress"])


def test_the_service_difference_is_the_widest_swing_inside_one_backlogged_stretch():
    gap, weights = PairGap("a", "b"), {"a": 1.0, "b": 2.0}
    for got, both in [({"a": 10}, True), ({"b": 40}, True), ({"a": 500}, False),
                      ({"a": 6}, True), ({"b": 4}, True)]:  # fmt: skip
        gap.record(Counter(got), weights, both)
    figures = gap.figures()
    # first stretch: +10, then 10 - 20 = -10: a swing of 20; the second: +6, +4; widest 20
    assert figures["max_difference"] == 20
    assert figures["backlogged_stretches"] == 2 and figures["backlogged_steps"] == 4
    assert figures["service_while_backlogged"] == {"a": 16, "b": 44}
