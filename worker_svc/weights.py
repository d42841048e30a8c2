"""Model weights in the runner's layout: fused QKV and gate/up projections."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from worker_svc.quant import Int8Weight, QuantizedWeight, Source, fuse_matrices, is_quantized

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # HF's names, without "_proj"
Matrix = torch.Tensor | QuantizedWeight  # a projection's weight: values, or run as quantized


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Matrix  # [(heads + 2 * kv_heads) * head_dim, hidden]; q rows, then k, then v
    o: Matrix  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Matrix  # [2 * intermediate, hidden]; gate rows, then up
    down: Matrix  # [hidden, intermediate]
    # biases (Qwen2's q/k/v, Llama's attention_bias / mlp_bias); None: the projection has none
    qkv_bias: torch.Tensor | None = None  # [(heads + 2 * kv_heads) * head_dim]
    o_bias: torch.Tensor | None = None  # [hidden]
    gate_up_bias: torch.Tensor | None = None  # [2 * intermediate]
    down_bias: torch.Tensor | None = None  # [hidden]

    def biases(self) -> list[torch.Tensor]:
        found = (self.qkv_bias, self.o_bias, self.gate_up_bias, self.down_bias)
        return [b for b in found if b is not None]


@dataclass(slots=True)
class Weights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as embed when tied
    # the output matrix also as int8 codes (--quantization auto, where the file stores it
    # quantized): steps of a few logit rows read half of bf16's bytes (worker_svc.model)
    lm_head_int8: Int8Weight | None = None

    def to(self, device: torch.device) -> Weights:
        """A copy on `device`; a tied lm_head stays the embedding's tensor. Quantized
        matrices run on the CPU only (lm_head_int8 is not carried: the dense output serves)."""
        if device.type != "cpu" and self.quantized():
            raise ValueError(f"quantized weights run on the CPU only, not on {device}")
        moved = {}

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if id(t) not in moved:
                moved[id(t)] = t.to(device)
            return moved[id(t)]

        layers = [
            LayerWeights(**{f: move(getattr(lw, f)) for f in LayerWeights.__dataclass_fields__})
            for lw in self.layers
        ]
        lm_head_int8 = self.lm_head_int8 if device.type == "cpu" else None
        return Weights(
            move(self.embed), layers, move(self.final_norm), move(self.lm_head), lm_head_int8
        )

    def quantized(self) -> bool:
        return any(is_quantized(m) for lw in self.layers for m in matrices(lw))

    def num_parameters(self) -> int:
        tensors = [self.embed, self.final_norm]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [
                layer.attn_norm,
                layer.qkv,
                layer.o,
                layer.mlp_norm,
                layer.gate_up,
                layer.down,
                *layer.biases(),
            ]
        return sum(t.numel() for t in tensors)


def matrices(layer: LayerWeights) -> tuple[Matrix, ...]:
    return (layer.qkv, layer.o, layer.gate_up, layer.down)


def fuse_layer(
    attn_norm: torch.Tensor,
    q: Source,
    k: Source,
    v: Source,
    o: Source,
    mlp_norm: torch.Tensor,
    gate: Source,
    up: Source,
    down: Source,
    dtype: torch.dtype,
    biases: Mapping[str, torch.Tensor] | None = None,
    quantization: str = "none",
) -> LayerWeights:
    """Build one layer from HF-layout projection matrices ([out, in]), fusing QKV and gate/up.
    biases: by projection name (PROJECTIONS); within a fused group a missing one is zeros.
    quantization: how the fused matrices run (quant.fuse_matrices); norms and biases stay dtype.
    """

    def matrix(*parts: Source) -> Matrix:
        return fuse_matrices(parts, quantization, dtype)

    b = dict(biases or {})
    if set(b) - set(PROJECTIONS):
        raise ValueError(f"unknown projections {sorted(set(b) - set(PROJECTIONS))}")

    def fused(*parts: tuple[str, Source]) -> torch.Tensor | None:
        if not any(name in b for name, _ in parts):
            return None
        rows = [b.get(name, torch.zeros(w.shape[0])) for name, w in parts]
        for (name, w), row in zip(parts, rows, strict=True):
            if row.numel() != w.shape[0]:
                raise ValueError(f"{name} bias: {row.numel()} values for {w.shape[0]} outputs")
        return torch.cat([r.reshape(-1) for r in rows]).to(dtype).contiguous()

    return LayerWeights(
        attn_norm=attn_norm.to(dtype).contiguous(),
        qkv=matrix(q, k, v),
        o=matrix(o),
        mlp_norm=mlp_norm.to(dtype).contiguous(),
        gate_up=matrix(gate, up),
        down=matrix(down),
        qkv_bias=fused(("q", q), ("k", k), ("v", v)),
        o_bias=fused(("o", o)),
        gate_up_bias=fused(("gate", gate), ("up", up)),
        down_bias=fused(("down", down)),
    )


def quantize_weights(weights: Weights, quantization: str) -> Weights:
    """The layers' matrices run as `quantization` (none, int8, int4; auto is none here: values
    carry no file type to keep), quantized from their values. Embedding and lm_head stay."""
    if quantization in ("none", "auto"):
        return weights
    dtype = weights.embed.dtype

    def run_as(m: Matrix) -> Matrix:
        if is_quantized(m):
            raise ValueError("the weights are quantized already")
        return fuse_matrices([m], quantization, dtype)

    layers = [
        replace(lw, qkv=run_as(lw.qkv), o=run_as(lw.o), gate_up=run_as(lw.gate_up),
                down=run_as(lw.down))
        for lw in weights.layers
    ]  # fmt: skip
    return replace(weights, layers=layers)
