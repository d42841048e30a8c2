"""Weight-only quantized matrices run as quantized on the CPU: int8 per output channel and int4
in groups of 32 along the input, by PyTorch's own CPU kernels (the ones gpt-fast and torchao
call): `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu`. Activations stay bf16 (or fp32);
the kernels dequantize weight tiles as they go, so a step reads 1 byte (int8) or 0.625 bytes
(int4 with its group scale and zero) per weight instead of bf16's 2.

GGUF's 4-bit types (Q4_0, Q4_1, Q4_K) are group-32 affine codes already (quant_gguf.py maps
their blocks onto Int4Codes exactly); everything else is quantized here from its values
(round to nearest: min/max per group for int4, absolute max per row for int8).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from worker_svc import blocked_matmul

QUANTIZATIONS = ("none", "int8", "int4", "auto")
GROUP_SIZE = 32  # GGUF's block (and Q4_K's sub-block) length; the int4 kernel takes 32..256
INT4_OFFSET = 8  # the kernel's convention: w = (code - 8) * scale + zero, code in [0, 15]


@dataclass(frozen=True, slots=True)
class Int4Codes:
    """Group-wise affine 4-bit codes on the host, before packing: w = (codes - 8) * scale + zero
    per group of GROUP_SIZE inputs. codes: [out, in] uint8 in [0, 15]; scale, zero: [out,
    in / GROUP_SIZE] fp32. Rows can be reordered and stacked exactly (map_rows, stack)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Int4Codes:
        """The same row operation (a permutation) applied to the codes and their groups."""
        return Int4Codes(fn(self.codes), fn(self.scale), fn(self.zero))

    def dequantize(self) -> torch.Tensor:
        """[out, in] fp32, exactly the values the codes stand for."""
        rows, cols = self.codes.shape
        grouped = self.codes.view(rows, -1, GROUP_SIZE).float() - INT4_OFFSET
        return (grouped * self.scale[..., None] + self.zero[..., None]).view(rows, cols)

    @staticmethod
    def stack(parts: Sequence[Int4Codes]) -> Int4Codes:
        return Int4Codes(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
        )


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """int8 codes [out, in] with one scale per output row: w = codes * scales[:, None]; where
    this project's own kernel runs (worker_svc.blocked_matmul), the codes in its layout
    (`blocked`) instead, and `codes` empty ([out, 0]; int_codes() gives them back)."""

    codes: torch.Tensor  # [out, in] int8, or [out, 0] where blocked
    scales: torch.Tensor  # [out], the activations' dtype (the kernel requires it)
    keep_dense: bool = False  # also kept as dtype values, for matmuls of many rows (auto)
    blocked: torch.Tensor | None = None  # blocked_matmul.int8_layout's bytes, or None
    in_features: int = 0  # where blocked (codes empty); else codes.shape[1]

    @property
    def shape(self) -> torch.Size:
        if self.blocked is not None:
            return torch.Size((self.codes.shape[0], self.in_features))
        return self.codes.shape

    def int_codes(self) -> torch.Tensor:
        """[out, in] int8: the codes, read back from the blocked layout where held so."""
        if self.blocked is None:
            return self.codes
        return blocked_matmul.int8_codes(self.blocked, *self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        held = self.blocked.nbytes if self.blocked is not None else 0
        return self.codes.nbytes + self.scales.nbytes + held

    @property
    def kernel(self) -> str:
        """The kernel that runs it: "blocked int8" (this project's) or "int8" (torch's)."""
        return "blocked int8" if self.blocked is not None else "int8"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in] -> [tokens, out]."""
        if self.blocked is not None:
            return blocked_matmul.int8_matmul(x, self.blocked, self.shape[0])
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """int4 codes packed by `_convert_weight_to_int4pack_for_cpu` ([out, in / 2] uint8) and their
    groups' scales and zeros [in / GROUP_SIZE, out, 2] in the activations' dtype; or, where
    this project's own kernel runs (worker_svc.blocked_matmul), the same codes in its layout
    (`blocked`), and `packed` and `scales_and_zeros` empty (of the activations' dtype)."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    out_features: int
    in_features: int
    keep_dense: bool = False  # also kept as dtype values, for matmuls of many rows (auto)
    # auto: those values as computed at load (from the codes, cheaply), handed over once to the
    # linear that keeps them (dense_values pops them: the weight does not hold them after)
    handover: list[torch.Tensor] = field(default_factory=list, compare=False, repr=False)
    blocked: torch.Tensor | None = None  # blocked_matmul.int4_layout's bytes, or None
    amx_from_rows: int = 0  # where blocked: matmuls of this many rows on AMX tiles (0: never)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def numel(self) -> int:
        return self.out_features * self.in_features

    @property
    def nbytes(self) -> int:
        held = self.blocked.nbytes if self.blocked is not None else 0
        return self.packed.nbytes + self.scales_and_zeros.nbytes + held

    @property
    def kernel(self) -> str:
        """The kernel that runs it: "blocked int4" (this project's; "blocked int4 (int8
        activations)" where blocked_matmul.set_activations says so) or "int4" (torch's)."""
        if self.blocked is None:
            return "int4"
        return "blocked int4 (int8 activations)" if self.a8 else "blocked int4"

    @property
    def a8(self) -> bool:
        """Whether its matmuls run on int8 activations now (blocked, and set_activations took
        int8)."""
        return self.blocked is not None and blocked_matmul.activations() == "int8"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in] -> [tokens, out]."""
        if self.blocked is not None:
            return blocked_matmul.int4_matmul(
                x, self.blocked, self.out_features, self.amx_from_rows
            )
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, GROUP_SIZE, self.scales_and_zeros
        )


QuantizedWeight = Int8Weight | Int4Weight


def is_quantized(matrix: object) -> bool:
    return isinstance(matrix, Int8Weight | Int4Weight)


def dense_dtype(weight: QuantizedWeight) -> torch.dtype:
    """The activations' dtype the weight was packed for (its dense form's)."""
    return weight.scales.dtype if isinstance(weight, Int8Weight) else weight.scales_and_zeros.dtype


def dense_values(weight: QuantizedWeight, chunk: int = 512) -> torch.Tensor:
    """[out, in] in the activations' dtype: the values the kernel computes with. Handed over
    from the load where there (Int4Weight.handover), else read back through the kernel itself
    (identity rows in, the weight's columns out), a chunk at a time (slower than the handover)."""
    if isinstance(weight, Int4Weight) and weight.handover:
        return weight.handover.pop()
    dtype = dense_dtype(weight)
    rows, cols = weight.shape
    out = torch.empty(rows, cols, dtype=dtype)
    eye = torch.eye(cols, dtype=dtype)
    for start in range(0, cols, chunk):
        out[:, start : start + chunk] = weight.matmul(eye[start : start + chunk]).t()
    return out


def pack_int4(codes: Int4Codes, dtype: torch.dtype, blocked: bool | None = None) -> Int4Weight:
    """blocked: this project's kernel (None: where it can run, blocked_matmul.usable)."""
    rows, cols = codes.shape
    if cols % GROUP_SIZE:
        raise ValueError(f"int4: {cols} inputs are not a multiple of {GROUP_SIZE}")
    if blocked is None:
        blocked = blocked_matmul.usable(dtype, rows, cols, GROUP_SIZE)
    if blocked:
        layout = blocked_matmul.int4_layout(codes.codes, codes.scale, codes.zero)
        empty = torch.empty(0, dtype=dtype)
        return Int4Weight(
            torch.empty(0, dtype=torch.uint8), empty, rows, cols, blocked=layout,
            amx_from_rows=blocked_matmul.amx_rows(),
        )  # fmt: skip
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.codes.to(torch.int32), 1)
    groups = torch.stack([codes.scale, codes.zero], dim=-1)  # [out, groups, 2]
    scales_and_zeros = groups.transpose(0, 1).contiguous().to(dtype)
    return Int4Weight(packed, scales_and_zeros, rows, cols)


def int4_codes(w: torch.Tensor) -> Int4Codes:
    """Round-to-nearest asymmetric 4-bit codes of w [out, in] per group (min and max kept)."""
    rows, cols = w.shape
    if cols % GROUP_SIZE:
        raise ValueError(f"int4: {cols} inputs are not a multiple of {GROUP_SIZE}")
    grouped = w.float().view(rows, -1, GROUP_SIZE)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((grouped - low[..., None]) / scale[..., None]).round().clamp(0, 15)
    zero = low + INT4_OFFSET * scale
    return Int4Codes(codes.to(torch.uint8).view(rows, cols), scale, zero)


def quantize_int8(w: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    """Symmetric round-to-nearest per output row: scale = max |w| / 127."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
    return int8_weight(codes, scale.to(dtype))


def int8_weight(codes: torch.Tensor, scales: torch.Tensor, blocked: bool | None = None):
    """The weight of these codes; blocked: laid out for this project's kernel instead of kept
    as they are (None: where that kernel can run)."""
    out, inputs = codes.shape
    if blocked is None:
        blocked = blocked_matmul.usable(scales.dtype, out, inputs)
    if not blocked:
        return Int8Weight(codes, scales)
    layout = blocked_matmul.int8_layout(codes, scales)
    return Int8Weight(codes[:, :0].contiguous(), scales, blocked=layout, in_features=inputs)


Source = torch.Tensor | Int4Codes  # one projection as loaded: values, or a GGUF file's codes


def fuse_matrices(parts: Sequence[Source], mode: str, dtype: torch.dtype):
    """Stack projections row-wise ([out, in] each) into one matrix run as `mode`:
    none: dtype values; int8 / int4: quantized (4-bit codes from the file kept exactly);
    auto: int4 when every part is 4-bit codes, kept also as dtype values (the same values) for
    matmuls of many rows (worker_svc.linear.QuantizedLinear); else dtype values."""
    if mode == "auto":
        if not all(isinstance(p, Int4Codes) for p in parts):
            return fuse_matrices(parts, "none", dtype)
        codes = Int4Codes.stack(parts)
        return replace(
            pack_int4(codes, dtype), keep_dense=True, handover=[kernel_values(codes, dtype)]
        )
    if mode == "int4":
        codes = [p if isinstance(p, Int4Codes) else int4_codes(p) for p in parts]
        return pack_int4(Int4Codes.stack(codes), dtype)
    values = torch.cat([values_of(p) for p in parts])
    if mode == "int8":
        return quantize_int8(values, dtype)
    if mode == "none":
        return values.to(dtype).contiguous()
    raise ValueError(f"unknown quantization {mode!r}; expected one of {QUANTIZATIONS}")


def kernel_values(codes: Int4Codes, dtype: torch.dtype) -> torch.Tensor:
    """The values the int4 kernel computes with: its scales and zeros are `dtype` (pack_int4)."""
    scale, zero = codes.scale.to(dtype).float(), codes.zero.to(dtype).float()
    return Int4Codes(codes.codes, scale, zero).dequantize().to(dtype).contiguous()


def values_of(part: Source) -> torch.Tensor:
    return part.dequantize() if isinstance(part, Int4Codes) else part


def check_quantization(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """The mode a worker runs: the quantized kernels are the CPU's; elsewhere auto means none
    and int8 / int4 are refused."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {QUANTIZATIONS}, got {mode!r}")
    if device.type != "cpu" or mode == "none":
        if mode in ("int8", "int4"):
            raise ValueError(f"--quantization {mode} runs on the CPU only (device {device})")
        return "none"
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"--quantization {mode}: activations must be bf16 or fp32")
    return mode
