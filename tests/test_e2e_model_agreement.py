"""One model setting for the whole stack, with real processes: a gateway takes its tokenizer
from the model the workers serve, refuses to start when told another model, and keeps out a
worker that serves another vocabulary (the scheduler refuses it when it registers)."""

from __future__ import annotations

import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve import client
from llmserve.ports import free_port
from tests.hf_dirs import qwen2_style, save_hf_model
from tests.stack_checks import wait_for
from tests.stacks import running_stack, tiny_settings

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]
# token ids below 400: the scheduler keeps a departed worker's vocabulary as a bound for prompts
REQUEST = dict(prompt="1 2 3", max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    settings = tiny_settings(kv_capacity=512, block_size=16)
    with running_stack(settings, tmp_path_factory.mktemp("logs")) as stack:
        yield stack


def gateway_command(stack, *flags: str) -> list[str]:
    port = str(free_port())
    return [sys.executable, "-m", "gateway", "--port", port, "--scheduler",
            stack.settings.scheduler, *flags]  # fmt: skip


def completion_tokens(target: str) -> int:
    replies = list(client.stream(target, client.make_request(**REQUEST), timeout=30))
    return replies[-1].final.usage.completion_tokens


def serving(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        request = health_pb2.HealthCheckRequest()
        reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_gateway_told_another_model_than_the_workers_refuses_to_start_in_one_line(stack):
    ended = subprocess.run(
        gateway_command(stack, "--model", "smollm2"), capture_output=True, text=True, timeout=120
    )
    assert ended.returncode != 0
    last = ended.stderr.strip().splitlines()[-1]
    assert last == (
        "the gateway cannot serve these workers: the workers serve 'tiny' but this gateway "
        "tokenizes for 'SmolLM2-135M-Instruct': give the gateway and the workers the same --model"
    )
    assert "Traceback" not in ended.stderr


def test_a_model_the_gateway_cannot_read_stops_it_in_one_line(stack, tmp_path):
    missing = str(tmp_path / "absent.gguf")
    ended = subprocess.run(
        gateway_command(stack, "--model", missing), capture_output=True, text=True, timeout=120
    )
    assert ended.returncode != 0 and "Traceback" not in ended.stderr
    last = ended.stderr.strip().splitlines()[-1]
    assert last.startswith(f"cannot read the tokenizer of --model {missing}: [Errno 2] No such")


def test_a_gateway_not_told_the_model_serves_the_workers_one(stack, tmp_path):
    command = gateway_command(stack)
    target = f"127.0.0.1:{command[command.index('--port') + 1]}"
    with open(tmp_path / "gateway.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: proc.poll() is not None or serving_or_not(target), 60, "gateway up")
        assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
        assert completion_tokens(target) == 3
        assert "model tiny (--model tiny)" in (tmp_path / "gateway.log").read_text()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def serving_or_not(target: str) -> bool:
    try:
        return serving(target)
    except grpc.RpcError:
        return False


def test_a_worker_of_another_vocabulary_stays_out_and_the_stack_serves_on(stack, tmp_path):
    """A random Qwen2 with a 400-token vocabulary in a directory named `tiny`: the same name as
    the stack's model, another vocabulary. The scheduler refuses it when it registers, naming
    why, and the worker says so; the gateway serves on with the stack's worker. (It had
    joined, and the gateway then refused every request until it left.)"""
    directory = qwen2_style(tmp_path / "tiny")
    shape = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    save_hf_model("qwen2", {**shape, "vocab_size": 400}, directory)
    gateway = stack.settings.gateway
    name = stack.join_worker(1, free_port(), "--model", str(directory), "--kv-capacity", "256")
    says = "describes vocab_size 400 where the stack's workers have 49152 (another model?)"
    worker_log = stack.log(name)
    wait_for(lambda: says in worker_log.read_text(), 30, "the worker told it stays out")
    assert says in stack.log("scheduler").read_text()
    assert serving(gateway) and completion_tokens(gateway) == 3
    assert [w.name for w in client.status(stack.settings.scheduler).workers] == ["worker0"]
    stack.procs[name].send_signal(signal.SIGTERM)
    assert stack.procs[name].wait(60) == 0


def test_a_scheduler_listing_workers_of_two_vocabularies_stops_in_one_line(stack, tmp_path):
    """At the start too (--workers): the second worker's vocabulary is not the first's, and
    the scheduler says so and stops (it had served both, and every prompt looked out of one's
    vocabulary or the other's)."""
    directory = qwen2_style(tmp_path / "tiny")
    shape = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    save_hf_model("qwen2", {**shape, "vocab_size": 400}, directory)
    port = free_port()
    name = stack.join_worker(
        2, port, "--model", str(directory), "--kv-capacity", "256", register=False
    )
    workers = f"{stack.settings.worker_address(0)},127.0.0.1:{port}"
    command = [sys.executable, "-m", "scheduler_svc", "--port", str(free_port()),
               "--workers", workers]  # fmt: skip
    try:
        ended = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        stack.procs[name].send_signal(signal.SIGTERM)
        assert stack.procs[name].wait(60) == 0
    assert ended.returncode != 0 and "Traceback" not in ended.stderr
    assert ended.stderr.strip().splitlines()[-1] == (
        f"worker 127.0.0.1:{port} describes vocab_size 400 where the stack's workers have "
        "49152 (another model?)"
    )


def test_a_gateway_whose_scheduler_comes_back_with_another_vocabulary_stops_serving(tmp_path):
    """The live check (gateway/__main__.py follow_workers): the scheduler restarts over a
    worker of another vocabulary (a model of the same name); the gateway turns NOT_SERVING and
    refuses requests naming why, and serves again once the stack's model is back."""
    directory = qwen2_style(tmp_path / "tiny")
    shape = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    save_hf_model("qwen2", {**shape, "vocab_size": 400}, directory)
    settings = tiny_settings(kv_capacity=512, block_size=16)
    with running_stack(settings, tmp_path / "logs") as stack:
        port = free_port()
        other = stack.join_worker(
            1, port, "--model", str(directory), "--kv-capacity", "256", register=False
        )
        stack.procs["scheduler"].terminate()
        assert stack.procs["scheduler"].wait(60) == 0
        command = [sys.executable, "-m", "scheduler_svc", "--port", str(settings.scheduler_port),
                   "--workers", f"127.0.0.1:{port}"]  # fmt: skip
        with open(tmp_path / "other_scheduler.log", "w") as log:
            replacement = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: not serving_or_not(settings.gateway), 60, "gateway NOT_SERVING")
            with pytest.raises(grpc.RpcError) as refused:
                completion_tokens(settings.gateway)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert refused.value.details() == (
                "this gateway's tokenizer has 49152 tokens but the workers' model 'tiny' has "
                "400: give the gateway the workers' --model"
            )
            assert "NOT_SERVING" in stack.log("gateway").read_text()
        finally:
            replacement.terminate()
            replacement.wait(60)
        stack.restart("scheduler")
        wait_for(lambda: serving_or_not(settings.gateway), 60, "gateway SERVING again")
        assert completion_tokens(settings.gateway) == 3
        stack.procs[other].send_signal(signal.SIGTERM)
        assert stack.procs[other].wait(60) == 0
