"""Several workers: each request goes to the worker with the most free KV, executions run
concurrently, and the outputs are those of a single worker."""

from __future__ import annotations

import threading
import time

from llmserve import client
from tests.stacks import running_stack, tiny_settings


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
        while any(t.is_alive() for t in threads):
            for w in client.status(stack.settings.scheduler).workers:
                if w.running:
                    busy.add(w.name)
            time.sleep(0.005)
        final = client.status(stack.settings.scheduler)
    assert all(w.written == 0 and w.free == w.capacity for w in final.workers)
    return [outputs[i] for i in range(n)], busy


def test_two_workers_share_the_load_and_give_single_worker_outputs(tmp_path) -> None:
    single, _ = run_burst(tiny_settings(workers=1), tmp_path / "one")
    double, busy = run_burst(tiny_settings(workers=2), tmp_path / "two")
    assert busy == {"worker0", "worker1"}
    assert double == single
