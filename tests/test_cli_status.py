"""`llmserve status` prints the workers as they are: address, pool, context, stalls, draining."""

from __future__ import annotations

from llmserve.cli import format_status
from llmserve.client import status_dict
from llmserve.v1 import scheduler_pb2


def test_status_lists_each_worker_with_its_pool_context_and_stalls() -> None:
    reply = scheduler_pb2.StatusReply(policy="paged", mode="continuous", overlap=True)
    a = reply.workers.add(
        name="worker0", address="10.0.0.5:50061", block_size=16, max_context=8192,
        capacity=4096, free=4000, running=2, healthy=True, steps=120,
    )  # fmt: skip
    a.stalls["max_running"] = 7
    reply.workers.add(
        name="worker1", address="10.0.0.6:50061", block_size=1, max_context=512,
        capacity=100, free=100, healthy=True, draining=True,
    )  # fmt: skip
    text = format_status(status_dict(reply))
    assert "overlap on" in text and "workers (2)" in text
    line0 = next(line for line in text.splitlines() if "worker0" in line)
    assert "10.0.0.5:50061" in line0 and "block  16" in line0 and "context   8192" in line0
    assert "stalls: max_running 7" in text
    line1 = next(line for line in text.splitlines() if "worker1" in line)
    assert "DRAINING" in line1 and "UNHEALTHY" not in line1
