"""GGUF's 4-bit blocks as group-32 Int4Codes, bit-exact, without going through their values.

Layouts (ggml-common.h), per block of 32 weights unless said, fp16 scalars little-endian:
- Q4_0 (18 bytes): d, 16 bytes of nibbles; w = d * (q - 8).
- Q4_1 (20 bytes): d, m, 16 bytes of nibbles; w = d * q + m.
  In both, byte j holds weight j (low nibble) and weight j + 16 (high nibble).
- Q4_K (144 bytes per 256): d, dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of
  nibbles; sub-block s of 32: w = d * sc[s] * q - dmin * m[s]. Bytes 32c..32c+31 hold sub-block
  2c in their low nibbles and 2c + 1 in their high ones.
The kernel's convention is w = (q - 8) * scale + zero, so zero = (the block's offset) + 8 scale.
"""

from __future__ import annotations

import numpy as np
import torch

from worker_svc.quant import INT4_OFFSET, Int4Codes

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def int4_codes_from_gguf(type_name: str, data: np.ndarray, rows: int) -> Int4Codes:
    """data: the tensor's raw bytes (GGUFReader's uint8 array), rows: its output rows."""
    raw = np.asarray(data, dtype=np.uint8).reshape(rows, -1)
    if type_name == "Q4_0":
        return _q4_legacy(raw.reshape(rows, -1, 18), has_min=False)
    if type_name == "Q4_1":
        return _q4_legacy(raw.reshape(rows, -1, 20), has_min=True)
    if type_name == "Q4_K":
        return _q4_k(raw.reshape(rows, -1, 144))
    raise ValueError(f"{type_name} is not a 4-bit GGUF type of {INT4_TYPES}")


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 scalar at byte `at` of every block, as fp32: [rows, blocks]."""
    pair = np.ascontiguousarray(blocks[..., at : at + 2])
    return pair.view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n] codes: the n low nibbles, then the n high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q4_legacy(blocks: np.ndarray, has_min: bool) -> Int4Codes:
    rows = blocks.shape[0]
    d = _half(blocks, 0)  # [rows, blocks]
    offset = _half(blocks, 2) if has_min else -INT4_OFFSET * d  # w = d * q + offset
    codes = _nibbles(blocks[..., 4 if has_min else 2 :])  # [rows, blocks, 32]
    zero = offset + INT4_OFFSET * d
    return _to_torch(codes.reshape(rows, -1), d, zero)


def _q4_k(blocks: np.ndarray) -> Int4Codes:
    rows, supers = blocks.shape[:2]
    d, dmin = _half(blocks, 0)[..., None], _half(blocks, 2)[..., None]  # [rows, supers, 1]
    sc, mins = _k4_scales_mins(blocks[..., 4:16].astype(np.uint8))  # [rows, supers, 8] each
    quads = blocks[..., 16:144].reshape(rows, supers, 4, 32)
    codes = _nibbles(quads)  # [rows, supers, 4, 64]: sub-blocks 2c then 2c + 1
    scale = d * sc
    zero = -dmin * mins + INT4_OFFSET * scale
    return _to_torch(codes.reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1))


def _k4_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """get_scale_min_k4 for j = 0..7 over the 12 packed bytes s[..., 0:12]."""
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    sc = np.concatenate([low_sc, high_sc], axis=-1).astype(np.float32)
    mins = np.concatenate([low_m, high_m], axis=-1).astype(np.float32)
    return sc, mins


def _to_torch(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> Int4Codes:
    return Int4Codes(
        torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)),
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32)),
    )
