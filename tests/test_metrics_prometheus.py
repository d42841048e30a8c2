"""The metrics through a real Prometheus (Debian's package, `make prometheus`) scraping real
processes under a workload that makes requests wait: every query of every dashboard panel returns
data; `kv_reserved` stalls show up under `reserve`, with the KV written well below capacity, and
not under `paged`; the counters agree with what the clients saw.

The workload is the seed's point at scale: requests ask for max_tokens 24 but a stop token ends
them after a few tokens, so `reserve` holds 8 + 24 positions per request for data that never comes.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from llmserve import client
from llmserve.prometheus import Prometheus, scrape_config, stack_targets
from tests import dashboard, prometheus_api
from tests.stack_checks import wait_idle
from tests.stacks import free_port, free_run, running_stack, tiny_settings

PROMPT = " a b c d e f g h"  # eight tokens
MAX_TOKENS = 24  # reserve holds 8 + 24 = 32 positions: two requests fill the pool
CAPACITY = 64
STOP_AFTER = 4  # the stop token is the probe's fourth
CLIENTS = 6
SECONDS = 5.0
BAD_REQUESTS = {
    "INVALID_ARGUMENT": dict(temperature=-1.0),
    "RESOURCE_EXHAUSTED": dict(max_tokens=100),  # 8 + 100 positions: more than the whole pool
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="prometheus is not installed: `make prometheus` installs Debian's package",
    ),
]


@dataclass
class Run:
    """One workload under one policy, and the Prometheus that scraped it."""

    policy: str
    url: str
    start: float
    end: float  # every target was scraped after the workload ended
    finals: list  # the Final of every request that completed
    tokens_seen: int  # token ids the clients received in deltas
    codes: Counter  # gRPC error codes the clients got

    def value(self, expr: str) -> float:
        return prometheus_api.value(self.url, expr, self.end)

    def series(self, expr: str) -> dict[str, list[float]]:
        return prometheus_api.series(self.url, expr, self.start, self.end)

    def peak(self, expr: str) -> float:
        return max(v for values in self.series(expr).values() for v in values)


def generate(target: str, request) -> tuple[list[str], int, object]:
    """Stream one request: (delta texts, token ids received, its Final)."""
    texts, tokens, final = [], 0, None
    for message in client.stream(target, request, timeout=60):
        if message.HasField("delta"):
            texts.append(message.delta.text)
            tokens += len(message.delta.token_ids)
        else:
            final = message.final
    return texts, tokens, final


def keep_sending(target: str, request, until: float) -> list[tuple[int, object]]:
    done = []
    while time.monotonic() < until:
        _, tokens, final = generate(target, request)
        done.append((tokens, final))
    return done


def send_bad_requests(target: str) -> Counter:
    codes: Counter = Counter()
    for overrides in BAD_REQUESTS.values():
        with pytest.raises(grpc.RpcError) as err:
            generate(target, client.make_request(prompt=PROMPT, **overrides))
        codes[err.value.code().name] += 1
    return codes


def wait_for(check, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def run_workload(policy: str, workdir: Path, keep: ExitStack) -> Run:
    settings = tiny_settings(
        kv_capacity=CAPACITY,
        block_size=4,
        token_budget=16,
        policy=policy,
        metrics_base_port=free_run(3),
        # a step-time budget that never binds (the prior predicts well under 1 s for 16
        # tokens): the dashboard's budget line has a value to draw
        step_time_budget_ms=60_000.0,
    )
    config = scrape_config(stack_targets(settings), interval_s=1)
    prometheus = keep.enter_context(Prometheus(config, workdir / "prometheus", free_port()))
    url, gateway = prometheus.url, settings.gateway
    with running_stack(settings, workdir / "logs"):
        wait_for(lambda: prometheus_api.value(url, "sum(up)", time.time()) == 3, "first scrapes")
        start = time.time()
        # A greedy probe of STOP_AFTER tokens tells the output's start: its last token becomes
        # a stop token, which the scheduler itself ends a request at (a stop string, ended at
        # the gateway, lets the scheduler write on until the cancel reaches it: more KV
        # written the slower the host)
        probe = client.make_request(
            prompt=PROMPT, max_tokens=STOP_AFTER, temperature=0.0, ignore_eos=True
        )
        messages = list(client.stream(gateway, probe, timeout=60))
        ids = [t for m in messages[:-1] for t in m.delta.token_ids]
        results = [(len(ids), messages[-1].final)]
        assert len(ids) == STOP_AFTER, ids
        request = client.make_request(
            prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
        )
        request.sampling.stop_token_ids.append(ids[-1])
        until = time.monotonic() + SECONDS
        with ThreadPoolExecutor(CLIENTS) as pool:
            loops = [pool.submit(keep_sending, gateway, request, until) for _ in range(CLIENTS)]
            time.sleep(1.0)
            codes = send_bad_requests(gateway)  # while the load runs
            results += [r for loop in loops for r in loop.result()]
        wait_idle(settings.scheduler)  # the scheduler has seen every call end
        ended = time.time()
        wait_for(
            lambda: prometheus_api.value(url, "min(timestamp(up))", time.time()) > ended,
            "a scrape after the workload",
        )
        end = time.time()
    finals = [final for _, final in results]
    return Run(policy, url, start, end, finals, sum(t for t, _ in results), codes)


@pytest.fixture(scope="module")
def observe(tmp_path_factory):
    runs: dict[str, Run] = {}
    with ExitStack() as keep:

        def get(policy: str) -> Run:
            if policy not in runs:
                runs[policy] = run_workload(policy, tmp_path_factory.mktemp(policy), keep)
            return runs[policy]

        yield get


@pytest.mark.parametrize("policy", ["reserve", "paged"])
def test_every_dashboard_query_returns_data(observe, policy: str) -> None:
    run = observe(policy)
    queries = [  # (the cells' panels have data only where a gateway routes to --cells)
        (title, q) for title, q in dashboard.queries() if "llmserve_gateway_cell" not in q
        and "llmserve_gateway_routed" not in q
    ]  # fmt: skip
    assert len(queries) >= 20 and not [q for _, q in queries if "$" in q]
    empty = [f"{title}: {expr}" for title, expr in queries if not any(run.series(expr).values())]
    assert not empty, "panel queries without data:\n" + "\n".join(empty)


def test_kv_reserved_stalls_under_reserve_only_with_little_kv_written(observe) -> None:
    reserve, paged = observe("reserve"), observe("paged")
    assert max(f.usage.completion_tokens for f in reserve.finals[1:]) < MAX_TOKENS / 2
    kv_reserved = 'llmserve_scheduler_admission_stalls_total{reason="kv_reserved"}'
    assert reserve.value(kv_reserved) > 0
    assert paged.value(kv_reserved) == 0
    assert reserve.value("llmserve_scheduler_kv_capacity_positions") == CAPACITY
    assert reserve.peak("llmserve_scheduler_waiting_requests") > 0
    written = 'llmserve_scheduler_kv_positions{state="written"}'
    held = 'llmserve_scheduler_kv_positions{state="reserved_unwritten"}'
    assert reserve.peak(written) <= CAPACITY / 2  # the data would fit: reservations hold space
    assert reserve.peak(held) >= CAPACITY / 2
    assert paged.peak(held) < reserve.peak(held)


@pytest.mark.parametrize("policy", ["reserve", "paged"])
def test_counters_agree_with_what_the_clients_saw(observe, policy: str) -> None:
    run = observe(policy)
    finals = run.finals
    generated = sum(f.usage.completion_tokens for f in finals)
    assert run.tokens_seen == generated
    assert run.codes == Counter({code: 1 for code in BAD_REQUESTS})
    assert run.value('llmserve_gateway_requests_total{method="Generate",code="OK"}') == len(finals)
    for code in BAD_REQUESTS:
        assert run.value(f'sum(llmserve_gateway_requests_total{{code="{code}"}})') == 1
    assert run.value('llmserve_scheduler_refused_requests_total{reason="kv_capacity"}') == 1
    assert run.value("llmserve_gateway_generated_tokens_total") == generated
    prompt = sum(f.usage.prompt_tokens for f in finals)
    assert run.value("llmserve_gateway_prompt_tokens_total") == prompt
    reasons = Counter(client.FINISH_NAMES[f.finish_reason] for f in finals) + Counter(none=1)
    by_reason = prometheus_api.query(
        run.url, "sum by (finish_reason) (llmserve_gateway_requests_finished_total) > 0", run.end
    )
    assert by_reason == {f"finish_reason={r}": float(n) for r, n in reasons.items()}
    assert run.value("llmserve_gateway_time_to_first_token_seconds_count") == len(finals)
    assert run.value("llmserve_gateway_requests_in_flight") == 0
    assert run.value("llmserve_scheduler_finished_requests_total") == len(finals)
    assert run.value("sum(llmserve_worker_sampled_tokens_total)") >= generated
    # the scheduler and the worker agree on what was executed
    assert run.value("sum(llmserve_scheduler_batch_tokens_sum)") == run.value(
        "sum(llmserve_worker_batch_tokens_sum)"
    )
    assert run.value("sum(llmserve_scheduler_batch_requests_count)") == run.value(
        "sum(llmserve_worker_forward_duration_seconds_count)"
    )
