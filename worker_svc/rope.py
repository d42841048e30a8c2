"""Rotary position embeddings (the HF "rotate_half" layout), as a precomputed table."""

from __future__ import annotations

import math

import torch

from worker_svc.model_config import RopeScaling


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """[head_dim / 2] fp32, as transformers computes them (modeling_rope_utils)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    return llama3_scaled(inv_freq, scaling)


def llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than original / low_freq_factor are stretched by factor,
    shorter than original / high_freq_factor kept, and those between interpolated smoothly."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_positions / s.low_freq_factor
    high_freq_wavelen = s.original_max_positions / s.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RopeTable:
    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_positions: int,
        dtype: torch.dtype,
        scaling: RopeScaling | None = None,
    ):
        inv_freq = inverse_frequencies(head_dim, theta, scaling)  # [head_dim / 2]
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [positions, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [positions, head_dim]
        half = head_dim // 2
        self.cos = emb.cos().to(dtype)  # [positions, head_dim]
        # rotate_half(x) * sin == roll(x, half) * sin_signed, sin_signed = [-sin_lo, sin_hi]
        sin = emb.sin()
        self.sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(dtype)
        self.max_positions = max_positions

    def to(self, device: torch.device) -> RopeTable:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [tokens] -> cos, sin: [tokens, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos and (sign-folded) sin: [tokens, 1, head_dim].

    Same as transformers' x * cos + rotate_half(x) * sin, in three kernels instead of five."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
