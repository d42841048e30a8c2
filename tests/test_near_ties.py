"""Logits near a row's maximum made exact (worker_svc/near_ties.py): greedy does not pick between
near-equal tokens by how a step's bf16 rounding fell. The demo's own case: SmolLM2's first token
for "What is the capital of France?" is "The" computed alone, and stays "The" when the prompt's
first block comes from another request's cached KV (it read "L" there before: a French ramble)."""

from __future__ import annotations

import functools

import pytest
import torch

from gateway.tokenizer import load_default_tokenizer
from llmserve.demo_questions import QUESTIONS
from tests.model_support import one_torch_thread  # noqa: F401  (autouse fixture)
from worker_svc import cpu_kernels
from worker_svc.loader import load_model
from worker_svc.near_ties import NEAR, refine_near_max
from worker_svc.runner import ModelRunner
from worker_svc.work import GREEDY, WorkItem


def test_entries_near_the_maximum_get_their_fp32_value_and_the_rest_stay() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 64).to(torch.bfloat16)
    weight = torch.randn(500, 64).to(torch.bfloat16)
    exact = hidden.float() @ weight.float().t()
    rounded = exact.to(torch.bfloat16).float()
    logits = rounded.clone()
    refine_near_max(logits, hidden, weight)
    top = rounded.max(dim=-1, keepdim=True).values
    near = rounded >= top - top.abs().clamp_min(1.0) * NEAR
    assert near.sum() > 3  # a few per row
    assert torch.allclose(logits[near], exact[near], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[~near], rounded[~near])
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))


def test_a_tie_in_bf16_goes_to_the_larger_exact_value() -> None:
    hidden = torch.ones(1, 32, dtype=torch.bfloat16)
    weight = torch.zeros(4, 32, dtype=torch.bfloat16)
    weight[1, 0], weight[1, 1] = 25.0, 0.3671875  # 25.3671875
    weight[2, 0], weight[2, 1] = 25.0, 0.375  # 25.375: the larger, after index 1
    weight[3, 0] = 3.0
    logits = (hidden.float() @ weight.float().t()).to(torch.bfloat16).float()
    assert logits[0, 1] == logits[0, 2]  # equal in bf16: argmax would take index 1
    refine_near_max(logits, hidden, weight)
    assert int(logits.argmax()) == 2 and logits[0, 3] == 3.0


def test_the_c_kernel_refines_as_the_torch_form_does() -> None:
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no fused CPU kernels here (no C compiler)")
    torch.manual_seed(1)
    hidden = (3 * torch.randn(5, 96)).to(torch.bfloat16)
    weight = torch.randn(1000, 96).to(torch.bfloat16)
    rounded = (hidden.float() @ weight.float().t()).to(torch.bfloat16).float()
    ours, theirs = rounded.clone(), rounded.clone()
    kernels.set_threads(torch.get_num_threads())
    assert kernels.refine_near_max(ours, hidden, weight, NEAR)
    refine_near_max(theirs, hidden, weight)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    assert not torch.equal(ours, rounded)


@functools.cache
def chat_ids(question: str) -> list[int]:
    tok = load_default_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": question}], ())
    return tok.encode(text, add_special_tokens=False)


def test_the_demos_first_token_is_the_same_alone_and_from_another_requests_cached_block() -> None:
    config, weights = load_model("smollm2", torch.bfloat16, "auto")
    france, colors = chat_ids(QUESTIONS[0]), chat_ids(QUESTIONS[1])
    assert france[:16] == colors[:16]  # one full block of the chat template in common
    runner = ModelRunner(config, weights, 64, 16, torch.bfloat16)
    alone = runner.execute([WorkItem("a", france, 0, [10, 11, 12], True, GREEDY, 0)])[0]
    runner.execute([WorkItem("b", colors, 0, [0, 1, 2], True, GREEDY, 0)])
    cached = runner.execute([WorkItem("c", france[16:], 16, [0, 3, 4], True, GREEDY, 0)])[0]
    assert load_default_tokenizer().decode([alone]) == "The"
    assert cached == alone
