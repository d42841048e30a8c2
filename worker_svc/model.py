"""The Llama forward in torch over a paged KV pool (flat token batch, mixed prefill/decode)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_svc.attention_plan import AttentionPlan
from worker_svc.kv_pool import KvPool
from worker_svc.linear import Linear, packing_available
from worker_svc.model_config import ModelConfig
from worker_svc.rope import RopeTable, apply_rope
from worker_svc.weights import Weights

__all__ = ["KvPool", "LlamaModel", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [tokens, hidden]; computed in fp32 and cast back, as transformers does."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)  # one fused kernel
    return weight * normed.to(x.dtype)


@dataclass(slots=True)
class LayerLinears:
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: Weights, dtype: torch.dtype) -> None:
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.rope = RopeTable(config.head_dim, config.rope_theta, config.max_context, dtype)
        pack = packing_available(dtype)
        self.linears = [
            LayerLinears(Linear(lw.qkv, pack), Linear(lw.o, pack), Linear(lw.gate_up, pack),
                         Linear(lw.down, pack))
            for lw in weights.layers
        ]
        self.lm_head = Linear(weights.lm_head, pack)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [tokens] int64
        positions: torch.Tensor,  # [tokens] int64
        slots: torch.Tensor,  # [tokens] int64, where each token's K/V goes in the pool
        plan: AttentionPlan,
        pool: KvPool,
        logit_rows: torch.Tensor,  # [rows] int64, tokens whose logits are wanted
    ) -> torch.Tensor:
        """Returns logits: [rows, vocab] fp32."""
        cfg, w = self.config, self.weights
        num_tokens = token_ids.shape[0]
        q_size, kv_size = cfg.q_size, cfg.kv_size
        qk_heads = cfg.num_heads + cfg.num_kv_heads
        eps = cfg.rms_norm_eps
        cos, sin = self.rope.lookup(positions)  # [tokens, 1, head_dim]
        x = w.embed[token_ids]  # x: [tokens, hidden]
        for layer_index, (layer, lin) in enumerate(zip(w.layers, self.linears, strict=True)):
            h = rms_norm(x, layer.attn_norm, eps)
            qkv = lin.qkv(h)  # qkv: [tokens, (heads + 2 * kv_heads) * head_dim]
            qk = qkv[:, : q_size + kv_size].view(num_tokens, qk_heads, cfg.head_dim)
            qk = apply_rope(qk, cos, sin)  # qk: [tokens, heads + kv_heads, head_dim]
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]  # [tokens, (kv_)heads, dim]
            v = qkv[:, q_size + kv_size :].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            pool.k[layer_index].index_copy_(0, slots, k)
            pool.v[layer_index].index_copy_(0, slots, v)
            attn = self.attention(layer_index, q, k, v, plan, pool)  # [tokens, heads * head_dim]
            x = x + lin.o(attn)
            h = rms_norm(x, layer.mlp_norm, eps)
            gate_up = lin.gate_up(h)  # [tokens, 2 * intermediate]
            gate, up = gate_up.chunk(2, dim=-1)
            x = x + lin.down(F.silu(gate) * up)
        x = rms_norm(x[logit_rows], w.final_norm, eps)  # x: [rows, hidden]
        return self.lm_head(x).float()  # [rows, vocab]

    def attention(
        self,
        layer_index: int,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,  # [tokens, kv_heads, head_dim]
        plan: AttentionPlan,
        pool: KvPool,
    ) -> torch.Tensor:
        cfg = self.config
        num_tokens = q.shape[0]
        out = torch.empty(num_tokens, cfg.num_heads, cfg.head_dim, dtype=q.dtype)
        nd = plan.num_decode
        if nd == num_tokens:  # decodes only
            return self.decode_attention(layer_index, q, plan, pool).view(num_tokens, cfg.q_size)
        if nd:
            out[:nd] = self.decode_attention(layer_index, q[:nd], plan, pool)
        for span in plan.prefills:
            rows = slice(span.offset, span.offset + span.length)
            qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, length, head_dim]
            if span.rows is None:  # no cached context: attend to the fresh K/V only
                kp = k[rows].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, length, head_dim]
                vp = v[rows].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            else:
                shape = (1, cfg.num_kv_heads, -1, cfg.head_dim)
                kp = pool.rows(layer_index, "k").index_select(0, span.rows).view(shape)
                vp = pool.rows(layer_index, "v").index_select(0, span.rows).view(shape)
                o = F.scaled_dot_product_attention(
                    qp, kp, vp, attn_mask=span.mask, enable_gqa=True
                )  # o: [1, heads, length, head_dim]
            out[rows] = o.squeeze(0).transpose(0, 1)  # [length, heads, head_dim]
        return out.view(num_tokens, cfg.q_size)

    def decode_attention(
        self, layer_index: int, q: torch.Tensor, plan: AttentionPlan, pool: KvPool
    ) -> torch.Tensor:
        """One query per request against its cached positions, all requests in one padded batch.

        q: [decodes, heads, head_dim] -> [decodes, heads, head_dim]. Plain batched matmuls:
        CPU flash SDPA is several times slower for single-query attention, and matmuls over
        strided (un-gathered) K/V copy internally.
        """
        cfg = self.config
        nd, groups = q.shape[0], cfg.num_heads // cfg.num_kv_heads
        shape = (nd, cfg.num_kv_heads, plan.decode_context, cfg.head_dim)
        # k_ctx, v_ctx: [decodes, kv_heads, context, head_dim], gathered contiguous
        k_ctx = pool.rows(layer_index, "k").index_select(0, plan.decode_rows).view(shape)
        v_ctx = pool.rows(layer_index, "v").index_select(0, plan.decode_rows).view(shape)
        qg = q.view(nd, cfg.num_kv_heads, groups, cfg.head_dim)  # [decodes, kv, groups, dim]
        scores = torch.matmul(qg, k_ctx.transpose(2, 3)).float()  # [decodes, kv, groups, ctx]
        scores = scores * cfg.head_dim**-0.5 + plan.decode_bias
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        o = torch.matmul(probs, v_ctx)  # [decodes, kv, groups, dim]
        return o.view(nd, cfg.num_heads, cfg.head_dim)
