"""Model weights in the runner's layout: fused QKV and gate/up projections."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # HF's names, without "_proj"


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]; q rows, then k, then v
    o: torch.Tensor  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]; gate rows, then up
    down: torch.Tensor  # [hidden, intermediate]
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

    def to(self, device: torch.device) -> Weights:
        """A copy on `device`; a tied lm_head stays the embedding's tensor."""
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
        return Weights(move(self.embed), layers, move(self.final_norm), move(self.lm_head))

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


def fuse_layer(
    attn_norm: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    mlp_norm: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    dtype: torch.dtype,
    biases: Mapping[str, torch.Tensor] | None = None,
) -> LayerWeights:
    """Build one layer from HF-layout projection matrices ([out, in]), fusing QKV and gate/up.
    biases: by projection name (PROJECTIONS); within a fused group a missing one is zeros."""
    b = dict(biases or {})
    if set(b) - set(PROJECTIONS):
        raise ValueError(f"unknown projections {sorted(set(b) - set(PROJECTIONS))}")

    def fused(*parts: tuple[str, torch.Tensor]) -> torch.Tensor | None:
        if not any(name in b for name, _ in parts):
            return None
        rows = [b.get(name, torch.zeros(w.shape[0])) for name, w in parts]
        for (name, w), row in zip(parts, rows, strict=True):
            if row.numel() != w.shape[0]:
                raise ValueError(f"{name} bias: {row.numel()} values for {w.shape[0]} outputs")
        return torch.cat([r.reshape(-1) for r in rows]).to(dtype).contiguous()

    return LayerWeights(
        attn_norm=attn_norm.to(dtype).contiguous(),
        qkv=torch.cat([q, k, v], dim=0).to(dtype).contiguous(),
        o=o.to(dtype).contiguous(),
        mlp_norm=mlp_norm.to(dtype).contiguous(),
        gate_up=torch.cat([gate, up], dim=0).to(dtype).contiguous(),
        down=down.to(dtype).contiguous(),
        qkv_bias=fused(("q", q), ("k", k), ("v", v)),
        o_bias=fused(("o", o)),
        gate_up_bias=fused(("gate", gate), ("up", up)),
        down_bias=fused(("down", down)),
    )
