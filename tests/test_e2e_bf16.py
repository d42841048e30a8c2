"""bf16, the serving dtype, through a whole stack: the other stack tests run fp32, so the fused CPU
decode kernels (worker_svc/cpu_kernels.c), which take every decode-only bf16 step, run end to end
only here. Requests decoding together get the greedy tokens the plain torch path gives each
alone, in-process."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from llmcommon.server import CHANNEL_OPTIONS
from llmcommon.v1 import gateway_pb2_grpc
from llmserve import client
from tests.model_support import model, one_torch_thread, prompt_ids, run_alone  # noqa: F401
from tests.stacks import running_stack, tiny_settings
from worker_svc import cpu_kernels
from worker_svc.runner import ModelRunner

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("hang_guard"),
    pytest.mark.skipif(
        cpu_kernels.load() is None,
        reason="no C compiler: the fused kernels are not built and the worker runs its torch path",
    ),
]
PROMPTS = ["Hello", "The story goes", "def fibonacci(n):", "Once upon a time"]
STEPS = 24


def torch_path(text: str) -> tuple[int, list[int]]:
    """(prompt tokens, greedy tokens) of `text` alone on the unfused bf16 path."""
    config, weights = model("tiny", torch.bfloat16)
    runner = ModelRunner(config, weights, 64, 16, dtype=torch.bfloat16, use_kernels=False)
    assert runner.model.kernels is None
    ids = prompt_ids(text)
    _, out = run_alone(runner, ids, list(range(-(-(len(ids) + STEPS) // 16))), len(ids), STEPS)
    return len(ids), out


def test_bf16_stack_decodes_through_the_fused_kernels_as_the_torch_path_does(tmp_path) -> None:
    settings = tiny_settings(dtype="bf16", kv_capacity=1024, block_size=16, token_budget=64)
    with running_stack(settings, tmp_path) as stack:
        with grpc.insecure_channel(stack.settings.gateway, options=CHANNEL_OPTIONS) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)

            def generate(text: str):
                request = client.make_request(
                    prompt=text, max_tokens=STEPS, temperature=0.0, ignore_eos=True
                )
                return stub.GenerateUnary(request, timeout=120)

            with ThreadPoolExecutor(len(PROMPTS)) as pool:  # they decode in shared steps
                results = list(pool.map(generate, PROMPTS))
    for text, result in zip(PROMPTS, results, strict=True):
        prompt_tokens, expected = torch_path(text)
        assert result.usage.prompt_tokens == prompt_tokens, text
        assert list(result.token_ids) == expected, text
