"""HF model directories of each supported shape (Llama, llama3/linear RoPE scaling, biases, Qwen2,
tied or not, GQA): transformers builds and saves a small random model; our loader and paged forward
must give its logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.hf_dirs import VOCAB, save_hf_model
from tests.model_support import (
    hf_logits,
    one_torch_thread,  # noqa: F401  (autouse fixture)
    scattered_table,
)
from worker_svc.hf_config import MODEL_TYPES, ROPE_TYPES, config_from_hf
from worker_svc.loader import load_model
from worker_svc.runner import ModelRunner
from worker_svc.work import WorkItem

ATOL = 2e-4  # fp32 against fp32: the same math in a different order
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    # short, so that the test's 40 positions reach past it and all three bands occur:
    # wavelengths 6.3 (kept, < 32/4), 20 (interpolated) and 63.. (stretched, > 32)
    original_max_position_embeddings=32,
)
SHAPES = {
    "llama-untied-gqa2": ("llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-llama3-rope-gqa4": (
        "llama",
        dict(num_attention_heads=8, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE),
    ),
    "llama-linear-rope-mha": (
        "llama",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
        ),
    ),
    "llama-attention-and-mlp-bias-gqa3": (
        "llama",
        dict(num_attention_heads=6, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    ),
    "qwen2-qkv-bias-tied-gqa2": (
        "qwen2",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def saved(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    kind, overrides = SHAPES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    torch.set_num_threads(1)
    return request.param, directory, save_hf_model(kind, overrides, directory)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(
        3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def test_chunked_prefill_then_paged_decodes_match_transformers(saved) -> None:
    """Prefill 23 tokens in two chunks, then decode the rest one at a time over a shuffled block
    table; every position's logits equal transformers' full forward over the saved model."""
    _, directory, reference = saved
    config, weights = load_model(str(directory), torch.float32)
    ids, split, block_size = prompt(40, seed=1), 23, 4
    runner = ModelRunner(config, weights, num_blocks=64, block_size=block_size, dtype=torch.float32)
    table = scattered_table(len(ids), block_size, 64, seed=7)
    got = [
        runner.compute_logits([WorkItem("a", ids[:11], 0, table)], all_positions=True),
        runner.compute_logits([WorkItem("a", ids[11:split], 11, table)], all_positions=True),
    ]
    for p in range(split, len(ids)):
        got.append(runner.compute_logits([WorkItem("a", [ids[p]], p, table)]))
    torch.testing.assert_close(torch.cat(got), hf_logits(reference, ids), atol=ATOL, rtol=0)


def test_decodes_and_a_prefill_in_one_step_match_transformers(saved) -> None:
    """Two requests decoding while a third prefills, all in the same steps."""
    _, directory, reference = saved
    config, weights = load_model(str(directory), torch.float32)
    runner = ModelRunner(config, weights, num_blocks=48, block_size=4, dtype=torch.float32)
    a, b, c = prompt(17, seed=2), prompt(9, seed=3), prompt(30, seed=4)
    tables = {"a": list(range(0, 16)), "b": list(range(47, 31, -1)), "c": list(range(16, 32))}
    seqs = {"a": list(a), "b": list(b)}
    rows: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}
    for name in seqs:  # prefills alone first
        item = WorkItem(name, seqs[name], 0, tables[name])
        rows[name].append(runner.compute_logits([item])[0])
    for step in range(3):  # c's prompt in three chunks, alongside one decode of a and b each
        for name, seq in seqs.items():
            seq.append(int(rows[name][-1].argmax()))
        items = [WorkItem(name, [s[-1]], len(s) - 1, tables[name]) for name, s in seqs.items()]
        items.append(WorkItem("c", c[10 * step : 10 * step + 10], 10 * step, tables["c"]))
        for name, row in zip("abc", runner.compute_logits(items), strict=True):
            rows[name].append(row)
    for name, seq in seqs.items():
        expected = hf_logits(reference, seq)[-4:]  # the prefill's last row, then each decode
        torch.testing.assert_close(torch.stack(rows[name]), expected, atol=ATOL, rtol=0)
    expected_c = hf_logits(reference, c)[[9, 19, 29]]  # each chunk's last position
    torch.testing.assert_close(torch.stack(rows["c"]), expected_c, atol=ATOL, rtol=0)


def test_config_follows_the_directory(saved) -> None:
    name, directory, reference = saved
    config, weights = load_model(str(directory), torch.float32)
    hf = reference.config
    assert (config.num_heads, config.num_kv_heads) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
    )
    assert config.tie_embeddings == (weights.lm_head is weights.embed) == hf.tie_word_embeddings
    assert (weights.layers[0].qkv_bias is not None) == ("bias" in name)
    assert (weights.layers[0].down_bias is not None) == ("mlp-bias" in name)
    assert (config.rope_scaling is not None) == ("-rope-" in name and "qwen2" not in name)
    assert weights.num_parameters() == sum(p.numel() for p in reference.parameters())


def test_bf16_serving_path_with_biases_and_llama3_rope_tracks_fp32(tmp_path) -> None:
    """bf16 decodes take the fused-kernel path: biases and the scaled RoPE table go through it."""
    overrides = dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    save_hf_model("llama", {**overrides, "rope_parameters": LLAMA3_ROPE}, tmp_path)
    ids = prompt(36, seed=5)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        config, weights = load_model(str(tmp_path), dtype)
        runner = ModelRunner(config, weights, num_blocks=16, block_size=4, dtype=dtype)
        table = list(range(10))
        rows = [runner.compute_logits([WorkItem("a", ids[:20], 0, table)])]
        rows += [runner.compute_logits([WorkItem("a", [ids[p]], p, table)]) for p in range(20, 36)]
        logits[dtype] = torch.cat(rows)
    full, half = logits[torch.float32], logits[torch.bfloat16]
    assert (half - full).abs().max() < 0.05 * full.abs().max()
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() >= 0.9


# ---------------------------------------------------------------- refusals and config spellings


def llama_raw(**extra) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        **extra,
    }


def test_transformers_4_rope_scaling_spelling_reads_like_5() -> None:
    scaling_v4 = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    v4 = llama_raw(rope_theta=500000.0, rope_scaling=scaling_v4)
    v5 = llama_raw(rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0})
    assert config_from_hf(v4, "m") == config_from_hf(v5, "m")
    scaling = config_from_hf(v5, "m").rope_scaling
    assert scaling is not None and scaling.kind == "llama3" and scaling.original_max_positions == 32


def test_generation_config_adds_the_end_of_turn_tokens() -> None:
    """Llama 3 Instruct: config.json names <|end_of_text|>, generation_config.json <|eot_id|>
    too; a chat must stop at either."""
    raw = llama_raw(eos_token_id=128001)
    config = config_from_hf(raw, "m", generation={"eos_token_id": [128001, 128008, 128009]})
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert config_from_hf(raw, "m").eos_token_ids == (128001,)


@pytest.mark.parametrize(
    "raw, reason",
    [
        (llama_raw(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "RoPE type 'yarn'"),
        (llama_raw(model_type="gemma"), "model_type 'gemma'"),
        (llama_raw(hidden_act="gelu"), "hidden_act 'gelu'"),
        (
            llama_raw(
                model_type="qwen2", use_sliding_window=True, sliding_window=256, max_window_layers=1
            ),
            "sliding-window",
        ),
        (llama_raw(model_type="mistral", sliding_window=512), "sliding-window"),
    ],
)
def test_unsupported_configs_are_refused_with_the_reason(raw: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        config_from_hf(raw, "m")


def test_sliding_window_off_or_beyond_the_context_is_accepted() -> None:
    qwen = llama_raw(model_type="qwen2", use_sliding_window=False, sliding_window=256)
    mistral = llama_raw(model_type="mistral", sliding_window=None)
    wide = llama_raw(model_type="mistral", sliding_window=4096)
    for raw in (qwen, mistral, wide):
        assert config_from_hf(raw, "m").max_context == 1024


def test_untied_directory_without_lm_head_is_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    save_hf_model("llama", dict(num_attention_heads=4, num_key_value_heads=2), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no lm_head.weight"):
        load_model(str(tmp_path), torch.float32)


def test_tensors_the_forward_would_ignore_are_refused(tmp_path) -> None:
    """e.g. Qwen3's q_norm: silently dropping it would serve a different model."""
    from safetensors.torch import load_file, save_file

    save_hf_model("qwen2", dict(num_attention_heads=4, num_key_value_heads=2), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(state, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    with pytest.raises(ValueError, match="q_norm"):
        load_model(str(tmp_path), torch.float32)


def test_models_doc_lists_what_the_loader_accepts() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "models.md").read_text()
    for name in (*MODEL_TYPES, *ROPE_TYPES):
        assert f"`{name}`" in doc, name
