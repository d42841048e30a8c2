"""Sizing the KV pool from memory (no --kv-capacity): measure what the weights take and what a
forward pass at the token budget adds at its peak, then give the pool what is left of
--memory-fraction of the device (kv_sizing.MemoryPlan)."""

from __future__ import annotations

import logging

import torch

from worker_svc.device import MemoryProbe, device_memory
from worker_svc.kv_pool import position_bytes
from worker_svc.kv_sizing import MemoryPlan
from worker_svc.model_config import ModelConfig
from worker_svc.quant import dense_dtype, is_quantized
from worker_svc.weights import Weights
from worker_svc.work import WorkItem

log = logging.getLogger("worker")


def weights_bytes(weights: Weights) -> int:
    """Quantized matrices: codes and scales, and the dense copy of those kept in both forms
    (--quantization auto: worker_svc.linear.dual_linear)."""
    tensors = {id(t): t for t in _tensors(weights)}  # a tied lm_head counts once
    return sum(t.nbytes + dense_copy_bytes(t) for t in tensors.values())


def dense_copy_bytes(matrix) -> int:
    if not is_quantized(matrix) or not matrix.keep_dense:
        return 0
    return matrix.numel() * torch.empty((), dtype=dense_dtype(matrix)).element_size()


def _tensors(weights: Weights) -> list[torch.Tensor]:
    out = [weights.embed, weights.final_norm, weights.lm_head]
    if weights.lm_head_int8 is not None:
        head = weights.lm_head_int8
        out += [head.codes, head.scales, *([head.blocked] if head.blocked is not None else [])]
    for layer in weights.layers:
        out += [layer.attn_norm, layer.qkv, layer.o, layer.mlp_norm, layer.gate_up, layer.down]
        out += layer.biases()
    return out


def bytes_per_position(config: ModelConfig, dtype: torch.dtype, cache_dtype: str = "auto") -> int:
    return position_bytes(config, dtype, cache_dtype)


def profile_blocks(tokens: int, block_size: int) -> int:
    """The pool a runner needs for the profiled forward (it is resized afterwards)."""
    return -(-tokens // block_size)


def profile_forward(runner, tokens: int, block_size: int, device: torch.device) -> int:
    """Peak bytes a forward of `tokens` prompt tokens adds, on a runner whose pool holds just
    that prompt (profile_blocks)."""
    blocks = profile_blocks(tokens, block_size)
    item = WorkItem("profile", [1] * tokens, 0, list(range(blocks)))
    with MemoryProbe(device) as probe:
        runner.execute([item])
    return probe.peak


def pool_positions(
    config: ModelConfig,
    weights: Weights,
    dtype: torch.dtype,
    device: torch.device,
    settings,  # WorkerSettings
    runner,  # ModelRunner, its pool of profile_blocks(settings.profile_tokens)
    used_before: int = 0,
) -> int:
    """The KV positions the pool gets; the figures go to the log."""
    free, total = device_memory(device, int(settings.cpu_memory_gib * 2**30))
    tokens = min(settings.profile_tokens, config.max_context)
    plan = MemoryPlan(
        total=total,
        used_before=used_before,
        weights=weights_bytes(weights),
        activation_peak=profile_forward(runner, tokens, settings.block_size, device),
        fraction=settings.memory_fraction,
    )
    per_position = bytes_per_position(config, dtype, settings.kv_cache_dtype)
    positions = plan.positions(per_position, settings.block_size)
    log.info(
        "KV pool sized from memory: %.0f%% of %.0f MiB, minus %.0f MiB in use, %.0f MiB of "
        "weights and a %.0f MiB peak forward of %d tokens: %d positions",
        100 * plan.fraction, total / 2**20, used_before / 2**20, plan.weights / 2**20,
        plan.activation_peak / 2**20, tokens, positions,
    )  # fmt: skip
    return positions
