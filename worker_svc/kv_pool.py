"""The paged KV cache: one preallocated pool of slots shared by all requests."""

from __future__ import annotations

import torch

from worker_svc.model_config import ModelConfig


class KvPool:
    """K and V for every layer and slot; slot = block_id * block_size + offset in block.

    Allocated once; requests own blocks through their block tables (kept by the scheduler).
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_layers = config.num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.dtype = dtype
        shape = (config.num_layers, self.num_slots, config.num_kv_heads, config.head_dim)
        self.device = torch.device(device)
        # k, v: [layers, slots, kv_heads, head_dim], allocated once, where the model runs
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_position(self) -> int:
        """Bytes one cached position takes: layers × (K and V) × KV heads × head dim × dtype."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element

    @property
    def pool_bytes(self) -> int:
        return self.num_slots * self.bytes_per_position

    def layer_pointers(self, layer: int) -> tuple[int, int]:
        """Addresses of a layer's K and V (the fused C kernels take pointers, not views)."""
        layer_bytes = self.k.stride(0) * self.k.element_size()
        return self.k.data_ptr() + layer * layer_bytes, self.v.data_ptr() + layer * layer_bytes

    def blocks(self, layer: int, which: str) -> torch.Tensor:
        """A layer's K or V by block: [num_blocks, block_size * kv_heads * head_dim]."""
        pool = self.k if which == "k" else self.v
        return pool[layer].view(self.num_blocks, -1)

    def rows(self, layer: int, which: str) -> torch.Tensor:
        """A layer's K or V as rows: [slots * kv_heads, head_dim]; row = slot * kv_heads + head."""
        pool = self.k if which == "k" else self.v
        return pool[layer].view(self.num_slots * self.num_kv_heads, self.head_dim)
