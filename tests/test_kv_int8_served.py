"""--kv-cache-dtype int8 through `llmserve up`: the stack passes it to its worker, whose pool holds
int8 codes (its log says so, and the bytes a position takes), and SmolLM2 answers a chat question
as over a bf16 pool (tests/test_kv_int8_accuracy.py checks the distributions in-process)."""

from __future__ import annotations

import grpc
import pytest

from llmcommon.server import CHANNEL_OPTIONS
from llmcommon.v1 import gateway_pb2_grpc
from llmserve import client
from tests.stacks import running_stack, tiny_settings

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]


def test_stack_serves_smollm2_over_an_int8_pool(tmp_path) -> None:
    settings = tiny_settings(
        model="smollm2", dtype="bf16", kv_cache_dtype="int8", kv_capacity=1024, token_budget=64,
        prefix_caching=False,
    )  # fmt: skip
    with running_stack(settings, tmp_path) as stack:
        command = stack.worker_command(0, settings.worker_base_port)
        assert command[command.index("--kv-cache-dtype") + 1] == "int8"
        with grpc.insecure_channel(stack.settings.gateway, options=CHANNEL_OPTIONS) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            texts = []
            # each a prompt step, then decode steps over the pool; without prefix caching, so
            # that the second computes its prompt as the first did (a hit would read the first's
            # prompt from the pool in int8: at a near-tie, as this question's first token is,
            # that can change the answer: docs/models.md)
            for stream in (False, True):
                request = client.make_request(
                    messages=[("user", "What is the capital of France?")],
                    max_tokens=12,
                    temperature=0.0,
                )
                if stream:
                    replies = stub.Generate(request, timeout=120)
                    texts.append("".join(r.delta.text for r in replies if r.HasField("delta")))
                else:
                    texts.append(stub.GenerateUnary(request, timeout=120).text)
    assert all("Paris" in text for text in texts), texts
    assert texts[0] == texts[1]
    log = "\n".join(p.read_text() for p in tmp_path.glob("worker*"))
    # SmolLM2: 30 layers x K and V x 3 KV heads x (64 codes + a 4-byte scale)
    assert f"{30 * 2 * 3 * (64 + 4)} bytes per position" in log
    assert "KV pool int8" in log
