"""`bench serve --backend openai` against servers that answer in other ways: a small fake
OpenAI-compatible server (raw asyncio sockets, chunked HTTP/1.1, exact timings) whose URL path
picks its quirk: `http://127.0.0.1:PORT/<mode>[+<mode>...]/v1`."""

from __future__ import annotations

import asyncio
import csv
import json
import threading
import time

import openai
import pytest

from llmserve.bench import loadgen
from llmserve.bench.errors import BenchError
from llmserve.bench.goodput import Slo
from llmserve.bench.openai_backend import run_openai
from llmserve.bench.records import RunResult
from llmserve.bench.report import Report
from llmserve.bench.stats import summarize
from llmserve.bench.workload import RequestSpec, Workload, fixed, with_max_tokens
from llmserve.cli import main as llmserve

pytestmark = pytest.mark.usefixtures("hang_guard")

PORTS = range(21160, 21200)  # loopback ports this file's servers may take
TTFT, GAP = 0.05, 0.02  # the fake server's timings, seconds


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    lines = head.split("\r\n")
    path = lines[0].split(" ")[1]
    length = next(
        (
            int(v)
            for k, _, v in (x.partition(":") for x in lines[1:])
            if k.lower() == "content-length"
        ),
        0,
    )
    body = json.loads(await reader.readexactly(length) or b"{}")
    mode, _, endpoint = path.strip("/").partition("/")
    flags = set(mode.split("+"))
    try:
        await _answer(writer, flags, endpoint, body)
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def _answer(writer, flags: set[str], endpoint: str, req: dict) -> None:
    if endpoint == "v1/models":
        if "nomodels" in flags:
            return await _respond(writer, 404, b'{"error": "not found"}')
        return await _respond(writer, 200, b'{"object": "list", "data": [{"id": "fake"}]}')
    if "hang" in flags:
        await asyncio.sleep(3600)
    chat = endpoint.endswith("chat/completions")
    n = req["max_tokens"] * (2 if "ignoremax" in flags else 1)
    if "nostream" in flags:
        choice = {"index": 0, "text": "x" * n, "finish_reason": "length"}
        return await _respond(writer, 200, json.dumps({"id": "c", "choices": [choice]}).encode())
    options = req.get("stream_options") or {}
    if "strict" in flags and set(options) - {"include_usage"}:
        body = {"error": {"message": f"unknown field in stream_options: {options}"}}
        return await _respond(writer, 400, json.dumps(body).encode())
    continuous = options.get("continuous_usage_stats") and "final_usage" not in flags
    per = 4 if "multi4" in flags else 1
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )

    async def send(obj) -> None:
        data = (obj if isinstance(obj, str) else json.dumps(obj)).encode()
        payload = b"data: " + data + b"\n\n"
        writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))
        await writer.drain()

    def usage(k: int) -> dict:
        if "usagezero" in flags:
            return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        if "usagepartial" in flags:
            return {"prompt_tokens": 7, "total_tokens": 7 + k}
        return {"prompt_tokens": 7, "completion_tokens": k, "total_tokens": 7 + k}

    def chunk(text: str, sent: int, finish: str | None = None) -> dict:
        if chat and "reason" in flags and sent <= n // 2 and text:
            choice = {"index": 0, "delta": {"reasoning_content": text}, "finish_reason": finish}
        elif chat:
            choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish}
        out = {"id": "c", "object": "text_completion", "choices": [choice]}
        return out | ({"usage": usage(sent)} if continuous else {})

    stop = n // 2 if flags & {"errobj", "garbage", "cleanend", "nochoices"} else n
    await asyncio.sleep(TTFT)
    sent = 0
    while sent < stop:
        if sent:
            await asyncio.sleep(GAP * per)
        k = min(per, stop - sent)
        sent += k
        await send(chunk("t" * k, sent))
    if "errobj" in flags:
        return await send({"object": "error", "message": "fake error", "code": 400})
    if "garbage" in flags:
        return await send("{not json")
    if "nochoices" in flags:
        return await send({"id": "c", "object": "text_completion"})
    if "cleanend" in flags:
        writer.write(b"0\r\n\r\n")
        return await writer.drain()
    await send(chunk("", sent, "length"))
    if options.get("include_usage") and "nousage" not in flags:
        await send({"id": "c", "object": "text_completion", "choices": [], "usage": usage(sent)})
    await send("[DONE]")
    writer.write(b"0\r\n\r\n")
    await writer.drain()


async def _respond(writer, code: int, body: bytes) -> None:
    writer.write(
        b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n%s" % (code, len(body), body)
    )
    await writer.drain()


@pytest.fixture(scope="module")
def server():
    """The fake server on the first free port of PORTS, in a thread of its own; its URL."""
    loop = asyncio.new_event_loop()
    for port in PORTS:
        try:
            listening = loop.run_until_complete(asyncio.start_server(_handle, "127.0.0.1", port))
            break
        except OSError:
            continue
    else:
        raise RuntimeError("no free port in 21160-21199")
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    listening.close()
    for task in asyncio.all_tasks(loop):  # answers still held (hang)
        task.cancel()
    loop.run_until_complete(asyncio.sleep(0.1))
    loop.close()


@pytest.fixture
def bench(server):
    def run(mode: str, workload: Workload, limit_s: float = 20.0, **kw) -> RunResult:
        """`workload` against the fake server in `mode` (a hang fails after `limit_s`)."""
        go = run_openai(mode, f"{server}/{mode}/v1", workload, progress=False, **kw)
        return asyncio.run(asyncio.wait_for(go, limit_s))

    return run


def two(output: int = 10) -> Workload:
    return fixed(2, prompt_tokens=4, output_tokens=output, concurrency=2)


def test_the_deadline_runs_from_sending_and_fails_the_request_as_on_grpc(bench) -> None:
    result = bench("plain", two(40), timeout_s=0.4)  # 50 ms + 39 x 20 ms = 0.83 s a request
    assert all(not r.ok and r.error.startswith("DEADLINE_EXCEEDED") for r in result.records)
    assert all(0.35 < r.e2e_s < 0.6 for r in result.records)
    assert summarize(result)["errors_by_reason"] == {"DEADLINE_EXCEEDED": 2}


def test_a_server_that_never_answers_does_not_hang_the_warm_up(bench, monkeypatch) -> None:
    result = bench("hang", two(), limit_s=10, timeout_s=0.3)  # the run's own deadline
    assert all(r.error.startswith("DEADLINE_EXCEEDED") for r in result.records)
    monkeypatch.setattr(loadgen, "WARMUP_TIMEOUT_S", 0.3)  # no --timeout: the warm-up's bound
    with pytest.raises(BenchError, match="no warm-up request answered within 0.3 s"):
        bench("hang", two(), limit_s=10)


@pytest.mark.parametrize(
    "mode, reason",
    [
        ("errobj", "error chunk: fake error"),
        ("nochoices", "error chunk: no choices"),
        ("garbage", "not JSON: a data line '{not json'"),
        ("cleanend", "cut off: the stream ended without a finish_reason"),
        ("nostream", "not streamed: the answer (application/json) has no events"),
        ("ignoremax", "LENGTH: 20 tokens, above max_tokens 10"),
    ],
)
def test_a_malformed_or_cut_answer_fails_its_request_and_the_run_goes_on(
    bench, mode, reason
) -> None:
    result = bench(mode, two())
    assert all(not r.ok and r.error.startswith(reason) for r in result.records)
    s = summarize(result, Slo(1.0, 1.0))
    assert s["ok"] == 0 and s["goodput"]["met"] == 0 and s["ttft_s"] is None


def test_tokens_are_counted_from_the_usage_in_every_chunk_where_the_server_sends_it(bench) -> None:
    result = bench("multi4", two())  # 4 tokens a chunk, the usage so far in each
    for r in result.records:
        assert r.ok and r.completion_tokens == 10 and r.tokens_basis == "usage"
        assert len(r.token_gaps) == 9 and r.token_gaps[1:3] == [0.0, 0.0]  # 3 in the 1st chunk
    s = summarize(result)
    assert s["exact_lengths"] is True and s["tokens_basis"] == "usage"


def test_the_stop_at_the_output_length_counts_the_tokens_a_chunk_carries(bench) -> None:
    capped = with_max_tokens(two(10), 40)
    result = bench("multi4", capped)  # 3 chunks make 10 tokens: not 10 chunks = 40 tokens
    for r in result.records:
        assert r.finish == "client_stop" and r.completion_tokens == 10
        assert r.e2e_s < TTFT + 2 * 4 * GAP + 0.1
        assert r.tpot_s < GAP  # 2 gaps of 4 x 20 ms over 9
    assert summarize(result)["exact_lengths"] is True


def test_without_usage_in_chunks_the_counts_are_chunks_and_said_to_be(bench) -> None:
    capped = with_max_tokens(two(10), 40)
    stopped = summarize(bench("multi4+final_usage", capped))
    assert stopped["tokens_basis"] == "chunks" and stopped["exact_lengths"] is None
    s = summarize(bench("multi4+nousage+final_usage", two()))
    assert s["tokens_basis"] == "chunks" and s["exact_lengths"] is False  # 3 of 10


def test_a_server_that_refuses_usage_in_every_chunk_gets_asked_for_it_at_the_end(bench) -> None:
    result = bench("strict", two())
    assert all(r.ok and r.completion_tokens == 10 for r in result.records)
    assert summarize(result)["tokens_basis"] == "usage"


def test_a_usage_without_the_count_or_of_zeros_gives_way_to_the_tokens_streamed(bench) -> None:
    for mode, note in (("usagepartial", "without completion_tokens"), ("usagezero", "said 0")):
        result = bench(mode, two())
        for r in result.records:
            assert r.ok and r.completion_tokens == 10 and len(r.token_gaps) == 9
            assert r.tokens_basis == "chunks" and note in r.usage_note
        assert summarize(result)["tokens_basis"] == "chunks"


def test_reasoning_deltas_count_as_tokens_when_they_come(bench) -> None:
    class Chat:  # the workload's content: chat messages
        label = "chat"

        def served_input(self, spec, history):
            return [("user", "hi")]

    chat = Workload("chat", [RequestSpec(0, 4, 20)], 1, content=Chat())
    result = bench("reason+final_usage", chat)  # 10 reasoning tokens, then 10 of the answer
    (r,) = result.records
    assert r.ok and r.completion_tokens == 20 and r.ttft_s < TTFT + 0.1
    assert min(r.token_gaps) > GAP / 2  # no 0-s gaps for tokens only the usage counted


def test_the_clock_starts_after_the_prompt_and_the_http_client_are_built(
    bench, monkeypatch
) -> None:
    built = openai.AsyncOpenAI

    def slow_client(*args, **kw):
        time.sleep(0.3)
        return built(*args, **kw)

    class SlowPrompts:
        label = "slow"

        def served_input(self, spec, history):
            time.sleep(0.2)  # a long prompt's text
            return "word " * spec.prompt_tokens

    monkeypatch.setattr(openai, "AsyncOpenAI", slow_client)
    for concurrency in (0, 1):  # open loop, closed loop
        specs = [RequestSpec(i, 4, 2, None if concurrency else 0.3 * i) for i in range(2)]
        load = Workload("slow", specs, concurrency, content=SlowPrompts())
        for r in bench("plain", load, warmup=0).records:
            assert r.ok and r.ttft_s < TTFT + 0.1, (concurrency, r.index, r.ttft_s)


def test_the_report_says_the_basis_and_leaves_unknown_server_figures_unknown(
    bench, tmp_path
) -> None:
    result = bench("nousage+final_usage", two())
    report = Report("t", {}, slo=None)
    report.add(result)
    (run,) = json.loads(report.write(tmp_path, "t")[0].read_text())["runs"]
    assert run["tokens_basis"] == "chunks" and run["preemptions"] is None
    assert run["prefix"]["prefill_computed"] is None and run["prefix"]["computed_share"] is None
    rows = list(csv.DictReader(open(tmp_path / "t-nousage-final_usage-requests.csv")))
    assert [r["tokens_basis"] for r in rows] == ["chunks", "chunks"]


def test_a_server_without_models_is_one_line_and_exit_2(server, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        llmserve(
            ["bench", "serve", "--backend", "openai", "--base-url", f"{server}/nomodels/v1",
             "--baselines", "none", "--out", str(tmp_path), "--no-progress"]
        )  # fmt: skip
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "cannot list its models (HTTP 404); give --api-model" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_an_openai_error_that_reaches_the_command_is_one_line(monkeypatch, tmp_path, capsys):
    from llmserve.bench import run_serve

    async def refused(*args, **kw):
        raise openai.APIConnectionError(request=None)

    monkeypatch.setattr(run_serve, "run_openai", refused)
    with pytest.raises(SystemExit) as done:
        llmserve(
            ["bench", "serve", "--backend", "openai", "--base-url", "http://127.0.0.1:21199/v1",
             "--baselines", "none", "--out", str(tmp_path), "--no-progress"]
        )  # fmt: skip
    assert done.value.code == 1
    assert (
        capsys.readouterr().err == "error: llmserve bench: APIConnectionError: Connection error.\n"
    )
