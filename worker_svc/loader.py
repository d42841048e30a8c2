"""Load a Llama-family model: tiny random, SmolLM2's GGUF, any GGUF file, or an HF directory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from llmcommon.model_files import display_name
from worker_svc.hf_dir import load_hf_dir
from worker_svc.model_config import ModelConfig, tiny_config
from worker_svc.quant import QUANTIZATIONS, Int4Codes, Source, quantize_int8
from worker_svc.quant_gguf import INT4_TYPES, int4_codes_from_gguf
from worker_svc.weights import LayerWeights, Weights, fuse_layer, quantize_weights

TINY_SEED = 0


def load_model(
    source: str, dtype: torch.dtype = torch.bfloat16, quantization: str = "none"
) -> tuple[ModelConfig, Weights]:
    """source: "tiny", "smollm2", a path to a .gguf file, or an HF model directory.
    quantization: none, int8, int4 or auto (a GGUF's 4-bit matrices kept as int4; none for the
    others), as in worker_svc.quant; the embedding and lm_head stay `dtype` (under auto a
    GGUF's quantized output matrix is also kept as int8 codes: output_int8)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not one of {QUANTIZATIONS}")
    if source == "smollm2":
        from llmcommon.model_files import default_gguf_path

        return load_gguf(default_gguf_path(), dtype, quantization)
    path = Path(source).expanduser()
    if source != "tiny" and path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype, quantization)
    config, weights = load_unquantized(source, path, dtype)
    return config, quantize_weights(weights, quantization)


def load_unquantized(source: str, path: Path, dtype: torch.dtype) -> tuple[ModelConfig, Weights]:
    if source == "tiny":
        return tiny_model(dtype)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_dir(path, dtype)
    raise ValueError(f"unknown model source {source!r}: not tiny/smollm2/.gguf/HF directory")


# ---------------------------------------------------------------------------- tiny random model


def tiny_model(dtype: torch.dtype) -> tuple[ModelConfig, Weights]:
    config = tiny_config()
    return config, random_weights(config, dtype, seed=TINY_SEED)


def random_weights(
    config: ModelConfig, dtype: torch.dtype, seed: int = 0, device: torch.device | str = "cpu"
) -> Weights:
    """Deterministic random weights, drawn in fp32 on `device` (the CPU by default), then cast.
    On a GPU a model of a real architecture's size is built in seconds from its config alone
    (the GPU check times such models: a forward's time does not depend on the weights' values).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, device=device) * (1.0 / cols) ** 0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=gen, device=device)

    embed = torch.randn(config.vocab_size, h, generator=gen, device=device)
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


def load_gguf(
    path: Path, dtype: torch.dtype, quantization: str = "none"
) -> tuple[ModelConfig, Weights]:
    """quantization other than none: the projections' 4-bit blocks (Q4_0, Q4_1, Q4_K) are read
    as codes, never as values; other types are read as values (worker_svc.quant)."""
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

    def projection(name: str) -> Source:
        """A matrix as its 4-bit codes where it has them and they are wanted, else values."""
        t = tensors[name]
        if quantization == "none" or t.tensor_type.name not in INT4_TYPES:
            return load(name)
        return int4_codes_from_gguf(t.tensor_type.name, t.data, int(t.shape[-1]))

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
        name=display_name(path),  # not general.name: the file's own, as users know it
    )
    if value("llama.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{path}: RoPE scaling is not supported")

    layers: list[LayerWeights] = []
    for n in range(config.num_layers):
        p = f"blk.{n}."
        layers.append(
            fuse_layer(
                attn_norm=load(p + "attn_norm.weight"),
                q=unpermute_rope(projection(p + "attn_q.weight"), num_heads),
                k=unpermute_rope(projection(p + "attn_k.weight"), num_kv_heads),
                v=projection(p + "attn_v.weight"),
                o=projection(p + "attn_output.weight"),
                mlp_norm=load(p + "ffn_norm.weight"),
                gate=projection(p + "ffn_gate.weight"),
                up=projection(p + "ffn_up.weight"),
                down=projection(p + "ffn_down.weight"),
                dtype=dtype,
                quantization=quantization,
            )
        )
    embed_values = load("token_embd.weight")
    embed = embed_values.to(dtype)
    head_name = "token_embd.weight" if config.tie_embeddings else "output.weight"
    head_values = embed_values if config.tie_embeddings else load(head_name)
    weights = Weights(
        embed=embed,
        layers=layers,
        final_norm=load("output_norm.weight").to(dtype),
        lm_head=embed if config.tie_embeddings else head_values.to(dtype),
        lm_head_int8=output_int8(tensors[head_name].tensor_type.name, head_values, dtype)
        if quantization == "auto"
        else None,
    )
    return config, weights


UNQUANTIZED_TYPES = ("F32", "F16", "BF16", "F64")


def output_int8(gguf_type: str, values: torch.Tensor, dtype: torch.dtype):
    """Under auto, the output matrix as int8 codes where the file stores it quantized (SmolLM2's
    Q4_1 file: Q8_0; Q4_K files: Q6_K): int8 per row, from the file's values, is as near to
    them as the supported type gets. None where the file stores it unquantized."""
    if gguf_type in UNQUANTIZED_TYPES:
        return None
    return quantize_int8(values, dtype)


def unpermute_rope(w: Source, num_heads: int) -> Source:
    """Undo llama.cpp's interleaving of q/k rows (inverse of convert_hf_to_gguf's permute).

    w: [heads * head_dim, hidden] (or 4-bit codes: their rows and groups move alike); per head
    llama.cpp stores rows as (half, pair) pairs, HF as (pair, half).
    """
    if isinstance(w, Int4Codes):
        return w.map_rows(lambda rows: unpermute_rope(rows, num_heads))
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
