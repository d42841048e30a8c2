"""The quantized matrices laid out for this project's own kernels (cpu_kernels.c,
`int4_matmul_bf16` and `int8_matmul_bf16`), where the CPU has AVX-512 BF16.

torch's `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm` cost about `rows` times one row:
at the 6 rows of a 5-token draft the int4 one costs 2.6x a one-row decode, and above a few rows
the bf16 values through oneDNN beat both. These kernels read each block of the quantized
weight once for up to 8 rows and multiply with bf16 dot products (vdpbf16ps) on codes turned
into exact bf16 values by a table lookup, so a few rows cost little more than one; and every
row is computed alone, so a row's result is the same whatever rows share the step (a draft's
rows equal a plain decode's, bit for bit). The figures: docs/figures.md, "The blocked kernels".

int4, per block of 16 outputs and group of 32 inputs (320 bytes): the codes as 8 chunks of 32
bytes (byte j of chunk c: output j // 2, input 4c + j % 2 in the low nibble and 4c + 2 + j % 2
in the high one), then the 16 outputs' scales and zeros in bf16.
int8, per block of 16 outputs (16 * in + 32 bytes): in / 2 chunks of 32 bytes (byte j of chunk
p: code + 128 of output j // 2, input 2p + j % 2), then the 16 outputs' scales in bf16.

On a CPU with AMX (and a library built with it), int4 matmuls of AMX_INT4_FROM_ROWS rows and
more run on the tiles instead (amx_matmul.c: the same layout, turned into bf16 tiles once per
call and multiplied by tdpbf16ps), which from 9 rows on is faster than both the blocked kernel
and oneDNN's bf16 on the dense copy (worker_svc/cpu_features.py, AMX_INT4_MAX_ROWS).

LLMSERVE_BLOCKED_KERNELS=0 keeps torch's kernels (for comparison: llmserve.bench.draft_step,
worker_forward's "@torch" modes); LLMSERVE_AMX_KERNELS=0 keeps the blocked and dense paths on an
AMX host (worker_forward's "@noamx" modes).
"""

from __future__ import annotations

import os

import torch

from worker_svc import cpu_kernels
from worker_svc.cpu_features import AMX_INT4_FROM_ROWS, host_features

GROUP = 32
BLOCK_OUTPUTS = 16


def usable(dtype: torch.dtype, out_features: int, in_features: int, group: int = 2) -> bool:
    """Whether a quantized matrix of this shape, for activations of `dtype`, runs by these
    kernels (group: the inputs its codes come in, 32 for int4, 2 for int8)."""
    if os.environ.get("LLMSERVE_BLOCKED_KERNELS", "1") == "0":
        return False
    if dtype != torch.bfloat16 or out_features % BLOCK_OUTPUTS or in_features % group:
        return False
    global _loaded
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.blocked:
        return False
    _loaded = kernels  # held for the matmuls: no lookup per call on the step's path
    return True


def amx_usable() -> bool:
    """Whether int4 matmuls of many rows run by the AMX kernel here: the blocked kernels on,
    the AMX one built and granted (kernels.amx), an amx-tier CPU, and not turned off
    (LLMSERVE_AMX_KERNELS=0)."""
    if os.environ.get("LLMSERVE_BLOCKED_KERNELS", "1") == "0":
        return False
    if os.environ.get("LLMSERVE_AMX_KERNELS", "1") == "0" or host_features().tier != "amx":
        return False
    kernels = cpu_kernels.load()
    return kernels is not None and kernels.amx


def int4_layout(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """codes [out, in] uint8 in [0, 15]; scale, zero [out, in / 32] fp32 (rounded to bf16 here,
    as torch's kernel keeps them) -> [out / 16, in / 32, 320] uint8."""
    out, inputs = codes.shape
    blocks, groups = out // BLOCK_OUTPUTS, inputs // GROUP
    # input 4c + 2h + e of output lane: chunk c, nibble h (0 low, 1 high), pair element e
    v = codes.view(blocks, BLOCK_OUTPUTS, groups, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)
    nibbles = (v[..., 0] | (v[..., 1] << 4)).reshape(blocks, groups, 256)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [out, groups] -> [blocks, groups, 32]
        t = t.to(torch.bfloat16).view(blocks, BLOCK_OUTPUTS, groups).permute(0, 2, 1)
        return t.contiguous().view(torch.uint8).view(blocks, groups, 2 * BLOCK_OUTPUTS)

    return torch.cat([nibbles, per_block(scale), per_block(zero)], dim=-1).contiguous()


def int8_layout(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [out, in] int8; scales [out] -> [out / 16, 16 * in + 32] uint8 (the codes are not
    kept beside it: int8_codes reads them back)."""
    out, inputs = codes.shape
    blocks = out // BLOCK_OUTPUTS
    shifted = (codes.to(torch.int16) + 128).to(torch.uint8)
    pairs = shifted.view(blocks, BLOCK_OUTPUTS, inputs // 2, 2).permute(0, 2, 1, 3)
    tail = scales.to(torch.bfloat16).view(blocks, BLOCK_OUTPUTS).contiguous().view(torch.uint8)
    return torch.cat([pairs.reshape(blocks, BLOCK_OUTPUTS * inputs), tail], dim=1).contiguous()


def int8_codes(layout: torch.Tensor, out: int, inputs: int) -> torch.Tensor:
    """int8_layout's inverse: the codes [out, in] int8."""
    blocks = out // BLOCK_OUTPUTS
    pairs = layout[:, : BLOCK_OUTPUTS * inputs].view(blocks, inputs // 2, BLOCK_OUTPUTS, 2)
    shifted = pairs.permute(0, 2, 1, 3).reshape(out, inputs).to(torch.int16) - 128
    return shifted.to(torch.int8)


def amx_rows() -> int:
    """The rows from which an int4 weight laid out now runs on AMX tiles (0: never here)."""
    return AMX_INT4_FROM_ROWS if amx_usable() else 0


ACTIVATIONS = ("bf16", "int8")
_int4_kind = "int4"  # "int4a8" where set_activations("int8") took


def vnni_usable() -> bool:
    """Whether int4 matmuls can run on int8 activations here (vnni_matmul.c: the blocked
    kernels on, and a library built with AVX-512 VNNI and BF16)."""
    if os.environ.get("LLMSERVE_BLOCKED_KERNELS", "1") == "0":
        return False
    kernels = cpu_kernels.load()
    return kernels is not None and kernels.vnni


def set_activations(kind: str) -> str:
    """The activations of this process's blocked int4 matmuls from now on (a worker's
    --int4-activations): bf16, or int8 (rounded per group of 32, multiplied by VNNI) where
    vnni_usable. Returns the kind that runs (bf16 where int8 cannot)."""
    global _int4_kind
    if kind not in ACTIVATIONS:
        raise ValueError(f"activations {kind!r} are not one of {ACTIVATIONS}")
    runs = "int8" if kind == "int8" and vnni_usable() else "bf16"
    _int4_kind = "int4a8" if runs == "int8" else "int4"
    return runs


def activations() -> str:
    """The activations blocked int4 matmuls run on now: bf16 or int8."""
    return "int8" if _int4_kind == "int4a8" else "bf16"


def int4_matmul(
    x: torch.Tensor, blocked: torch.Tensor, out_features: int, amx_from_rows: int = 0
) -> torch.Tensor:
    """x [rows, in] bf16 -> [rows, out_features] bf16; on AMX tiles from `amx_from_rows` rows
    (0: never), else on bf16 or int8 activations (set_activations)."""
    if amx_from_rows and x.shape[0] >= amx_from_rows:
        return _kernels().int4_matmul_amx(x.contiguous(), blocked, out_features)
    return _kernels().blocked_matmul(_int4_kind, x.contiguous(), blocked, out_features)


def int8_matmul(x: torch.Tensor, blocked: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [rows, in] bf16 -> [rows, out_features] bf16."""
    return _kernels().blocked_matmul("int8", x.contiguous(), blocked, out_features)


_loaded: cpu_kernels.CpuKernels | None = None  # set by usable() where it says yes


def _kernels() -> cpu_kernels.CpuKernels:
    if _loaded is None:  # a weight laid out by hand (blocked=True) before any usable() call
        kernels = cpu_kernels.load()
        assert kernels is not None and kernels.blocked
        return kernels
    return _loaded
