"""The load generator against a real tiny-model stack: counts, timings, Status, report files."""

from __future__ import annotations

import asyncio
import json

import pytest

from llmserve.bench.served import run_workload
from llmserve.bench.stats import summarize
from llmserve.bench.workload import fixed, poisson, with_max_tokens
from llmserve.cli import main as llmserve
from tests.stacks import running_stack, tiny_settings


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    settings = tiny_settings(token_budget=64, max_running=8, kv_capacity=2048)
    with running_stack(settings, tmp_path_factory.mktemp("logs")):
        yield settings


def test_closed_loop_completes_every_request_at_its_length(stack) -> None:
    workload = fixed(9, prompt_tokens=12, output_tokens=5, concurrency=3)
    result = asyncio.run(
        run_workload(
            stack.gateway, stack.scheduler, workload, "closed", progress=False, poll_s=0.05
        )
    )
    assert [r.completion_tokens for r in result.records] == [5] * 9
    assert all(r.ok and r.finish == "length" and r.prompt_tokens == 12 for r in result.records)
    assert all(r.sent_s <= r.first_token_s <= r.end_s for r in result.records)
    assert all(len(r.token_gaps) == 4 for r in result.records)
    s = summarize(result)
    assert s["ok"] == 9 and s["exact_lengths"] and s["output_tokens"] == 45
    assert s["throughput"]["output_tokens_per_s"] > 0
    assert s["queue_s"]["p50"] >= 0  # the server's queue time came back in the usage
    c = result.counters  # Status deltas over the run (the warm-up excluded)
    assert c["finished"] == 9 and c["admitted"] >= 9 and c["executed_steps"] > 0
    assert 0 < c["forward_seconds"] <= c["step_seconds"]
    assert 0 < s["overhead"]["overhead_share"] < 1
    assert result.samples and all(x.kv_capacity == 2048 for x in result.samples)


def test_open_loop_sends_on_schedule(stack) -> None:
    workload = poisson(6, rate=20.0, prompt_tokens=4, output_tokens=3, seed=2)
    result = asyncio.run(
        run_workload(stack.gateway, stack.scheduler, workload, "open", progress=False, warmup=0)
    )
    for spec, record in zip(workload.requests, result.records, strict=True):
        assert record.scheduled_s == spec.arrival_s
        assert record.sent_s >= spec.arrival_s
        assert record.completion_tokens == 3


def test_max_tokens_above_the_length_stops_reading_at_the_length(stack) -> None:
    capped = with_max_tokens(fixed(2, prompt_tokens=4, output_tokens=3, concurrency=2), 50)
    result = asyncio.run(
        run_workload(stack.gateway, stack.scheduler, capped, "capped", progress=False, warmup=0)
    )
    assert all(
        r.ok and r.finish == "client_stop" and r.completion_tokens == 3 for r in result.records
    )


def test_a_request_past_its_deadline_fails_and_is_counted_by_reason(stack) -> None:
    workload = fixed(3, prompt_tokens=8, output_tokens=40, concurrency=3)
    result = asyncio.run(
        run_workload(stack.gateway, stack.scheduler, workload, "late", progress=False,
                     poll_s=0.05, timeout_s=0.001)
    )  # fmt: skip
    assert all(not r.ok and r.error.startswith("DEADLINE_EXCEEDED") for r in result.records)
    s = summarize(result)
    assert s["ok"] == 0 and s["errors_by_reason"] == {"DEADLINE_EXCEEDED": 3}
    assert result.sample_period_s == 0.05


def test_bench_serve_command_writes_json_and_plots(tmp_path) -> None:
    out = tmp_path / "bench"
    with pytest.raises(SystemExit) as done:
        llmserve(
            [
                "bench",
                "serve",
                "--model",
                "tiny",
                "--dtype",
                "fp32",
                "--threads",
                "1",
                "--policies",
                "continuous+paged",
                "--baselines",
                "none",
                "--requests",
                "4",
                "--concurrency",
                "2",
                "--prompt-tokens",
                "6",
                "--output-tokens",
                "4",
                "--kv-capacity",
                "1024",
                "--out",
                str(out),
                "--name",
                "t",
                "--no-progress",
            ]
        )
    assert done.value.code == 0
    data = json.loads((out / "t.json").read_text())
    run = data["runs"][0]
    assert run["label"] == "continuous+paged" and run["ok"] == 4 and run["exact_lengths"]
    assert run["output_tokens"] == 16 and run["config"]["model"] == "tiny"
    assert data["workload"]["requests"] == 4 and data["machine"]["cpus"] >= 1
    for plot in ("throughput", "latency", "stalls", "kv", "queue"):
        assert (out / f"t-{plot}.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "t-continuous-paged-requests.csv").read_text().count("\n") == 5
