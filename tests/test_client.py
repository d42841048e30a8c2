"""The Python client against a real (tiny) stack: Client and AsyncClient generate, stream and
ask the status through the gateway, with the gateway's API key."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from llmcommon.model_files import display_name
from llmserve import AsyncClient, Client
from tests.stacks import running_stack, tiny_settings

ROOT = Path(__file__).resolve().parent.parent
KEY = "client-test-key"
GREEDY = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("LLMSERVE_API_KEY", KEY)  # the gateway takes its key from the environment
    settings = tiny_settings()
    try:
        with running_stack(settings, tmp_path_factory.mktemp("logs")) as running:
            yield running
    finally:
        mp.undo()


@pytest.mark.slow
def test_client_generates_streams_and_reads_status_through_the_gateway(stack) -> None:
    with Client(stack.settings.gateway, api_key=KEY, timeout=60) as llm:
        pieces: list[str] = []
        done = llm.generate(
            "a b c", max_tokens=5, temperature=0, ignore_eos=True, on_text=pieces.append
        )
        streamed = list(llm.stream("a b c", max_tokens=5, temperature=0, ignore_eos=True))
        status = llm.status()
    assert done.finish_reason == "length" and done.usage["completion_tokens"] == 5
    assert "".join(pieces) == done.text == "".join(streamed)
    assert status["finished"] >= 2 and status["workers"][0]["name"] == "worker0"


@pytest.mark.slow
def test_async_client_matches_the_blocking_one(stack) -> None:
    async def run():
        async with AsyncClient(stack.settings.gateway, api_key=KEY, timeout=60) as llm:
            done = await llm.generate("x y", **GREEDY)
            text = [t async for t in llm.stream("x y", **GREEDY)]
            return done, text, await llm.status()

    done, text, status = asyncio.run(run())
    with Client(stack.settings.gateway, api_key=KEY, timeout=60) as llm:
        blocking = llm.generate("x y", **GREEDY)
    assert done.usage["completion_tokens"] == 5 and "".join(text) == done.text == blocking.text
    assert status["model"] == "tiny"


@pytest.mark.slow
def test_status_without_the_api_key_is_refused_by_the_gateway(stack) -> None:
    with Client(stack.settings.gateway) as llm, pytest.raises(grpc.RpcError) as refused:
        llm.status()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.slow
def test_cli_status_asks_the_gateway_at_target(stack) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from llmserve.cli import main; main()", "status", "--json",
         "--target", stack.settings.gateway, "--api-key", KEY],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["workers"][0]["address"] == stack.settings.worker_address(0)
    refused = subprocess.run(
        [sys.executable, "-c", "from llmserve.cli import main; main()", "status",
         "--target", stack.settings.gateway],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin"},
    )  # fmt: skip
    assert refused.returncode == 1 and refused.stderr.strip().startswith("error: UNAUTHENTICATED")
    wrong = subprocess.run(  # the scheduler's address: a hint, not only UNIMPLEMENTED
        [sys.executable, "-c", "from llmserve.cli import main; main()", "status",
         "--target", stack.settings.scheduler],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin"},
    )  # fmt: skip
    assert wrong.returncode == 1 and wrong.stderr.startswith("error: UNIMPLEMENTED")
    assert "the gateway?" in wrong.stderr


def test_a_models_display_name_is_its_file_or_directory_name(tmp_path) -> None:
    assert display_name(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert display_name(Path("Qwen2.5-0.5B-Instruct-f16.gguf")) == "Qwen2.5-0.5B-Instruct"
    assert display_name(Path("llama.gguf")) == "llama"
    (tmp_path / "SmolLM2-360M").mkdir()
    assert display_name(tmp_path / "SmolLM2-360M") == "SmolLM2-360M"
