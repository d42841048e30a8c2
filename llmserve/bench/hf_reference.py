"""transformers' LlamaForCausalLM built from our config and weights: the oracle for tests and
the baseline for the benchmark (transformers is a test/bench dependency only)."""

from __future__ import annotations

import torch

from worker_svc.model_config import ModelConfig
from worker_svc.weights import Weights


def hf_config(config: ModelConfig):  # -> transformers.LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_context,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=list(config.eos_token_ids),
        pad_token_id=config.eos_token_ids[0],
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )


def hf_state_dict(config: ModelConfig, weights: Weights) -> dict[str, torch.Tensor]:
    """Our fused layout split back into HF parameter names."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    state = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.final_norm}
    if not config.tie_embeddings:
        state["lm_head.weight"] = weights.lm_head
    for n, layer in enumerate(weights.layers):
        p = f"model.layers.{n}."
        state[p + "input_layernorm.weight"] = layer.attn_norm
        state[p + "self_attn.q_proj.weight"] = layer.qkv[:q]
        state[p + "self_attn.k_proj.weight"] = layer.qkv[q : q + kv]
        state[p + "self_attn.v_proj.weight"] = layer.qkv[q + kv :]
        state[p + "self_attn.o_proj.weight"] = layer.o
        state[p + "post_attention_layernorm.weight"] = layer.mlp_norm
        state[p + "mlp.gate_proj.weight"] = layer.gate_up[:inter]
        state[p + "mlp.up_proj.weight"] = layer.gate_up[inter:]
        state[p + "mlp.down_proj.weight"] = layer.down
    return {name: t.contiguous().clone() for name, t in state.items()}


def hf_model(config: ModelConfig, weights: Weights, dtype: torch.dtype, attn: str = "sdpa"):
    """An eval-mode LlamaForCausalLM holding copies of our weights in dtype."""
    from transformers import LlamaForCausalLM

    cfg = hf_config(config)
    cfg._attn_implementation = attn
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    result = model.load_state_dict(hf_state_dict(config, weights), assign=True, strict=False)
    allowed = {"lm_head.weight"} if config.tie_embeddings else set()
    if set(result.missing_keys) - allowed or result.unexpected_keys:
        raise RuntimeError(f"weights do not fit LlamaForCausalLM: {result}")
    if config.tie_embeddings:
        model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)  # buffers were on meta
    return model.to(dtype).eval()
