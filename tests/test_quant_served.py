"""--quantization through `llmserve up`: the stack passes it to its worker, which serves the
shipped SmolLM2 GGUF with its Q4_1 matrices run as int4, and a chat question gets the answer
the bf16 path gives (tests/test_quant_accuracy.py checks the distributions in-process)."""

from __future__ import annotations

import grpc
import pytest

from llmcommon.server import CHANNEL_OPTIONS
from llmcommon.v1 import gateway_pb2_grpc
from llmserve import client
from tests.stacks import running_stack, tiny_settings

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]


def test_stack_serves_smollm2_quantized_with_the_bf16_answer(tmp_path) -> None:
    settings = tiny_settings(
        model="smollm2", dtype="bf16", quantization="auto", kv_capacity=1024, token_budget=64
    )
    with running_stack(settings, tmp_path) as stack:
        command = stack.worker_command(0, settings.worker_base_port)
        assert command[command.index("--quantization") + 1] == "auto"
        with grpc.insecure_channel(stack.settings.gateway, options=CHANNEL_OPTIONS) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            request = client.make_request(
                messages=[("user", "What is the capital of France?")],
                max_tokens=12,
                temperature=0.0,
            )
            result = stub.GenerateUnary(request, timeout=120)
    assert "Paris" in result.text, result.text
    log = "\n".join(p.read_text() for p in tmp_path.glob("worker*"))
    assert "'quantization': 'auto'" in log
