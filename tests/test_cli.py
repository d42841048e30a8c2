"""The `llmserve` command as a person meets it: help on every flag, one-line errors, Ctrl-C,
generate's --system and stdin prompt, status through the gateway."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from llmcommon.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from llmserve import client
from llmserve.cli import build_parser
from scheduler_svc.config import BatchMode, KvPolicy

ROOT = Path(__file__).resolve().parent.parent
LLMSERVE = [sys.executable, "-c", "from llmserve.cli import main; main()"]


def run_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LLMSERVE, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, **kwargs
    )


def subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_every_flag_of_up_has_help_and_the_string_settings_show_their_choices() -> None:
    up = subparser("up")
    flags = [a for a in up._actions if a.option_strings and a.dest != "help"]
    assert [a.dest for a in flags if not (a.help or "").strip()] == []
    choices = {a.dest: a.choices for a in flags if a.choices}
    assert set(choices["policy"]) == {p.value for p in KvPolicy}
    assert set(choices["mode"]) == {m.value for m in BatchMode}
    assert set(choices["dtype"]) == {"bf16", "fp32"}
    assert "{reserve,paged}" in up.format_help() and "cuda:N" in up.format_help()


def test_a_bad_flag_prints_one_line_and_no_traceback() -> None:
    for args in (["up", "--no-such-flag"], ["up", "--policy", "lru"], ["generate"]):
        done = run_cli(*args)
        assert done.returncode == 2, done
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "error:" in done.stderr and "Traceback" not in done.stderr


class FakeGateway(gateway_pb2_grpc.GatewayServicer):
    """Records each request; answers "ok" at once, or holds the stream until released."""

    def __init__(self, hold: bool = False) -> None:
        self.requests: list[gateway_pb2.GenerateRequest] = []
        self.arrived, self.release, self.hold = threading.Event(), threading.Event(), hold
        self.metadata: list[dict[str, str]] = []

    def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        self.arrived.set()
        if self.hold:
            self.release.wait(30)
        yield gateway_pb2.GenerateResponse(delta=gateway_pb2.TokenDelta(text="ok"))
        final = gateway_pb2.Final(request_id="r1", finish_reason=common_pb2.FINISH_REASON_STOP)
        yield gateway_pb2.GenerateResponse(final=final)


@pytest.fixture
def fake_gateway(request):
    servicer = FakeGateway(hold=getattr(request, "param", False))
    server = grpc.server(futures.ThreadPoolExecutor(4))
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    servicer.release.set()
    server.stop(0)


def test_generate_reads_the_prompt_from_stdin_and_sends_system_then_user(fake_gateway) -> None:
    servicer, target = fake_gateway
    done = run_cli(
        "generate", "--target", target, "--prompt", "-", "--system", "Be brief.",
        "--api-key", "k1", input="What is 2+2?\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok") and "[stop;" in done.stderr
    messages = [(m.role, m.content) for m in servicer.requests[0].chat.messages]
    assert messages == [("system", "Be brief."), ("user", "What is 2+2?\n")]
    assert servicer.metadata[0]["authorization"] == "Bearer k1"


def test_generate_sends_priority_and_slo_class_only_when_given(fake_gateway) -> None:
    servicer, target = fake_gateway
    asked = ["--priority", "-2", "--slo-class", "interactive"]
    for flags in (asked, []):
        done = run_cli("generate", "--target", target, "--prompt", "hi", *flags)
        assert done.returncode == 0, done.stderr
    given, plain = servicer.requests
    assert (given.HasField("priority"), given.priority, given.slo_class) == (
        True,
        -2,
        "interactive",
    )
    assert (plain.HasField("priority"), plain.slo_class) == (False, "")


def test_up_passes_the_keys_file_and_classes_to_the_gateway_and_the_policy_to_the_scheduler(
    tmp_path,
) -> None:
    from llmserve.stack import Stack, StackSettings

    settings = StackSettings(
        api_keys_file="keys.txt", slo_classes="batch=ttft:60", queue_policy="fair"
    )
    commands = Stack(settings, tmp_path).commands()
    gateway, scheduler = commands["gateway"], commands["scheduler"]
    at = gateway.index("--api-keys-file")
    assert gateway[at + 1] == os.path.abspath("keys.txt")
    assert gateway[gateway.index("--slo-classes") + 1] == "batch=ttft:60"
    assert scheduler[scheduler.index("--queue-policy") + 1] == "fair"
    plain = Stack(StackSettings(), tmp_path).commands()["gateway"]
    assert "--api-keys-file" not in plain and "--slo-classes" not in plain


@pytest.mark.parametrize("fake_gateway", [True], indirect=True)
def test_ctrl_c_during_generate_prints_one_line_and_no_traceback(fake_gateway) -> None:
    servicer, target = fake_gateway
    child = subprocess.Popen(
        [*LLMSERVE, "generate", "--target", target, "--prompt", "hi"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert servicer.arrived.wait(30), "the request never reached the gateway"
        os.kill(child.pid, signal.SIGINT)
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 130
    assert err.strip() == "interrupted" and "Traceback" not in err


def test_status_and_generate_take_the_same_gateway_flags() -> None:
    for name in ("generate", "status"):
        dests = {a.dest for a in subparser(name)._actions}
        assert {"target", "api_key", "tls_ca"} <= dests, name
    assert subparser("status").get_default("target") == subparser("generate").get_default("target")


def test_chat_request_puts_the_system_message_first() -> None:
    request = client.chat_request("hi", system="sys", max_tokens=3)
    assert [(m.role, m.content) for m in request.chat.messages] == [
        ("system", "sys"),
        ("user", "hi"),
    ]
    assert request.sampling.max_tokens == 3
    assert client.chat_request("raw text").prompt == "raw text"


def _up_commands(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """What `llmserve up ARGV` would start: the scheduler's, worker 0's and the gateway's
    command lines."""
    from llmcommon.flags import from_args
    from llmserve.stack import Stack, StackSettings

    stack = Stack(from_args(StackSettings, build_parser().parse_args(["up", *argv])), ROOT)
    return stack.scheduler_command(0), stack.worker_command(0, 1), stack.gateway_command()


def _value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_up_passes_on_the_services_own_variables(monkeypatch) -> None:
    """`up` passes every setting as a flag, which wins over a variable in the service: so each
    setting of `up` reads the variable of the service it goes to (a speculation sweep found
    $LLMSERVE_SCHEDULER_SPECULATIVE=ngram ignored under `up`). A flag of `up` still wins, and
    `up`'s own --workers (a count) reads no scheduler variable (addresses there)."""
    monkeypatch.setenv("LLMSERVE_SCHEDULER_SPECULATIVE", "ngram")
    monkeypatch.setenv("LLMSERVE_SCHEDULER_OVERLAP", "false")
    monkeypatch.setenv("LLMSERVE_WORKER_DTYPE", "fp32")
    monkeypatch.setenv("LLMSERVE_GATEWAY_DEFAULT_MAX_TOKENS", "77")
    monkeypatch.setenv("LLMSERVE_SCHEDULER_WORKERS", "127.0.0.1:1,127.0.0.1:2")
    scheduler, worker, gateway = _up_commands(["--model", "sim"])
    assert _value(scheduler, "--speculative") == "ngram" and "--no-overlap" in scheduler
    assert _value(worker, "--dtype") == "fp32"
    assert _value(gateway, "--default-max-tokens") == "77"
    assert _value(scheduler, "--workers") == "127.0.0.1:50061"  # one worker, up's own port
    scheduler, _, _ = _up_commands(["--model", "sim", "--speculative", "suffix"])
    assert _value(scheduler, "--speculative") == "suffix"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("LLMSERVE_SCHEDULER_TOKEN_BUDGET", "lots"),  # not a number
        ("LLMSERVE_SCHEDULER_MAX_RUNNING", "-3"),  # a number the setting refuses
        ("LLMSERVE_GATEWAY_ROUTER", "bogus"),  # the gateway's check, before anything starts
    ],
)
def test_a_bad_variable_stops_up_in_one_line_naming_it(variable, value) -> None:
    """(A refused number had not named the variable, and a bad router had stopped `up` only
    once the gateway refused it, after the workers and the scheduler had started.)"""
    done = run_cli("up", "--model", "sim", env={**os.environ, variable: value})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"${variable}" in lines[0], done.stderr
