"""The logits at the top of each row made exact, where bf16 rounding would decide.

The output matrix's product comes out in bf16 (oneDNN's dense kernel, or the int8 one for a few
rows): at a logit of 25 its step is 0.125, so two tokens within a step read as equal, and which
one greedy takes turns on which rounding the step's batch gets (the demo's question about the
capital of France is such a case: docs/figures.md). So every entry within NEAR of its row's
maximum is recomputed in fp32 from the same hidden row and the dense output matrix (a handful of
dot products a row), and the rest of the row, further down, keeps its rounded value.
"""

from __future__ import annotations

import torch

NEAR = 2.0**-5  # of the row maximum's magnitude: about 4 bf16 steps (each is 2**-8 to 2**-7 of it)


def refine_near_max(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """logits [rows, vocab] fp32 (updated in place) = hidden [rows, in] @ weight [vocab, in].T,
    as rounded by a low-precision kernel: the entries within NEAR of their row's maximum are
    replaced by their fp32 products."""
    top = logits.max(dim=-1, keepdim=True).values
    near = logits >= top - top.abs().clamp_min(1.0) * NEAR
    rows, cols = near.nonzero(as_tuple=True)
    exact = (hidden[rows].float() * weight[cols].float()).sum(dim=-1)
    logits[rows, cols] = exact
