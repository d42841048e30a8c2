"""Loading: tiny determinism, GGUF metadata, HF directory == GGUF, and HF's own GGUF reading."""

from __future__ import annotations

import time

import pytest
import torch

from tests.model_support import (
    hf_dir_from_gguf,
    hf_from_gguf,
    model,
    one_torch_thread,  # noqa: F401  (autouse fixture)
    prompt_ids,
)
from worker_svc.loader import load_model, unpermute_rope
from worker_svc.model_config import tiny_config
from worker_svc.runner import ModelRunner
from worker_svc.work import WorkItem


def prompt_logits(source_config, source_weights, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(
        source_config, source_weights, num_blocks=16, block_size=16, dtype=torch.float32
    )
    return runner.compute_logits([WorkItem("a", ids, 0, list(range(16)))], all_positions=True)


def test_tiny_is_deterministic_and_matches_tiny_config() -> None:
    config_a, weights_a = load_model("tiny", torch.float32)
    config_b, weights_b = load_model("tiny", torch.float32)
    assert config_a == tiny_config()
    assert config_a.vocab_size == 49152 and config_a.eos_token_ids == (2,)
    assert torch.equal(weights_a.layers[1].qkv, weights_b.layers[1].qkv)
    assert torch.equal(weights_a.embed, weights_b.embed)
    assert weights_a.lm_head is weights_a.embed  # tied


def test_tiny_in_bf16_has_bf16_weights() -> None:
    _, weights = load_model("tiny", torch.bfloat16)
    assert weights.layers[0].gate_up.dtype == torch.bfloat16
    assert weights.layers[0].gate_up.shape == (2 * 128, 64)
    assert weights.layers[0].qkv.shape == ((4 + 2 * 2) * 16, 64)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    heads, head_dim, hidden = 3, 8, 5
    w = torch.randn(heads * head_dim, hidden)
    # llama.cpp's convert_hf_to_gguf permute
    permuted = w.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rope(permuted, heads), w)


def test_unknown_source_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError):
        load_model(str(tmp_path / "nothing-here"), torch.float32)


@pytest.mark.slow
def test_smollm2_config_from_gguf_metadata_and_load_time() -> None:
    start = time.process_time()  # CPU seconds: robust to other load on a shared machine
    config, weights = load_model("smollm2", torch.bfloat16)
    # not a speed test (make bench-worker times it): a guard against a pathological loader,
    # e.g. dequantizing in Python loops (minutes); 10-13 CPU s here depending on the host's speed
    assert time.process_time() - start < 60.0
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.max_context) == (49152, 8192)
    assert config.rope_theta == 100000.0 and config.rms_norm_eps == 1e-5
    assert config.tie_embeddings and weights.lm_head is weights.embed
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert 134_000_000 < weights.num_parameters() < 135_000_000


@pytest.mark.slow
def test_hf_directory_loads_to_the_same_logits_as_the_gguf() -> None:
    directory = hf_dir_from_gguf()
    config_dir, weights_dir = load_model(str(directory), torch.float32)
    config_gguf, weights_gguf = model("smollm2")
    fields = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "rope_theta",
        "max_context",
        "tie_embeddings",
    )
    for name in fields:
        assert getattr(config_dir, name) == getattr(config_gguf, name), name
    assert config_dir.rms_norm_eps == pytest.approx(config_gguf.rms_norm_eps, rel=1e-6)
    ids = prompt_ids("The quick brown fox jumps over the lazy dog.")
    torch.testing.assert_close(
        prompt_logits(config_dir, weights_dir, ids),
        prompt_logits(config_gguf, weights_gguf, ids),
        atol=1e-4,
        rtol=0,
    )


@pytest.mark.slow
def test_our_gguf_reading_matches_transformers_gguf_reading() -> None:
    """transformers' own GGUF loader (which un-permutes q/k itself) gives the same logits."""
    theirs = hf_from_gguf()
    ids = prompt_ids("Paris is the capital of")
    with torch.inference_mode():
        expected = theirs(torch.tensor([ids])).logits[0]
    config, weights = model("smollm2")
    torch.testing.assert_close(prompt_logits(config, weights, ids), expected, atol=1e-3, rtol=0)
