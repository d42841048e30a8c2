"""Rotary position embeddings (the HF "rotate_half" layout), as a precomputed table."""

from __future__ import annotations

import torch


class RopeTable:
    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype):
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )  # [head_dim / 2]
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [positions, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [positions, head_dim]
        half = head_dim // 2
        self.cos = emb.cos().to(dtype)  # [positions, head_dim]
        # rotate_half(x) * sin == roll(x, half) * sin_signed, sin_signed = [-sin_lo, sin_hi]
        sin = emb.sin()
        self.sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(dtype)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [tokens] -> cos, sin: [tokens, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos and (sign-folded) sin: [tokens, 1, head_dim].

    Same as transformers' x * cos + rotate_half(x) * sin, in three kernels instead of five."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
