"""The runner on another device than the CPU, through the same code as on CUDA: the KV pool,
weights, RoPE tables, plan and input tensors all go to the runner's device. On PyTorch's "meta"
device every operation checks that its tensors share a device but computes nothing, so a tensor
made on the CPU by mistake fails this test here, as it would fail on a GPU."""

from __future__ import annotations

import torch

from worker_svc.loader import tiny_model
from worker_svc.runner import ModelRunner
from worker_svc.work import WorkItem


def test_every_tensor_of_a_mixed_step_lives_on_the_runners_device() -> None:
    config, weights = tiny_model(torch.float32)
    runner = ModelRunner(config, weights, 16, 16, torch.float32, device="meta")
    assert runner.pool.k.device.type == "meta" and runner.model.rope.cos.device.type == "meta"
    items = [
        WorkItem("prompt", [1, 2, 3, 4, 5], 0, [0]),  # a fresh prompt
        WorkItem("decode", [7], 20, [1, 2]),  # a decode over 21 cached positions
        WorkItem("chunk", [8, 9, 10], 16, [3, 4]),  # a chunk after 16 cached positions
    ]
    logits = runner.compute_logits(items)
    assert logits.device.type == "meta" and tuple(logits.shape) == (3, config.vocab_size)
    assert runner.compute_logits(items, all_positions=True).shape[0] == 9


def test_a_cpu_runner_keeps_everything_on_the_cpu_and_its_outputs() -> None:
    config, weights = tiny_model(torch.float32)
    default = ModelRunner(config, weights, 16, 16, torch.float32)
    explicit = ModelRunner(config, weights, 16, 16, torch.float32, device="cpu")
    items = [WorkItem("a", [1, 2, 3], 0, [0])]
    assert torch.equal(default.compute_logits(items), explicit.compute_logits(items))
    assert explicit.pool.k.device.type == "cpu" and explicit.model.weights is weights
