"""Load a Llama-family model: tiny random, SmolLM2's GGUF, any GGUF file, or an HF directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from worker_svc.model_config import ModelConfig, tiny_config
from worker_svc.weights import LayerWeights, Weights, fuse_layer

TINY_SEED = 0


def load_model(source: str, dtype: torch.dtype = torch.bfloat16) -> tuple[ModelConfig, Weights]:
    """source: "tiny", "smollm2", a path to a .gguf file, or an HF model directory."""
    if source == "tiny":
        return tiny_model(dtype)
    if source == "smollm2":
        from llmserve.model_files import default_gguf_path

        return load_gguf(default_gguf_path(), dtype)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_dir(path, dtype)
    raise ValueError(f"unknown model source {source!r}: not tiny/smollm2/.gguf/HF directory")


# ---------------------------------------------------------------------------- tiny random model


def tiny_model(dtype: torch.dtype) -> tuple[ModelConfig, Weights]:
    config = tiny_config()
    return config, random_weights(config, dtype, seed=TINY_SEED)


def random_weights(config: ModelConfig, dtype: torch.dtype, seed: int = 0) -> Weights:
    """Deterministic random weights (drawn in fp32 on CPU, then cast)."""
    gen = torch.Generator().manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * (1.0 / cols) ** 0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=gen)

    embed = torch.randn(config.vocab_size, h, generator=gen)
    layers = [
        fuse_layer(
            attn_norm=norm(),
            q=mat(config.q_size, h),
            k=mat(config.kv_size, h),
            v=mat(config.kv_size, h),
            o=mat(h, config.q_size),
            mlp_norm=norm(),
            gate=mat(i, h),
            up=mat(i, h),
            down=mat(h, i),
            dtype=dtype,
        )
        for _ in range(config.num_layers)
    ]
    final_norm = norm().to(dtype)
    embed = embed.to(dtype)
    lm_head = embed if config.tie_embeddings else mat(config.vocab_size, h).to(dtype)
    return Weights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


# ---------------------------------------------------------------------------- GGUF


def load_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, Weights]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    meta = {name: field for name, field in reader.fields.items()}

    def value(key: str, default: object = None) -> object:
        field = meta.get(key)
        return default if field is None else field.contents()

    arch = value("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (llama only)")
    tensors = {t.name: t for t in reader.tensors}

    def load(name: str) -> torch.Tensor:
        t = tensors[name]
        array = dequantize(t.data, t.tensor_type)  # numpy, shape reversed from GGUF's order
        array = np.ascontiguousarray(array, dtype=np.float32)
        if not array.flags.writeable:  # unquantized tensors come straight from the mmap
            array = array.copy()
        return torch.from_numpy(array.reshape([int(d) for d in reversed(t.shape)]))

    num_heads = int(value("llama.attention.head_count"))
    num_kv_heads = int(value("llama.attention.head_count_kv", num_heads))
    hidden = int(value("llama.embedding_length"))
    vocab = value("llama.vocab_size")
    if vocab is None:
        vocab = len(meta["tokenizer.ggml.tokens"].data)
    head_dim = int(value("llama.attention.key_length", hidden // num_heads))
    eos = value("tokenizer.ggml.eos_token_id", 2)
    config = ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(value("llama.feed_forward_length")),
        num_layers=int(value("llama.block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=float(value("llama.rope.freq_base", 10000.0)),
        # stored as float32 (9.9999997e-06); round back to the value the model was trained with
        rms_norm_eps=float(f"{value('llama.attention.layer_norm_rms_epsilon', 1e-5):.6g}"),
        max_context=int(value("llama.context_length", 2048)),
        tie_embeddings="output.weight" not in tensors,
        bos_token_id=int(value("tokenizer.ggml.bos_token_id", 1)),
        eos_token_ids=(int(eos),),
        name=str(value("general.name", path.stem)),
    )
    if value("llama.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{path}: RoPE scaling is not supported")

    layers: list[LayerWeights] = []
    for n in range(config.num_layers):
        p = f"blk.{n}."
        layers.append(
            fuse_layer(
                attn_norm=load(p + "attn_norm.weight"),
                q=unpermute_rope(load(p + "attn_q.weight"), num_heads),
                k=unpermute_rope(load(p + "attn_k.weight"), num_kv_heads),
                v=load(p + "attn_v.weight"),
                o=load(p + "attn_output.weight"),
                mlp_norm=load(p + "ffn_norm.weight"),
                gate=load(p + "ffn_gate.weight"),
                up=load(p + "ffn_up.weight"),
                down=load(p + "ffn_down.weight"),
                dtype=dtype,
            )
        )
    embed = load("token_embd.weight").to(dtype)
    lm_head = embed if config.tie_embeddings else load("output.weight").to(dtype)
    weights = Weights(
        embed=embed,
        layers=layers,
        final_norm=load("output_norm.weight").to(dtype),
        lm_head=lm_head,
    )
    return config, weights


def unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of q/k rows (inverse of convert_hf_to_gguf's permute).

    w: [heads * head_dim, hidden]; per head llama.cpp stores rows as (half, pair) pairs,
    HF as (pair, half).
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------- HF directory


def load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, Weights]:
    from safetensors.torch import load_file

    raw = json.loads((path / "config.json").read_text())
    config = hf_config(raw, name=path.name)
    state: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    for file in files:
        state.update(load_file(str(file)))
    if any(key.endswith(".bias") for key in state):
        raise ValueError(f"{path}: projection biases are not supported")

    def take(name: str) -> torch.Tensor:
        return state.pop(name).to(torch.float32)

    layers: list[LayerWeights] = []
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        layers.append(
            fuse_layer(
                attn_norm=take(p + "input_layernorm.weight"),
                q=take(p + "self_attn.q_proj.weight"),
                k=take(p + "self_attn.k_proj.weight"),
                v=take(p + "self_attn.v_proj.weight"),
                o=take(p + "self_attn.o_proj.weight"),
                mlp_norm=take(p + "post_attention_layernorm.weight"),
                gate=take(p + "mlp.gate_proj.weight"),
                up=take(p + "mlp.up_proj.weight"),
                down=take(p + "mlp.down_proj.weight"),
                dtype=dtype,
            )
        )
    embed = take("model.embed_tokens.weight").to(dtype)
    if config.tie_embeddings or "lm_head.weight" not in state:
        lm_head = embed
    else:
        lm_head = take("lm_head.weight").to(dtype)
    weights = Weights(
        embed=embed, layers=layers, final_norm=take("model.norm.weight").to(dtype), lm_head=lm_head
    )
    return config, weights


def hf_config(raw: dict, name: str) -> ModelConfig:
    """ModelConfig from an HF config.json (transformers 4.x and 5.x spellings)."""
    model_type = raw.get("model_type", "llama")
    if model_type not in ("llama", "mistral"):
        raise ValueError(f"model_type {model_type!r} is not supported (llama family only)")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"RoPE type {rope_type!r} is not supported")
    rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    num_heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id", 2)
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_context=raw.get("max_position_embeddings", 2048),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id") if raw.get("bos_token_id") is not None else 1,
        eos_token_ids=tuple(int(e) for e in eos_ids if e is not None),
        name=name,
    )
