"""The gateway's optional API key and TLS, through a real gateway process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import grpc
import pytest

from llmcommon.server import wait_healthy
from llmserve import client
from tests.stacks import free_port, running_stack, tiny_settings


def start_gateway(settings, port: int, extra: list[str], env: dict, log) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "gateway",
        "--port",
        str(port),
        "--scheduler",
        settings.scheduler,
        *extra,
    ]
    return subprocess.Popen(cmd, env=os.environ | env, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tiny_settings(), tmp_path_factory.mktemp("sec")) as s:
        yield s


def request():
    return client.make_request(prompt="hi", max_tokens=3, temperature=0.0)


def test_api_key_is_required_when_set(stack, tmp_path) -> None:
    port = free_port()
    with open(tmp_path / "gw.log", "w") as log:
        proc = start_gateway(stack.settings, port, [], {"LLMSERVE_API_KEY": "s3cret"}, log)
        try:
            asyncio.run(wait_healthy(f"127.0.0.1:{port}", timeout=60))  # health stays open
            target = f"127.0.0.1:{port}"
            for key in ("", "wrong"):
                with pytest.raises(grpc.RpcError) as err:
                    list(client.stream(target, request(), timeout=10, api_key=key))
                assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
                assert "API key" in err.value.details()
            done = list(client.stream(target, request(), timeout=10, api_key="s3cret"))
            assert done[-1].final.usage.completion_tokens == 3
        finally:
            proc.terminate()
            assert proc.wait(20) == 0


def refused_start(key_file: str) -> subprocess.CompletedProcess:
    """A gateway started with `key_file` (its scheduler is never reached): how it ended."""
    cmd = [sys.executable, "-m", "gateway", "--port", str(free_port()), "--scheduler",
           "127.0.0.1:9", "--api-key-file", key_file]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("content", ["", " \n"], ids=["empty", "blank"])
def test_an_empty_api_key_file_stops_the_gateway_instead_of_serving_everyone(
    tmp_path, content
) -> None:
    key = tmp_path / "key"
    key.write_text(content)
    ended = refused_start(str(key))
    assert ended.returncode != 0
    assert f"the API key file {key} is empty" in ended.stderr


def test_an_unreadable_api_key_file_stops_the_gateway(tmp_path) -> None:
    ended = refused_start(str(tmp_path / "missing"))
    assert ended.returncode != 0
    assert "cannot read the API key file" in ended.stderr
    assert "No such file or directory" in ended.stderr


def make_cert(tmp_path) -> tuple[str, str]:
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key,
            "-out",
            cert,
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_tls_gateway_serves_tls_clients_only(stack, tmp_path) -> None:
    cert, key = make_cert(tmp_path)
    port = free_port()
    with open(tmp_path / "gw.log", "w") as log:
        proc = start_gateway(stack.settings, port, ["--tls-cert", cert, "--tls-key", key], {}, log)
        try:
            target = f"localhost:{port}"
            done = None
            for _ in range(200):
                try:
                    done = list(client.stream(target, request(), timeout=5, tls_ca=cert))
                    break
                except grpc.RpcError:
                    time.sleep(0.1)
            assert done is not None and done[-1].final.usage.completion_tokens == 3
            with pytest.raises(grpc.RpcError):
                list(client.stream(target, request(), timeout=5))  # plaintext is refused
        finally:
            proc.terminate()
            assert proc.wait(20) == 0
