"""Next-token choice: greedy, temperature, top-k, top-p; seeded draws are reproducible.

A seeded draw depends only on (seed, sample_index, logits): its generator is seeded from a hash
of (seed, sample_index), so batching and recomputation do not change it.
"""

from __future__ import annotations

import hashlib
import secrets

import torch

from worker_svc.work import SamplingSettings


def draw_seed(seed: int, sample_index: int) -> int:
    """A 63-bit generator seed from (seed, sample_index), stable across processes."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(secrets.randbits(63))


def sample_tokens(
    logits: torch.Tensor,  # [rows, vocab] fp32
    settings: list[SamplingSettings],
    sample_indices: list[int],
    rng: torch.Generator,  # used for unseeded draws
) -> list[int]:
    """One token per row."""
    greedy_rows = [i for i, s in enumerate(settings) if s.greedy]
    if len(greedy_rows) == len(settings):  # the common case: no row copy, one argmax
        return logits.argmax(dim=-1).tolist()
    out: list[int] = [0] * len(settings)
    if greedy_rows:
        chosen = logits[greedy_rows].argmax(dim=-1).tolist()
        for row, token in zip(greedy_rows, chosen, strict=True):
            out[row] = token
    plain = [i for i, s in enumerate(settings) if _plain(s)]
    if plain:  # unseeded temperature-only rows: one batched draw
        temps = torch.tensor([settings[i].temperature for i in plain]).unsqueeze(1)  # [rows, 1]
        rows = logits[plain].float()
        probs = torch.softmax((rows - rows.max(dim=-1, keepdim=True).values) / temps, dim=-1)
        chosen = torch.multinomial(probs, 1, generator=rng).squeeze(1).tolist()
        for row, token in zip(plain, chosen, strict=True):
            out[row] = token
    for row, s in enumerate(settings):
        if s.greedy or _plain(s):
            continue
        gen = rng
        if s.seed is not None:
            gen = torch.Generator().manual_seed(draw_seed(s.seed, sample_indices[row]))
        out[row] = sample_one(logits[row], s, gen)
    return out


def _plain(s: SamplingSettings) -> bool:
    """Unseeded, temperature only: rows that can share one batched draw."""
    return not s.greedy and s.seed is None and s.top_k == 0 and not 0.0 < s.top_p < 1.0


def sample_one(logits: torch.Tensor, s: SamplingSettings, gen: torch.Generator) -> int:
    """logits: [vocab] fp32; s.temperature > 0."""
    if s.greedy:
        return int(logits.argmax())
    logits = logits.float()
    scaled = (logits - logits.max()) / s.temperature  # [vocab]; <= 0, finite for tiny T
    vocab = scaled.shape[0]
    top_p = s.top_p if 0.0 < s.top_p < 1.0 else 1.0
    ids: torch.Tensor | None = None
    if 0 < s.top_k < vocab:
        scaled, ids = scaled.topk(s.top_k)  # sorted, descending
    elif top_p < 1.0:
        scaled, ids = scaled.sort(descending=True)
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= top_p, 0.0)
        probs[0] = probs[0].clamp_min(1e-30)
    choice = int(torch.multinomial(probs, 1, generator=gen))
    return choice if ids is None else int(ids[choice])
