"""Two cells (a scheduler and one simulated worker each) behind one gateway, as real processes:
requests are routed to both, each says its cell and why, and a cell whose scheduler is killed
mid-stream is routed around: its streams go on in the other cell, identical to an undisturbed
run (the simulated model samples the same greedy tokens wherever a request is recomputed)."""

from __future__ import annotations

import re
import signal
from dataclasses import replace

import grpc
import pytest

from llmcommon.protocol import CELL_KEY, ROUTE_KEY
from llmcommon.v1 import gateway_pb2_grpc
from llmserve import client
from llmserve.client import status_dict
from llmserve.status_text import format_status
from tests.stack_checks import greedy_request, wait_for
from tests.stacks import free_run, running_stack
from tests.test_faults import baseline, held_settings, kill9, streaming

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]


def two_cells(**overrides):
    settings = held_settings(cells=2, workers=1, kv_capacity=4096, **overrides)
    gateway = free_run(1)
    schedulers = free_run(2, [gateway])
    workers = free_run(2, [gateway, schedulers, schedulers + 1])
    return replace(
        settings, gateway_port=gateway, scheduler_port=schedulers, worker_base_port=workers
    )


def routed(target: str, request) -> tuple[str, str]:
    """One request's cell and reason, from the gateway's trailing metadata."""
    with grpc.insecure_channel(target) as channel:
        stream = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=60)
        for _ in stream:
            pass
        trailing = dict(stream.trailing_metadata())
    return trailing[CELL_KEY], trailing[ROUTE_KEY]


def test_requests_spread_over_both_cells_and_say_where_they_went(tmp_path) -> None:
    settings = two_cells()
    with running_stack(settings, tmp_path):
        seen = [routed(settings.gateway, greedy_request(i, 8)) for i in range(6)]
        status = client.gateway_status(settings.gateway)  # across cells
    assert [(c.address, c.up) for c in status.cells] == [
        (settings.cell_scheduler(0), True),
        (settings.cell_scheduler(1), True),
    ]
    assert sum(sum(c.routed.values()) for c in status.cells) == 6
    assert "cells (2;" in format_status(status_dict(status))
    cells = {cell for cell, _ in seen}
    assert cells == {settings.cell_scheduler(0), settings.cell_scheduler(1)}
    assert {why for _, why in seen} <= {"match", "load"}


def test_a_killed_cells_streams_complete_in_the_other_identical(tmp_path) -> None:
    """kill -9 one cell's scheduler under 12 streams spread over both cells: every stream
    completes, token for token as in an undisturbed run, those of the dead cell resubmitted
    once each to the live one."""
    settings = two_cells()
    n, max_tokens = 12, 200
    with running_stack(settings, tmp_path) as stack:
        gw = settings.gateway
        streams, expected = streaming(gw, n, max_tokens)
        kill9(stack, "scheduler1")
        outcomes = streams.join(120)
        assert [o.code for o in outcomes] == [None] * n, {o.details for o in outcomes}
        assert [o.tokens for o in outcomes] == expected
        log = stack.log("gateway").read_text()
        moved = re.findall(r"request (\w+): cell \S+ lost \(\w+\); resubmitting", log)
        assert moved and len(moved) == len(set(moved)) < n  # some moved, each once
        after = baseline(gw, 4, 16)  # new requests go to the live cell
        assert all(len(tokens) == 16 for tokens in after)
        stack.restart("scheduler1")  # it comes back: it takes traffic again
        back = settings.cell_scheduler(1)
        wait_for(
            lambda: back in {routed(gw, greedy_request(100 + i, 4))[0] for i in range(4)},
            30,
            "the restarted cell routed to",
        )


def chat_hits(target: str, conversations: int = 6, turns: int = 4) -> float:
    """Multi-turn chats, each turn resending its conversation's text and answers (two shared
    system texts): the share of prompt tokens the prefix caches served."""
    systems = [
        " ".join(f"rule {k} of system {s}: answer briefly and kindly." for k in range(24))
        for s in range(2)
    ]
    texts = [systems[c % 2] + f" Conversation {c} starts." for c in range(conversations)]
    cached = prompt = 0
    for turn in range(turns):
        for c in range(conversations):
            texts[c] += f" User turn {turn}: tell me more about item {c * 10 + turn}."
            request = client.make_request(
                prompt=texts[c], max_tokens=16, temperature=0.0, ignore_eos=True
            )
            messages = list(client.stream(target, request, timeout=60))
            texts[c] += "".join(m.delta.text for m in messages[:-1])
            usage = messages[-1].final.usage
            cached, prompt = cached + usage.cached_tokens, prompt + usage.prompt_tokens
    return cached / prompt


def test_multi_turn_chats_keep_their_hits_across_two_cells(tmp_path) -> None:
    """The same chats through one cell of two workers and through two cells of one worker
    (cache-aware): the two cells' hit rate is within 10% of the one cell's."""
    one = replace(two_cells(), cells=1, workers=2)
    with running_stack(one, tmp_path / "one"):
        single = chat_hits(one.gateway)
    two = two_cells()
    with running_stack(two, tmp_path / "two"):
        routed_hits = chat_hits(two.gateway)
    print(f"\nprefix hit rate: one cell {single:.1%}, two cells {routed_hits:.1%}")
    assert single > 0.5
    assert routed_hits >= 0.9 * single


def test_a_hung_cells_streams_move_to_the_other_and_complete_identical(tmp_path) -> None:
    """SIGSTOP one cell's scheduler under 12 streams (its connection stays open, nothing
    answers): past --scheduler-timeout (5 s) the gateway routes around it and moves the requests
    it held; every stream completes token for token as in an undisturbed run."""
    settings = two_cells()
    n, max_tokens = 12, 900  # 9 s or more a stream: they outlast the hang's detection
    with running_stack(settings, tmp_path) as stack:
        gw = settings.gateway
        streams, expected = streaming(gw, n, max_tokens)
        hung = stack.procs["scheduler1"]
        hung.send_signal(signal.SIGSTOP)
        try:
            outcomes = streams.join(120)
        finally:
            hung.send_signal(signal.SIGCONT)
        assert [o.code for o in outcomes] == [None] * n, {o.details for o in outcomes}
        assert [o.tokens for o in outcomes] == expected
        log = stack.log("gateway").read_text()
        assert "answers nothing (hung?): routed around" in log
        moved = re.findall(r"request (\w+): cell \S+ lost \(UNAVAILABLE\); resubmitting", log)
        assert moved and len(moved) == len(set(moved)) < n
