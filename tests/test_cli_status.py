"""`llmserve status` prints the workers as they are: address, pool, context, stalls, draining."""

from __future__ import annotations

from llmcommon.v1 import scheduler_pb2
from llmserve.client import status_dict
from llmserve.status_text import format_status


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


def test_status_shows_the_prefix_cache_and_a_dash_for_the_hit_rate_before_any_prompt() -> None:
    reply = scheduler_pb2.StatusReply(
        policy="paged", prefix_caching=True, prompt_tokens=400, hit_tokens=100, evictions=3
    )
    reply.workers.add(
        name="worker0", healthy=True, cached_blocks=12, evictable_blocks=5, evictions=3,
        prompt_tokens=400, hit_tokens=100,
    )  # fmt: skip
    reply.workers.add(name="worker1", healthy=True, cached_blocks=0)
    text = format_status(status_dict(reply))
    assert "prefix caching on" in text
    assert "hit rate 25.0% (100 of 400 prompt tokens served from cache)  evictions 3" in text
    cache = [line for line in text.splitlines() if "prefix cache: cached blocks" in line]
    assert "cached blocks     12  evictable      5  hit rate  25.0%  evictions 3" in cache[0]
    assert "hit rate      -" in cache[1]
    off = scheduler_pb2.StatusReply(policy="reserve", prompt_tokens=6)
    off.workers.add(name="worker0", healthy=True, prompt_tokens=6)
    text = format_status(status_dict(off))
    assert "prefix caching off" in text and "prefix cache: off" in text
    assert "hit rate" not in text  # no 0% where nothing could hit


def test_a_request_waiting_before_any_step_weighed_it_is_not_called_nothing_waits() -> None:
    """Between an arrival and the next step planned, no limit has held the head yet: status
    said "waiting 1 ... head of queue waits: nothing waits"."""
    idle = format_status(status_dict(scheduler_pb2.StatusReply(policy="paged")))
    assert "head of queue waits: nothing waits" in idle
    arrived = format_status(status_dict(scheduler_pb2.StatusReply(policy="paged", waiting=1)))
    assert "waiting 1 " in arrived and "nothing waits" not in arrived
    assert "head of queue waits: not yet planned" in arrived
