"""Load a Hugging Face model directory: config.json and its *.safetensors files (sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from worker_svc.hf_config import config_from_hf
from worker_svc.model_config import ModelConfig
from worker_svc.weights import PROJECTIONS, LayerWeights, Weights, fuse_layer

UNUSED_SUFFIXES = (".rotary_emb.inv_freq",)  # older checkpoints store RoPE's table


class TensorFiles:
    """The tensors of a directory's safetensors files, read one at a time (memory-mapped)."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files")
        handles = [safe_open(str(file), framework="pt") for file in files]
        self.where = {name: handle for handle in handles for name in handle.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def take(self, name: str) -> torch.Tensor:
        """The tensor in fp32; each is taken once, so what is left at the end went unused."""
        handle = self.where.pop(name, None)
        if handle is None:
            raise ValueError(f"no tensor {name!r} in the safetensors files")
        return handle.get_tensor(name).to(torch.float32)

    def take_if_present(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self else None


def load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, Weights]:
    raw = json.loads((path / "config.json").read_text())
    generation = path / "generation_config.json"
    extra = json.loads(generation.read_text()) if generation.is_file() else None
    config = config_from_hf(raw, name=path.name, generation=extra)
    files = TensorFiles(path)
    layers = [load_layer(files, f"model.layers.{n}.", dtype) for n in range(config.num_layers)]
    embed = files.take("model.embed_tokens.weight").to(dtype)
    final_norm = files.take("model.norm.weight").to(dtype)
    if config.tie_embeddings:
        files.take_if_present("lm_head.weight")  # some tied checkpoints store the copy too
        lm_head = embed
    elif "lm_head.weight" in files:
        lm_head = files.take("lm_head.weight").to(dtype)
    else:
        raise ValueError(f"{path}: tie_word_embeddings is false but there is no lm_head.weight")
    unused = sorted(n for n in files.where if not n.endswith(UNUSED_SUFFIXES))
    if unused:
        raise ValueError(f"{path}: tensors this Llama forward has no place for: {unused[:5]}")
    return config, Weights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def load_layer(files: TensorFiles, prefix: str, dtype: torch.dtype) -> LayerWeights:
    def proj(name: str) -> str:
        return f"{prefix}{'self_attn' if name in ('q', 'k', 'v', 'o') else 'mlp'}.{name}_proj."

    biases = {name: files.take_if_present(proj(name) + "bias") for name in PROJECTIONS}
    return fuse_layer(
        attn_norm=files.take(prefix + "input_layernorm.weight"),
        q=files.take(proj("q") + "weight"),
        k=files.take(proj("k") + "weight"),
        v=files.take(proj("v") + "weight"),
        o=files.take(proj("o") + "weight"),
        mlp_norm=files.take(prefix + "post_attention_layernorm.weight"),
        gate=files.take(proj("gate") + "weight"),
        up=files.take(proj("up") + "weight"),
        down=files.take(proj("down") + "weight"),
        dtype=dtype,
        biases={name: b for name, b in biases.items() if b is not None},
    )
