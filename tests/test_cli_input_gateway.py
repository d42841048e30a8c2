"""`llmserve` against a stand-in gateway (in this process, on a free port): output into a pipe
whose reader has gone is no traceback; `status --admin-key-file` sends the admin key on the
Status call; `status --json` leaves withheld prefix-cache figures out rather than report 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gateway import service as gateway_service
from llmcommon.admin_auth import ADMIN_KEY_HEADER
from llmcommon.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from llmserve import client

ROOT = Path(__file__).resolve().parent.parent
LLMSERVE = [sys.executable, "-c", "from llmserve.cli import main; main()"]
ADMIN_KEY = "admin-key-of-the-test-0123456789"
TOTALS = ("prompt_tokens", "hit_tokens", "evictions")  # the reply's, withheld with the workers'


def figures_reply() -> scheduler_pb2.StatusReply:
    """A Status reply whose every prefix-cache figure is set (not 0)."""
    reply = scheduler_pb2.StatusReply(
        policy="paged", mode="continuous", model="sim", prefix_caching=True, steps=9,
        prompt_tokens=640, hit_tokens=320, evictions=4,
    )  # fmt: skip
    reply.workers.add(
        name="worker0", healthy=True, capacity=4096, written=64, cached_blocks=12,
        evictable_blocks=5, evictions=4, prompt_tokens=640, hit_tokens=320,
    )  # fmt: skip
    reply.cells.add(address="127.0.0.1:1", up=True, prompt_tokens=640, hit_tokens=320)
    return reply


def withheld_reply() -> scheduler_pb2.StatusReply:
    """What the gateway sends an ordinary client: the real gateway's withholding."""
    reply = figures_reply()
    gateway_service.withhold_cache_figures(reply)
    return reply


class FakeGateway(gateway_pb2_grpc.GatewayServicer, scheduler_pb2_grpc.AdminServicer):
    """Status (the reply it is given), Generate (a long text), GetSettings; records Status's
    metadata."""

    def __init__(self) -> None:
        self.reply = figures_reply()
        self.status_metadata: list[dict[str, str]] = []

    def Status(self, request, context):  # noqa: N802 (the servicer's name)
        self.status_metadata.append(dict(context.invocation_metadata()))
        return self.reply

    def Generate(self, request, context):  # noqa: N802
        for _ in range(50):
            yield gateway_pb2.GenerateResponse(delta=gateway_pb2.TokenDelta(text="word " * 100))
        final = gateway_pb2.Final(request_id="r1", finish_reason=common_pb2.FINISH_REASON_STOP)
        yield gateway_pb2.GenerateResponse(final=final)

    def GetSettings(self, request, context):  # noqa: N802
        return scheduler_pb2.Settings(settings=[scheduler_pb2.Setting(name="a", value="1")])


@pytest.fixture
def fake_gateway():
    servicer = FakeGateway()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    scheduler_pb2_grpc.add_AdminServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "admin-key"
    path.write_text(ADMIN_KEY + "\n")
    path.chmod(0o600)
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*LLMSERVE, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


# ---- a reader that left (`llmserve status | head -1`) ------------------------------------------


def into_a_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """Run with stdout a pipe whose read end is closed before the command starts: every write
    meets EPIPE, however fast or slow the host (no race with a reader that leaves)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [*LLMSERVE, *args], cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True,
            timeout=60,
        )  # fmt: skip
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["status", "--json"],
        ["get", "--admin-key-file", "KEY"],
        ["generate", "--prompt", "hi"],
        ["generate", "--prompt", "hi", "--json"],
    ],
)
def test_output_into_a_closed_pipe_exits_141_without_a_traceback(
    fake_gateway, key_file, command
) -> None:
    """141 = 128 + SIGPIPE: what a shell shows for a C tool that wrote into a closed pipe."""
    _, target = fake_gateway
    command = [str(key_file) if a == "KEY" else a for a in command]
    done = into_a_closed_pipe(*command, "--target", target)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 141, (done.returncode, done.stderr)
    assert done.stderr == ""  # nothing to say: the reader has what it wanted


# ---- status: the admin key, and withheld figures ------------------------------------------------


def test_status_with_an_admin_key_file_sends_the_key_on_the_status_call(
    fake_gateway, key_file
) -> None:
    """The gateway shows the operator (a valid admin key) the prefix-cache figures: without
    --explain too, the key must reach it."""
    servicer, target = fake_gateway
    for flags in ([], ["--json"], ["--explain"]):
        done = run_cli("status", "--target", target, "--admin-key-file", str(key_file), *flags)
        assert done.returncode == 0, done.stderr
    assert [m.get(ADMIN_KEY_HEADER) for m in servicer.status_metadata] == [ADMIN_KEY] * 3
    done = run_cli("status", "--target", target, "--api-key", "k1")
    assert done.returncode == 0, done.stderr
    assert ADMIN_KEY_HEADER not in servicer.status_metadata[-1]  # no key file, no key
    assert servicer.status_metadata[-1]["authorization"] == "Bearer k1"


def test_status_json_leaves_withheld_cache_figures_out_instead_of_reporting_0(
    fake_gateway,
) -> None:
    servicer, target = fake_gateway
    done = run_cli("status", "--target", target, "--json")  # not withheld: all there
    assert done.returncode == 0, done.stderr
    s = json.loads(done.stdout)
    assert not s["cache_figures_withheld"]
    assert (s["prompt_tokens"], s["hit_tokens"], s["evictions"]) == (640, 320, 4)
    assert s["workers"][0]["cached_blocks"] == 12 and s["cells"][0]["hit_tokens"] == 320

    servicer.reply = withheld_reply()
    done = run_cli("status", "--target", target, "--json")
    assert done.returncode == 0, done.stderr
    s = json.loads(done.stdout)
    assert s["cache_figures_withheld"] is True and s["prefix_caching"] is True
    assert not set(TOTALS) & set(s), s
    (worker,) = s["workers"]
    assert not set(client.CACHE_FIGURES) & set(worker), worker
    assert worker["capacity"] == 4096 and worker["written"] == 64  # the rest stays
    (cell,) = s["cells"]
    assert not {"prompt_tokens", "hit_tokens"} & set(cell) and cell["up"] is True
    text = run_cli("status", "--target", target)
    assert text.returncode == 0 and "prefix cache: on" in text.stdout, text.stderr


def test_status_dict_leaves_out_every_figure_the_gateway_withholds() -> None:
    """Whatever withhold_cache_figures clears (now or after a change to it) is left out, not
    reported as 0, in total, per worker and per cell."""
    assert client.CACHE_FIGURES == gateway_service.CACHE_FIGURES
    full, cleared = client.status_dict(figures_reply()), client.status_dict(withheld_reply())

    def zeroed(before: dict, after: dict) -> list[str]:
        keys = [k for k, v in before.items() if isinstance(v, int | float) and v]
        return [k for k in keys if k in after and not after[k] and k != "cache_figures_withheld"]

    assert zeroed(full, cleared) == []
    assert zeroed(full["workers"][0], cleared["workers"][0]) == []
    assert zeroed(full["cells"][0], cleared["cells"][0]) == []
