"""The Llama forward in torch over a paged KV pool (flat token batch, mixed prefill/decode)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_svc import cpu_kernels
from worker_svc.attention_backend import attention_backend, requested_backend
from worker_svc.attention_plan import AttentionPlan, PagedBatch, paged_batch
from worker_svc.cpu_features import host_features
from worker_svc.kv_pool import KvPool, as_stored
from worker_svc.linear import Linear, QuantizedLinear, make_linear, packing_available
from worker_svc.model_config import ModelConfig
from worker_svc.near_ties import NEAR, refine_near_max
from worker_svc.rope import RopeTable, apply_rope
from worker_svc.weights import Weights

__all__ = ["KvPool", "LlamaModel", "rms_norm"]


def torch_mlp(lin: LayerLinears, h: torch.Tensor) -> torch.Tensor:
    """down(silu(gate) * up) of h [tokens, hidden] by torch ops."""
    gate, up = lin.gate_up(h).chunk(2, dim=-1)
    return lin.down(F.silu(gate) * up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [tokens, hidden]. One fused kernel (fp32 accumulation inside for bf16); transformers
    rounds to bf16 before the weight multiply, we round once after it."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@dataclass(slots=True)
class LayerLinears:
    qkv: Linear | QuantizedLinear
    o: Linear | QuantizedLinear
    gate_up: Linear | QuantizedLinear
    down: Linear | QuantizedLinear


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        dtype: torch.dtype,
        use_kernels: bool = True,
    ) -> None:
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.rope = RopeTable(
            config.head_dim, config.rope_theta, config.max_context, dtype, config.rope_scaling
        )
        # oneDNN's packed matmuls are CPU-only: weights drawn on a GPU (the GPU check's random
        # weights) keep the plain ones
        on_cpu = weights.embed.device.type == "cpu"
        self.linears, self.lm_head = self.make_linears(on_cpu and packing_available(dtype))
        groups = config.num_heads // config.num_kv_heads
        kv_of_head = torch.arange(config.num_heads) // groups  # [heads]
        self.head_of_query = kv_of_head.view(1, config.num_heads, 1, 1)
        self.kernels = cpu_kernels.load() if use_kernels and dtype == torch.bfloat16 else None
        # the fused kernels' residual stream: fp32 (SmolLM2's next-token KL to an fp32 run
        # 0.0016 -> 0.0006 nats unquantized, 0.0022 -> 0.0015 under auto: docs/figures.md);
        # LLMSERVE_RESIDUAL=bf16 keeps it bf16, as before (for comparison:
        # llmserve.bench.quant_accuracy --reference fp32)
        bf16 = os.environ.get("LLMSERVE_RESIDUAL", "fp32") == "bf16"
        self.residual_dtype = torch.bfloat16 if bf16 else torch.float32
        self.attention_choice = requested_backend()  # auto: Triton on CUDA, torch on CPU

    def make_linears(self, pack: bool) -> tuple[list[LayerLinears], Linear | QuantizedLinear]:
        linears = [
            LayerLinears(
                make_linear(lw.qkv, pack, lw.qkv_bias),
                make_linear(lw.o, pack, lw.o_bias),
                make_linear(lw.gate_up, pack, lw.gate_up_bias),
                make_linear(lw.down, pack, lw.down_bias),
            )
            for lw in self.weights.layers
        ]
        head = Linear(self.weights.lm_head, pack)
        codes = self.weights.lm_head_int8
        if codes is not None:  # int8 for a few logit rows, the dense matmul above
            rows = host_features().output_int8_max_rows(codes.blocked is not None)
            return linears, QuantizedLinear(codes, None, head, rows)
        return linears, head

    def to(self, device: torch.device) -> LlamaModel:
        """Weights, RoPE tables and index tensors on `device` (in place; returns self). The
        packed CPU matmuls are CPU-only: elsewhere the plain weights serve."""
        if device.type == "cpu":
            return self  # made on the CPU
        self.weights = self.weights.to(device)
        self.rope = self.rope.to(device)
        self.head_of_query = self.head_of_query.to(device)
        self.linears, self.lm_head = self.make_linears(False)
        self.kernels = None
        return self

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
        num_tokens = token_ids.shape[0]
        backend = attention_backend(pool.k.device, self.attention_choice)
        # decode-only steps take the fused-kernel path (bf16), no slower than the torch path at
        # any batch (docs/figures.md)
        if self.kernels is not None and backend == "torch" and plan.num_decode == num_tokens:
            return self.forward_small_decode(token_ids, positions, slots, plan, pool, logit_rows)
        if backend == "triton":
            paged = paged_batch(plan, pool.block_size, pool.k.device)
            return self.forward_paged(token_ids, positions, slots, paged, pool, logit_rows)

        def attend(layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            return self.attention(layer_index, q, k, v, plan, pool)  # [tokens, q_size]

        return self.run_layers(token_ids, positions, slots, pool, logit_rows, attend)

    @torch.inference_mode()
    def forward_paged(
        self,
        token_ids: torch.Tensor,  # [tokens] int64
        positions: torch.Tensor,  # [tokens] int64
        slots: torch.Tensor,  # [tokens] int64
        paged: PagedBatch,
        pool: KvPool,
        logit_rows: torch.Tensor,  # [rows] int64
    ) -> torch.Tensor:
        """forward() by the Triton kernels over a ready PagedBatch. It does no host work and no
        device sync, so a decode step of a fixed shape can be captured as a CUDA graph."""

        def attend(layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            return self.paged_attention(layer_index, q, paged, pool)  # [tokens, q_size]

        return self.run_layers(token_ids, positions, slots, pool, logit_rows, attend)

    def run_layers(self, token_ids, positions, slots, pool: KvPool, logit_rows, attend):
        """The layers, each token's K/V stored in the pool before `attend` reads it."""
        cfg, w = self.config, self.weights
        num_tokens = token_ids.shape[0]
        q_size, kv_size = cfg.q_size, cfg.kv_size
        qk_heads = cfg.num_heads + cfg.num_kv_heads
        eps = cfg.rms_norm_eps
        x = w.embed[token_ids]  # x: [tokens, hidden], a fresh tensor
        kern = self.kernels  # bf16 on CPU: residual adds and norms fused, x updated in place
        if kern is not None:
            kern.set_threads(torch.get_num_threads())
            h = torch.empty_like(x)  # the normed input of the next matmul, bf16
            x = x.to(self.residual_dtype)  # the residual stream, fp32 (add_rms_norm_f32)
            kern.add_rms_norm(x, None, w.layers[0].attn_norm, eps, h)
            # RoPE and the K/V store in one kernel (as a decode-only step's), the rotated q and
            # k written here for attention: a fifth of a 128-token prompt's step went to
            # torch's RoPE ops and index_copy_ before
            q = torch.empty(num_tokens, cfg.num_heads, cfg.head_dim, dtype=h.dtype)
            k = torch.empty(num_tokens, cfg.num_kv_heads, cfg.head_dim, dtype=h.dtype)
        else:
            cos, sin = self.rope.lookup(positions)  # [tokens, 1, head_dim]
        for layer_index, (layer, lin) in enumerate(zip(w.layers, self.linears, strict=True)):
            if kern is None:
                h = rms_norm(x, layer.attn_norm, eps)
            qkv = lin.qkv(h)  # qkv: [tokens, (heads + 2 * kv_heads) * head_dim]
            v = qkv[:, q_size + kv_size :].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            if kern is not None:
                kern.rope_store(
                    qkv, self.rope.cos, self.rope.sin, positions, slots, q,
                    *pool.layer_pointers(layer_index), cfg.num_kv_heads, k_out=k,
                    scales=pool.scale_pointers(layer_index),
                )  # fmt: skip
            else:
                qk = qkv[:, : q_size + kv_size].view(num_tokens, qk_heads, cfg.head_dim)
                qk = apply_rope(qk, cos, sin)  # qk: [tokens, heads + kv_heads, head_dim]
                q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]  # [tokens, (kv_)heads, dim]
                pool.store(layer_index, slots, k, v)
            attn = attend(layer_index, q, k, v)  # [tokens, q_size]
            if kern is None:
                x = x + lin.o(attn)
                h = rms_norm(x, layer.mlp_norm, eps)
            else:
                kern.add_rms_norm(x, lin.o(attn), layer.mlp_norm, eps, h)
            down = self.mlp(lin, h)
            if kern is None:
                x = x + down
            else:  # h: the next layer's input, or the final norm's output
                kern.add_rms_norm(x, down, self.norm_after(layer_index), eps, h)
        if kern is not None:
            return self.output(h[logit_rows])  # [rows, vocab]
        x = rms_norm(x[logit_rows], w.final_norm, eps)  # x: [rows, hidden]
        return self.output(x)  # [rows, vocab]

    def forward_small_decode(
        self,
        token_ids: torch.Tensor,  # [n] int64, one token per request
        positions: torch.Tensor,  # [n] int64
        slots: torch.Tensor,  # [n] int64
        plan: AttentionPlan,
        pool: KvPool,
        logit_rows: torch.Tensor,  # [rows] int64
    ) -> torch.Tensor:
        """forward() for a few decodes: norms, RoPE, the K/V store and attention run as fused
        kernels (four calls per layer instead of ~35 torch ops); the matmuls are the same."""
        cfg, w, kern = self.config, self.weights, self.kernels
        assert kern is not None
        n, eps, kv_heads = token_ids.shape[0], cfg.rms_norm_eps, cfg.num_kv_heads
        h = w.embed[token_ids]  # [n, hidden] bf16, a fresh tensor: the next matmul's input
        x = h.to(self.residual_dtype, copy=True)  # the residual stream, updated in place below
        q = torch.empty(n, cfg.num_heads, cfg.head_dim, dtype=h.dtype)
        attn = torch.empty_like(q)
        tables = plan.decode_blocks.view(n, -1)  # [n, max_blocks]
        # one layer's K (or V) pool in bytes; pointers instead of per-layer views
        scale = cfg.head_dim**-0.5
        cos, sin = self.rope.cos, self.rope.sin  # whole tables: the kernel indexes positions
        kern.set_threads(torch.get_num_threads())  # as many as the matmuls use
        kern.add_rms_norm(x, None, w.layers[0].attn_norm, eps, h)
        for layer_index, lin in enumerate(self.linears):
            k_layer, v_layer = pool.layer_pointers(layer_index)
            scales = pool.scale_pointers(layer_index)  # an int8 pool's; else None
            qkv = lin.qkv(h)  # [n, (heads + 2 * kv_heads) * head_dim]
            kern.rope_store(
                qkv, cos, sin, positions, slots, q, k_layer, v_layer, kv_heads, scales=scales
            )
            kern.decode_attention(
                q, k_layer, v_layer, tables, plan.decode_lengths, pool.block_size, kv_heads,
                scale, attn, scales=scales,
            )  # fmt: skip
            kern.add_rms_norm(x, lin.o(attn.view(n, -1)), w.layers[layer_index].mlp_norm, eps, h)
            down = self.mlp(lin, h)
            # h: the next layer's input, or the final norm's output
            kern.add_rms_norm(x, down, self.norm_after(layer_index), eps, h)
        return self.output(h[logit_rows])  # [rows, vocab]

    def output(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] fp32 of the final hidden rows h. On the CPU in bf16 (or fp16)
        the entries near each row's maximum are recomputed in fp32 (near_ties.py), so that
        greedy does not pick between near-equal tokens by how the step's rounding fell. The GPU
        path (forward_paged, CUDA graphs) keeps the kernel's logits."""
        logits = self.lm_head(h).float()
        if h.dtype == torch.float32 or h.device.type != "cpu":
            return logits
        head = self.weights.lm_head
        kern = self.kernels
        if (
            kern is None
            or not head.is_contiguous()
            or not kern.refine_near_max(logits, h, head, NEAR)
        ):
            refine_near_max(logits, h, head)
        return logits

    def mlp(self, lin: LayerLinears, h: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up) of h [tokens, hidden]; with the kernels, silu and the product
        are one pass over the gate/up projection's rows, rounded to bf16 once."""
        if self.kernels is None:
            return torch_mlp(lin, h)
        act = torch.empty(h.shape[0], self.config.intermediate_size, dtype=h.dtype)
        self.kernels.silu_mul(lin.gate_up(h), act)  # gate_up: [tokens, 2 * intermediate]
        return lin.down(act)

    def norm_after(self, layer_index: int) -> torch.Tensor:
        """The norm weight of what follows the layer's MLP: the next layer's, or the final."""
        layers = self.weights.layers
        return layers[layer_index + 1].attn_norm if layer_index + 1 < len(layers) else (
            self.weights.final_norm
        )  # fmt: skip

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
        out = torch.empty(num_tokens, cfg.num_heads, cfg.head_dim, dtype=q.dtype, device=q.device)
        nd = plan.num_decode
        if nd == num_tokens:  # decodes only
            return self.decode_attention(layer_index, q, plan, pool).view(num_tokens, cfg.q_size)
        if nd and self.kernels is not None:  # the fused kernel, as in a decode-only step
            self.fused_decode_attention(layer_index, q[:nd].contiguous(), plan, pool, out[:nd])
        elif nd:
            out[:nd] = self.decode_attention(layer_index, q[:nd], plan, pool)
        for span in plan.prefills:
            rows = slice(span.offset, span.offset + span.length)
            qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, length, head_dim]
            if span.rows is None:  # no cached context: attend to the fresh K/V only
                kp, vp = k[rows], v[rows]  # [length, kv_heads, head_dim]
                if pool.quantized:  # as the pool holds them, as a later chunk reads them
                    kp, vp = as_stored(kp, self.kernels), as_stored(vp, self.kernels)
                kp = kp.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, length, head_dim]
                vp = vp.transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            else:
                shape = (1, cfg.num_kv_heads, -1, cfg.head_dim)
                kp = pool.gather_rows(layer_index, "k", span.rows, self.kernels).view(shape)
                vp = pool.gather_rows(layer_index, "v", span.rows, self.kernels).view(shape)
                o = F.scaled_dot_product_attention(
                    qp, kp, vp, attn_mask=span.mask, enable_gqa=True
                )  # o: [1, heads, length, head_dim]
            out[rows] = o.squeeze(0).transpose(0, 1)  # [length, heads, head_dim]
        return out.view(num_tokens, cfg.q_size)

    def fused_decode_attention(
        self,
        layer_index: int,
        q: torch.Tensor,  # [decodes, heads, head_dim], contiguous
        plan: AttentionPlan,
        pool: KvPool,
        out: torch.Tensor,  # [decodes, heads, head_dim], contiguous: written
    ) -> None:
        """The decodes of a step with prompt chunks, by the fused kernel (their K/V is in the
        pool already): it reads the blocks in place, where the torch path gathers every
        request's context into one padded batch first, which makes a mixed step cost far more
        than its decodes and its chunk apart (docs/figures.md)."""
        assert self.kernels is not None
        cfg = self.config
        k_layer, v_layer = pool.layer_pointers(layer_index)  # run_layers set the threads
        self.kernels.decode_attention(
            q, k_layer, v_layer, plan.decode_blocks.view(q.shape[0], -1), plan.decode_lengths,
            pool.block_size, cfg.num_kv_heads, cfg.head_dim**-0.5, out,
            scales=pool.scale_pointers(layer_index),
        )  # fmt: skip

    def paged_attention(
        self,
        layer_index: int,
        q: torch.Tensor,  # [tokens, heads, head_dim]: decodes first, then the chunks
        batch: PagedBatch,
        pool: KvPool,
    ) -> torch.Tensor:
        """attention() by the Triton kernels, which read K/V through the block tables."""
        from worker_svc import triton_attention as kernels  # imports triton: Triton backend only

        cfg = self.config
        shape = (pool.num_blocks, pool.block_size, cfg.num_kv_heads, cfg.head_dim)
        scales = None  # an int8 pool's: [blocks, block_size, kv_heads] each
        if pool.k_scale is not None and pool.v_scale is not None:
            scales = (
                pool.k_scale[layer_index].view(shape[:3]),
                pool.v_scale[layer_index].view(shape[:3]),
            )
        k_cache = pool.k[layer_index].view(shape)  # [blocks, block_size, kv_heads, head_dim]
        v_cache = pool.v[layer_index].view(shape)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [tokens, heads, head_dim]
        scale = cfg.head_dim**-0.5
        kernels.paged_decode_attention(
            q, k_cache, v_cache, batch.decode_tables, batch.decode_lengths, scale, out, scales
        )
        kernels.paged_prefill_attention(
            q, k_cache, v_cache, batch.chunk_tables, batch.chunk_offsets, batch.chunk_lengths,
            batch.chunk_starts, batch.max_chunk_length, scale, out, scales,
        )  # fmt: skip
        return out.view(q.shape[0], cfg.q_size)

    def decode_attention(
        self, layer_index: int, q: torch.Tensor, plan: AttentionPlan, pool: KvPool
    ) -> torch.Tensor:
        """One query per request against its cached positions, all requests in one padded batch.

        q: [decodes, heads, head_dim] -> [decodes, heads, head_dim].
        K/V are gathered by whole blocks, so they stay [context, kv_heads, head_dim] per request;
        rather than transposing them per KV head (a strided copy), each query head is scored
        against all KV heads in one contiguous batched matmul and its own head is picked out;
        likewise P @ V yields every head's probabilities against all KV heads' values and each
        query head keeps its own. The extra flops are cheap next to the copies they save.
        """
        cfg = self.config
        nd, heads, kv_heads = q.shape[0], cfg.num_heads, cfg.num_kv_heads
        context = plan.decode_context
        shape = (nd, context * kv_heads, cfg.head_dim)
        # k_ctx: [decodes, context * kv_heads, head_dim]; v_ctx: [decodes, context, kv * dim]
        k_ctx = pool.gather_blocks(layer_index, "k", plan.decode_blocks).view(shape)
        v_ctx = pool.gather_blocks(layer_index, "v", plan.decode_blocks)
        v_ctx = v_ctx.view(nd, context, kv_heads * cfg.head_dim)
        scores = torch.bmm(q, k_ctx.transpose(1, 2)).view(nd, heads, context, kv_heads)
        own = self.head_of_query.expand(nd, heads, context, 1)
        scores = scores.gather(3, own).view(nd, heads, context)  # [decodes, heads, context]
        scores = torch.add(plan.decode_bias, scores, alpha=cfg.head_dim**-0.5)  # fp32
        probs = torch.softmax(scores, dim=-1).to(q.dtype)  # [decodes, heads, context]
        out = torch.bmm(probs, v_ctx).view(nd, heads, kv_heads, cfg.head_dim)
        own = self.head_of_query.expand(nd, heads, 1, cfg.head_dim)
        return out.gather(2, own).view(nd, heads, cfg.head_dim)  # [decodes, heads, head_dim]
