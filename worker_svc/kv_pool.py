"""The paged KV cache: one preallocated pool of slots shared by all requests.

With `cache_dtype="int8"` (--kv-cache-dtype int8) the pool holds int8 codes and one fp32 scale
per (position, KV head): a cached row is `code * scale`, quantized symmetrically from the model's
values (`quantize_kv`). A position then takes (head_dim + 4) bytes per KV head and layer, where
bf16 takes 2 * head_dim: for head_dim 64, 0.53 of the bytes, so the same memory holds 1.88x the
positions, and decode attention, which reads every cached position, reads about half as much.
"""

from __future__ import annotations

import torch

from worker_svc.model_config import ModelConfig

CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype


def position_bytes(config: ModelConfig, dtype: torch.dtype, cache_dtype: str = "auto") -> int:
    """Bytes one cached position takes: layers × (K and V) × KV heads × the row's bytes."""
    if cache_dtype == "int8":
        row = config.head_dim + 4  # codes, and the fp32 scale
    else:
        row = config.head_dim * torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * config.num_kv_heads * row


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes int8 [..., head_dim], scales fp32 [...]): per row, scale =
    max |x| / 127 and code = x * (127 / max |x|) rounded to nearest even, in fp32, as the C
    kernel (rope_store_q8) computes them, so that both paths store the same codes."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # a tensor over a tensor: an IEEE division, as C's 127.f / amax (a number over a tensor is
    # a reciprocal times the number in torch, which rounds differently)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(xf * inv).to(torch.int8)
    return codes, (amax / 127.0).squeeze(-1)


def as_stored(x: torch.Tensor, kernels=None) -> torch.Tensor:
    """x [..., head_dim] as an int8 pool holds it: quantize_kv's codes times their scales, in
    x's dtype (the values a later read of the pool gives, bit for bit); x [n, heads, dim] bf16
    on the CPU in one pass by `kernels` (cpu_kernels.CpuKernels) where given (torch's dozen ops a
    layer cost a 128-token prompt step 6%)."""
    if kernels is not None and x.device.type == "cpu" and x.dim() == 3:
        out = kernels.as_stored(x)
        if out is not None:
            return out
    codes, scales = quantize_kv(x)
    return (codes.float() * scales.unsqueeze(-1)).to(x.dtype)


class KvPool:
    """K and V for every layer and slot; slot = block_id * block_size + offset in block.

    Allocated once; requests own blocks through their block tables (kept by the scheduler).
    `dtype` is the model's: what attention computes in (and, unquantized, what the pool holds).
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        cache_dtype: str = "auto",
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"KV cache dtype {cache_dtype!r}: one of {', '.join(CACHE_DTYPES)}")
        self.config = config
        self.num_layers = config.num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.dtype = dtype
        self.cache_dtype = cache_dtype
        self.quantized = cache_dtype == "int8"
        shape = (config.num_layers, self.num_slots, config.num_kv_heads, config.head_dim)
        self.device = torch.device(device)
        stored = torch.int8 if self.quantized else dtype
        # k, v: [layers, slots, kv_heads, head_dim], allocated once, where the model runs
        self.k = torch.zeros(shape, dtype=stored, device=self.device)
        self.v = torch.zeros(shape, dtype=stored, device=self.device)
        # int8: each row's scale, [layers, slots, kv_heads]
        self.k_scale = self.v_scale = None
        if self.quantized:
            self.k_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=self.device)
            self.v_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=self.device)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_position(self) -> int:
        return position_bytes(self.config, self.dtype, self.cache_dtype)

    @property
    def pool_bytes(self) -> int:
        return self.num_slots * self.bytes_per_position

    def layer_pointers(self, layer: int) -> tuple[int, int]:
        """Addresses of a layer's K and V (the fused C kernels take pointers, not views)."""
        layer_bytes = self.k.stride(0) * self.k.element_size()
        return self.k.data_ptr() + layer * layer_bytes, self.v.data_ptr() + layer * layer_bytes

    def scale_pointers(self, layer: int) -> tuple[int, int] | None:
        """Addresses of a layer's K and V scales; None for a pool that is not quantized."""
        if self.k_scale is None or self.v_scale is None:
            return None
        layer_bytes = self.k_scale.stride(0) * self.k_scale.element_size()
        return (
            self.k_scale.data_ptr() + layer * layer_bytes,
            self.v_scale.data_ptr() + layer * layer_bytes,
        )

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [tokens, kv_heads, head_dim] into their slots (quantized in an int8 pool)."""
        if not self.quantized:
            self.k[layer].index_copy_(0, slots, k)
            self.v[layer].index_copy_(0, slots, v)
            return
        assert self.k_scale is not None and self.v_scale is not None
        for pool, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            codes, scale = quantize_kv(x)
            pool[layer].index_copy_(0, slots, codes)
            scales[layer].index_copy_(0, slots, scale)

    def blocks(self, layer: int, which: str) -> torch.Tensor:
        """A layer's K or V by block: [num_blocks, block_size * kv_heads * head_dim] (the
        stored values: int8 codes in a quantized pool)."""
        pool = self.k if which == "k" else self.v
        return pool[layer].view(self.num_blocks, -1)

    def rows(self, layer: int, which: str) -> torch.Tensor:
        """A layer's K or V as rows: [slots * kv_heads, head_dim]; row = slot * kv_heads + head
        (the stored values, as blocks())."""
        pool = self.k if which == "k" else self.v
        return pool[layer].view(self.num_slots * self.num_kv_heads, self.head_dim)

    def gather_rows(self, layer: int, which: str, rows: torch.Tensor, kernels=None) -> torch.Tensor:
        """Rows (as rows() numbers them) as values in the model's dtype: [len(rows), head_dim];
        from an int8 pool in bf16 on the CPU by `kernels` (cpu_kernels.CpuKernels) where given,
        in one pass (torch's three cost a 128-token chunk after 2,048 cached positions 5%)."""
        if not self.quantized:
            return self.rows(layer, which).index_select(0, rows)
        scales = (self.k_scale if which == "k" else self.v_scale)[layer].view(-1)
        if kernels is not None and self.dtype == torch.bfloat16 and self.device.type == "cpu":
            out = kernels.gather_q8(self.rows(layer, which), scales, rows)
            if out is not None:
                return out
        picked = self.rows(layer, which).index_select(0, rows)
        return (picked.float() * scales.index_select(0, rows).unsqueeze(-1)).to(self.dtype)

    def gather_blocks(self, layer: int, which: str, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks as values in the model's dtype: [len(block_ids), block_size * kv_heads *
        head_dim]."""
        picked = self.blocks(layer, which).index_select(0, block_ids)
        if not self.quantized:
            return picked
        scales = (self.k_scale if which == "k" else self.v_scale)[layer]
        scales = scales.view(self.num_blocks, -1).index_select(0, block_ids)
        rows = picked.view(len(block_ids), -1, self.head_dim).float() * scales.unsqueeze(-1)
        return rows.to(self.dtype).view(len(block_ids), -1)
