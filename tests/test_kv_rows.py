"""A worker's KV figures reach their rows of the Status and of the explanation, every one of
them, packed by one helper (scheduler_svc/kv_rows.py)."""

from __future__ import annotations

from dataclasses import fields

from llmcommon.v1 import scheduler_pb2
from scheduler_svc.admin import explanation_message
from scheduler_svc.explain import explain
from scheduler_svc.kv_rows import add_row
from scheduler_svc.output import WorkerKv
from tests.test_explain import figure4


def test_every_figure_of_a_workers_kv_reaches_its_status_row() -> None:
    kv = WorkerKv(
        name="w0",
        capacity=1024,
        written=300,
        reserved_unwritten=40,
        free=684,
        running=3,
        healthy=True,
        draining=True,
        block_size=16,
        max_context=2048,
        steps=77,
        stalls={"kv_reserved": 5},
        cached_blocks=12,
        evictable_blocks=4,
        evictions=2,
        prompt_tokens=900,
        hit_tokens=320,
    )
    reply = scheduler_pb2.StatusReply()
    row = add_row(reply.workers, kv)
    assert list(reply.workers) == [row]
    for f in fields(WorkerKv):
        got = getattr(row, f.name)
        assert (dict(got) if f.name == "stalls" else got) == getattr(kv, f.name), f.name


def test_a_workers_room_reaches_the_explanation_with_its_holders() -> None:
    why = explain(figure4())
    assert why is not None
    [room] = why.workers
    [row] = explanation_message(why).workers
    assert (row.name, row.free, row.written, row.reserved_unwritten, row.running) == (
        room.name,
        room.free,
        room.written,
        room.reserved_unwritten,
        room.running,
    )
    assert [(h.request_id, h.unwritten) for h in row.holders] == [("B", 14)]
