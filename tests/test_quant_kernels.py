"""Quantized weights run as quantized: GGUF 4-bit blocks read as codes exactly, the int8 / int4
CPU kernels against a matmul over the values the codes stand for, and the loader's modes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from llmcommon.model_files import default_gguf_path
from worker_svc.linear import Linear, QuantizedLinear, make_linear
from worker_svc.loader import load_model, unpermute_rope
from worker_svc.memory_profile import weights_bytes
from worker_svc.quant import (
    Int4Codes,
    Int4Weight,
    Int8Weight,
    check_quantization,
    fuse_matrices,
    int4_codes,
    pack_int4,
    quantize_int8,
)
from worker_svc.quant_gguf import int4_codes_from_gguf


def random_q4_k(rows: int, supers: int, seed: int = 0) -> np.ndarray:
    """Raw Q4_K bytes: random codes and 6-bit scales, sane fp16 d and dmin (gguf cannot
    quantize to Q4_K, but it dequantizes it: the reference)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, supers, 144), dtype=np.uint8)
    for at in (0, 2):
        halves = rng.uniform(1e-3, 1e-2, (rows, supers)).astype(np.float16)
        raw[..., at : at + 2] = halves.view(np.uint8).reshape(rows, supers, 2)
    return raw.reshape(rows, supers * 144)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_legacy_4bit_blocks_read_as_the_values_gguf_gives(kind):
    w = np.random.default_rng(1).standard_normal((48, 256)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    raw = quantize(w, qtype)
    codes = int4_codes_from_gguf(kind, raw, 48)
    assert codes.codes.shape == (48, 256) and int(codes.codes.max()) <= 15
    assert np.array_equal(codes.dequantize().numpy(), dequantize(raw, qtype))


def test_q4_k_super_blocks_read_as_the_values_gguf_gives():
    raw = random_q4_k(rows=16, supers=3)
    codes = int4_codes_from_gguf("Q4_K", raw, 16)
    assert codes.scale.shape == (16, 3 * 8)  # one group per 32-weight sub-block
    assert np.array_equal(codes.dequantize().numpy(), dequantize(raw, GGMLQuantizationType.Q4_K))


def test_shipped_file_q4_1_matrix_read_as_its_values():
    reader = GGUFReader(str(default_gguf_path()))
    t = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    assert t.tensor_type.name == "Q4_1"
    codes = int4_codes_from_gguf("Q4_1", t.data, int(t.shape[-1]))
    assert np.array_equal(codes.dequantize().numpy(), dequantize(t.data, t.tensor_type))


def test_rope_unpermute_of_codes_matches_unpermute_of_values():
    codes = int4_codes(torch.randn(64, 96, generator=torch.Generator().manual_seed(2)))
    moved = unpermute_rope(codes, num_heads=4)
    assert isinstance(moved, Int4Codes)
    assert torch.equal(moved.dequantize(), unpermute_rope(codes.dequantize(), num_heads=4))


def reference(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return x.float() @ values.float().T


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_int4_kernel_equals_the_dequantized_matmul(tokens):
    gen = torch.Generator().manual_seed(3)
    codes = int4_codes_from_gguf("Q4_K", random_q4_k(rows=96, supers=2, seed=tokens), 96)
    x = torch.randn(tokens, 512, generator=gen)
    ref = reference(x, codes.dequantize())
    y32 = QuantizedLinear(pack_int4(codes, torch.float32))(x)
    assert relative_error(y32, ref) < 1e-5  # fp32 scales: the same values
    y16 = QuantizedLinear(pack_int4(codes, torch.bfloat16))(x.bfloat16())
    assert relative_error(y16, reference(x.bfloat16(), codes.dequantize())) < 1e-2


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_int8_kernel_equals_the_dequantized_matmul(tokens):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(80, 192, generator=gen)
    x = torch.randn(tokens, 192, generator=gen).bfloat16()
    q = quantize_int8(w, torch.bfloat16)
    values = q.int_codes().float() * q.scales.float()[:, None]
    assert relative_error(QuantizedLinear(q)(x), reference(x, values)) < 1e-2
    assert relative_error(values, w) < 0.01  # 8 bits per row: close to the original


def test_quantized_linear_adds_its_bias():
    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(64, 64, generator=gen), torch.randn(64, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    lin = make_linear(pack_int4(int4_codes(w), torch.float32), False, b)
    without = make_linear(pack_int4(int4_codes(w), torch.float32), False)
    assert isinstance(lin, QuantizedLinear) and isinstance(make_linear(w, False), Linear)
    assert torch.allclose(lin(x) - without(x), b.expand(3, -1), atol=1e-5)


def test_auto_keeps_4bit_groups_and_leaves_other_types_as_values():
    gen = torch.Generator().manual_seed(6)
    codes = int4_codes(torch.randn(32, 64, generator=gen))
    values = torch.randn(32, 64, generator=gen)
    assert isinstance(fuse_matrices([codes, codes], "auto", torch.bfloat16), Int4Weight)
    mixed = fuse_matrices([codes, values], "auto", torch.bfloat16)
    assert isinstance(mixed, torch.Tensor) and mixed.shape == (64, 64)
    assert torch.equal(mixed[:32].float(), codes.dequantize().bfloat16().float())
    assert isinstance(fuse_matrices([codes, values], "int8", torch.bfloat16), Int8Weight)
    assert isinstance(fuse_matrices([values], "int4", torch.bfloat16), Int4Weight)


def test_quantization_is_the_cpus_and_auto_means_none_elsewhere():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert check_quantization("auto", cpu, torch.bfloat16) == "auto"
    assert check_quantization("auto", cuda, torch.bfloat16) == "none"
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization("int4", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="quantization"):
        check_quantization("int3", cpu, torch.bfloat16)


@pytest.mark.parametrize("mode,kind", [("int8", Int8Weight), ("int4", Int4Weight)])
def test_tiny_model_loads_quantized_and_smaller(mode, kind):
    _, plain = load_model("tiny", torch.bfloat16)
    _, quantized = load_model("tiny", torch.bfloat16, mode)
    assert isinstance(quantized.layers[0].gate_up, kind)
    assert quantized.num_parameters() == plain.num_parameters()
    layer_bytes = weights_bytes(plain) - weights_bytes(quantized)
    assert layer_bytes > 0  # the embedding stays, the layers shrink
    with pytest.raises(ValueError, match="CPU only"):
        quantized.to(torch.device("meta"))


def test_shipped_gguf_auto_runs_its_q4_1_as_int4_with_the_files_values():
    config, plain = load_model("smollm2", torch.float32)
    _, auto = load_model("smollm2", torch.float32, "auto")
    layer = auto.layers[5]
    assert isinstance(layer.qkv, Int4Weight) and isinstance(layer.down, Int4Weight)
    assert auto.embed.dtype == torch.float32  # the Q8_0 embedding (tied lm_head) stays values
    gen = torch.Generator().manual_seed(7)
    for name in ("qkv", "gate_up", "down"):  # qkv: q and k rows unpermuted from llama.cpp's order
        values = getattr(plain.layers[5], name)
        x = torch.randn(4, values.shape[1], generator=gen)
        got = QuantizedLinear(getattr(layer, name))(x)
        assert relative_error(got, reference(x, values)) < 1e-5  # the file's own weights
