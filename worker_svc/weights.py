"""Model weights in the runner's layout: fused QKV and gate/up projections."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]; q rows, then k, then v
    o: torch.Tensor  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]; gate rows, then up
    down: torch.Tensor  # [hidden, intermediate]


@dataclass(slots=True)
class Weights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as embed when tied

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
) -> LayerWeights:
    """Build one layer from HF-layout projection matrices ([out, in]), fusing QKV and gate/up."""
    return LayerWeights(
        attn_norm=attn_norm.to(dtype).contiguous(),
        qkv=torch.cat([q, k, v], dim=0).to(dtype).contiguous(),
        o=o.to(dtype).contiguous(),
        mlp_norm=mlp_norm.to(dtype).contiguous(),
        gate_up=torch.cat([gate, up], dim=0).to(dtype).contiguous(),
        down=down.to(dtype).contiguous(),
    )
