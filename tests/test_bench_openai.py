"""`llmserve bench serve --backend openai`: the same workload through any OpenAI-compatible
server, here this stack's own HTTP API, beside its gRPC API: counts, timings, one report."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import openai
import pytest

from llmserve.bench.openai_backend import OpenAILoadGenerator, parse_base_urls, run_openai
from llmserve.bench.served import run_workload
from llmserve.bench.workload import RequestSpec, fixed, with_max_tokens
from llmserve.cli import main as llmserve
from tests.stacks import free_port, running_stack, tiny_settings

pytestmark = pytest.mark.usefixtures("hang_guard")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    settings = tiny_settings(
        token_budget=64, max_running=8, kv_capacity=2048, http_port=free_port()
    )
    with running_stack(settings, tmp_path_factory.mktemp("logs")):
        yield settings


def test_base_urls_take_an_optional_label() -> None:
    assert parse_base_urls(["ours=http://127.0.0.1:8000/v1", "http://h:8080/v1"]) == [
        ("ours", "http://127.0.0.1:8000/v1"),
        ("openai h:8080", "http://h:8080/v1"),
    ]


def test_the_http_api_run_gives_the_grpc_runs_counts_and_lengths(stack) -> None:
    workload = fixed(6, prompt_tokens=12, output_tokens=5, concurrency=3)
    over_http = asyncio.run(run_openai("http", stack.http_url, workload, progress=False))
    over_grpc = asyncio.run(
        run_workload(stack.gateway, stack.scheduler, workload, "grpc", progress=False)
    )
    for result in (over_http, over_grpc):
        assert [r.completion_tokens for r in result.records] == [5] * 6
        assert all(r.ok and r.finish == "length" and r.prompt_tokens == 12 for r in result.records)
        assert all(r.sent_s < r.first_token_s <= r.end_s for r in result.records)
        assert all(len(r.token_gaps) == 4 for r in result.records)
    assert over_http.config["model"] == "tiny"


def test_a_chat_turn_streams_its_answer_over_http(stack) -> None:
    answer: list[str] = []

    async def turn():
        gen = OpenAILoadGenerator(stack.http_url, "tiny")
        async with openai.AsyncOpenAI(base_url=stack.http_url, api_key="none") as api:
            sent = [("user", "Hi")]
            return await gen.one(api, RequestSpec(0, 4, 3), 0.0, time.perf_counter(), sent, answer)

    record = asyncio.run(turn())
    assert record.ok and record.completion_tokens == 3 and record.finish == "length"
    assert record.prompt_tokens > 4  # the chat template's tokens too, from the usage
    assert "".join(answer)


def test_a_client_stop_over_http(stack) -> None:
    capped = with_max_tokens(fixed(2, prompt_tokens=4, output_tokens=3, concurrency=2), 50)
    result = asyncio.run(run_openai("x", stack.http_url, capped, progress=False, warmup=0))
    assert all(r.ok and r.finish == "client_stop" for r in result.records)
    assert [r.completion_tokens for r in result.records] == [3, 3]


def test_an_unreachable_server_is_an_error_per_request_not_a_crash(stack) -> None:
    workload = fixed(2, prompt_tokens=4, output_tokens=3, concurrency=2)
    url = f"http://127.0.0.1:{free_port()}/v1"
    result = asyncio.run(run_openai("x", url, workload, model="m", progress=False, warmup=0))
    assert all("APIConnectionError" in r.error for r in result.records)


def serve_twice(stack, tmp_path, *flags: str) -> dict:
    """`bench serve --backend openai` against the stack under two labels; the JSON report."""
    out = tmp_path / "bench"
    with pytest.raises(SystemExit) as done:
        llmserve(
            ["bench", "serve", "--backend", "openai",
             "--base-url", f"ours={stack.http_url}", "--base-url", f"again={stack.http_url}",
             "--baselines", "none", "--prompt-tokens", "6", *flags,
             "--out", str(out), "--name", "t", "--no-progress"]
        )  # fmt: skip
    assert done.value.code == 0
    return json.loads((out / "t.json").read_text())


def test_bench_serve_puts_two_servers_side_by_side_in_one_report(stack, tmp_path) -> None:
    flags = ("--requests", "4", "--concurrency", "2", "--output-tokens", "4")
    runs = serve_twice(stack, tmp_path, *flags)["runs"]
    assert [r["label"] for r in runs] == ["ours", "again"]
    assert all(r["ok"] == 4 and r["exact_lengths"] and r["output_tokens"] == 16 for r in runs)
    assert runs[0]["config"] == {"backend": "openai", "base_url": stack.http_url, "model": "tiny"}


def test_bench_serve_runs_each_concurrency_against_each_server_in_one_report(
    stack, tmp_path
) -> None:
    flags = ("--requests", "0", "--concurrencies", "1,3", "--output-tokens", "2")
    report = serve_twice(stack, tmp_path, *flags)
    runs = report["runs"]
    loop = "closed loop, 1 clients (8 requests), 3 clients (8 requests)"
    assert report["workload"]["loop"] == loop
    assert report["workload"]["requests"] == 16
    assert [r["label"] for r in runs] == ["ours c=1", "again c=1", "ours c=3", "again c=3"]
    assert [r["ok"] for r in runs] == [8, 8, 8, 8]  # 2 x C requests, at least 8
    assert all(r["exact_lengths"] and r["output_tokens"] == 16 for r in runs)


def test_concurrencies_need_the_fixed_workload_and_positive_integers() -> None:
    from llmserve.bench.run_serve import openai_loads

    base = fixed(4, 6, 2, 1)

    def args(**kw):
        return argparse.Namespace(
            **{"concurrencies": "", "workload": "fixed", "requests": 0, "prompt_tokens": 6,
               "output_tokens": 2} | kw
        )  # fmt: skip

    assert openai_loads(args(), base) == [("", base)]
    loads = openai_loads(args(concurrencies="2,16", requests=5), base)
    assert [(label, w.concurrency, len(w.requests)) for label, w in loads] == [
        (" c=2", 2, 5),
        (" c=16", 16, 5),
    ]
    for bad in ("0,2", "a"):
        with pytest.raises(SystemExit):
            openai_loads(args(concurrencies=bad), base)
    with pytest.raises(SystemExit, match="fixed"):
        openai_loads(args(concurrencies="2", workload="poisson"), base)
