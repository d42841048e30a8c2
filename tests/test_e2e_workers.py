"""Several workers: each request goes to the worker with the most free KV, executions run
concurrently, and the outputs are those of a single worker."""

from __future__ import annotations

import threading
import time
import urllib.request

from llmserve import client
from tests.stacks import free_run, running_stack, tiny_settings


def run_burst(settings, tmp_path, n: int = 8) -> tuple[list[list[int]], set[str]]:
    busy: set[str] = set()
    outputs: dict[int, list[int]] = {}
    with running_stack(settings, tmp_path) as stack:

        def one(i: int) -> None:
            r = client.make_request(
                prompt=f"request {i}:", max_tokens=30, temperature=0.0, ignore_eos=True
            )
            outputs[i] = [
                t
                for m in client.stream(stack.settings.gateway, r, timeout=120)
                for t in m.delta.token_ids
            ]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        final = client.status(stack.settings.scheduler)
        busy.update(w.name for w in final.workers if w.steps > 0)  # steps never go down
    assert all(w.written == 0 and w.free == w.capacity for w in final.workers)
    return [outputs[i] for i in range(n)], busy


def test_two_workers_share_the_load_and_give_single_worker_outputs(tmp_path) -> None:
    single, _ = run_burst(tiny_settings(workers=1), tmp_path / "one")
    double, busy = run_burst(tiny_settings(workers=2), tmp_path / "two")
    assert busy == {"worker0", "worker1"}
    assert double == single


def test_the_workers_own_kv_view_returns_to_zero_at_idle(tmp_path) -> None:
    settings = tiny_settings(metrics_base_port=free_run(3))
    with running_stack(settings, tmp_path) as stack:
        request = client.make_request(prompt="hello", max_tokens=20, ignore_eos=True)
        assert list(client.stream(stack.settings.gateway, request, timeout=60))
        url = f"http://127.0.0.1:{settings.metrics_port(2)}/metrics"
        deadline = time.monotonic() + 10
        while True:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            line = next(
                x for x in text.splitlines() if x.startswith("llmserve_worker_kv_written_positions")
            )
            if float(line.split()[-1]) == 0.0:
                break
            assert time.monotonic() < deadline, line
            time.sleep(0.1)
