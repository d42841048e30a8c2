"""ModelConfig from a Hugging Face config.json of a Llama-family model (transformers 4.x and 5.x
spellings), refusing what the forward does not implement."""

from __future__ import annotations

from worker_svc.model_config import ModelConfig, RopeScaling

MODEL_TYPES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")


def config_from_hf(raw: dict, name: str, generation: dict | None = None) -> ModelConfig:
    """raw: config.json; generation: generation_config.json, whose eos_token_id may add a chat
    model's end-of-turn token (Qwen2.5 Instruct's lists <|im_end|> and <|endoftext|>)."""
    model_type = raw.get("model_type", "llama")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (one of {MODEL_TYPES})")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (silu only)")
    check_no_sliding_window(raw)
    rope = rope_parameters(raw)
    num_heads = raw["num_attention_heads"]
    generation_eos = (generation or {}).get("eos_token_id")
    eos_ids = token_ids(raw.get("eos_token_id", 2)) + token_ids(generation_eos)
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_context=raw.get("max_position_embeddings", 2048),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id") if raw.get("bos_token_id") is not None else 1,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        name=name,
        rope_scaling=rope_scaling(rope, raw),
    )


def token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    return tuple(int(v) for v in values if v is not None)


def rope_parameters(raw: dict) -> dict:
    """transformers 5.x writes `rope_parameters` (with rope_theta inside), 4.x `rope_scaling`."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    return rope


def rope_scaling(rope: dict, raw: dict) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"RoPE type {kind!r} is not supported (one of {ROPE_TYPES})")
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    original = rope.get("original_max_position_embeddings") or raw["max_position_embeddings"]
    return RopeScaling(
        "llama3",
        float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_positions=int(original),
    )


def check_no_sliding_window(raw: dict) -> None:
    """Attention here is full causal: refuse a config where a layer attends through a window
    shorter than the context (Qwen2 with use_sliding_window, Mistral 7B v0.1)."""
    layers = sliding_window_layers(raw)
    if layers:
        window = raw["sliding_window"]
        raise ValueError(
            f"sliding-window attention ({layers} layers, window {window}) is not supported"
        )


def sliding_window_layers(raw: dict) -> int:
    """How many layers transformers would run with a window that cuts into the context."""
    model_type = raw.get("model_type", "llama")
    window = raw.get("sliding_window", 4096 if model_type == "mistral" else None)
    if model_type == "qwen2" and not raw.get("use_sliding_window", False):
        return 0
    if window is None or window >= raw.get("max_position_embeddings", 2048):
        return 0
    types = raw.get("layer_types")
    if types is not None:
        return types.count("sliding_attention")
    num_layers = raw["num_hidden_layers"]
    if model_type == "qwen2":  # the layers from max_window_layers on
        return max(0, num_layers - raw.get("max_window_layers", 28))
    return num_layers
