"""--quantization auto runs a GGUF's quantized output matrix (SmolLM2's Q8_0 token embedding,
tied) as int8 for steps of a few logit rows, where the product is bound by reading the 49,152 x
576 matrix, and as bf16 above; the embedding lookup keeps the bf16 values."""

from __future__ import annotations

from dataclasses import replace

import torch

from worker_svc.cpu_features import host_features
from worker_svc.linear import Linear, QuantizedLinear
from worker_svc.loader import load_model, output_int8
from worker_svc.memory_profile import weights_bytes
from worker_svc.model import LlamaModel
from worker_svc.quant import Int8Weight, quantize_int8


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tiny_with_int8_output():
    config, weights = load_model("tiny", torch.bfloat16)
    codes = quantize_int8(weights.lm_head.float(), torch.bfloat16)
    return config, replace(weights, lm_head_int8=codes)


def test_only_a_quantized_file_type_gets_int8_codes():
    values = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    for kind in ("Q8_0", "Q6_K", "Q4_K", "Q4_1"):
        codes = output_int8(kind, values, torch.bfloat16)
        assert isinstance(codes, Int8Weight) and codes.shape == values.shape
    for kind in ("F32", "F16", "BF16"):
        assert output_int8(kind, values, torch.bfloat16) is None


def test_few_rows_run_the_int8_kernel_and_more_the_dense_matmul():
    config, weights = tiny_with_int8_output()
    model = LlamaModel(config, weights, torch.bfloat16)
    head = model.lm_head
    assert isinstance(head, QuantizedLinear) and isinstance(head.dense, Linear)
    # this CPU's figure for the kernel that runs it (torch's int8, or this project's blocked)
    rows = host_features().output_int8_max_rows(weights.lm_head_int8.blocked is not None)
    assert head.max_rows == rows
    gen = torch.Generator().manual_seed(4)
    few = torch.randn(rows, config.hidden_size, generator=gen).bfloat16()
    more = torch.randn(rows + 1, config.hidden_size, generator=gen).bfloat16()
    assert torch.equal(head(few), weights.lm_head_int8.matmul(few))  # bit for bit the kernel
    assert torch.equal(head(more), head.dense(more))
    dense = few @ weights.lm_head.t()
    assert 0 < relative_error(head(few), dense) < 2e-2  # int8 per row: near, not the same


def test_the_codes_are_counted_in_memory_and_stay_on_the_cpu():
    config, weights = tiny_with_int8_output()
    plain = replace(weights, lm_head_int8=None)
    codes = weights.lm_head_int8
    assert weights_bytes(weights) - weights_bytes(plain) == codes.nbytes  # its blocked layout too
    assert weights.to(torch.device("cpu")).lm_head_int8 is codes
    assert weights.to(torch.device("meta")).lm_head_int8 is None  # elsewhere the dense serves
    model = LlamaModel(config, plain, torch.bfloat16)
    assert isinstance(model.lm_head, Linear)  # without codes: the dense matmul at every size


def test_auto_keeps_smollm2s_q8_output_and_the_other_modes_do_not():
    _, auto = load_model("smollm2", torch.bfloat16, "auto")
    assert isinstance(auto.lm_head_int8, Int8Weight)
    assert auto.lm_head_int8.shape == auto.lm_head.shape and auto.lm_head is auto.embed  # tied
    # the codes stand for the file's values (Q8_0: a scale per 32) to int8's rounding, one scale
    # per row: 1.2% measured (no clipping ratio below the row's absolute maximum does better)
    assert relative_error(auto.lm_head_int8.int_codes() * auto.lm_head_int8.scales[:, None].float(),
                          auto.lm_head) < 2e-2  # fmt: skip
    for mode in ("none", "int4"):
        assert load_model("smollm2", torch.bfloat16, mode)[1].lm_head_int8 is None
