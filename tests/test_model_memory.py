"""The KV pool: size formula, allocated once, and no memory growth over many steps."""

from __future__ import annotations

import os

import torch

from tests.model_support import (
    model,
    one_torch_thread,  # noqa: F401  (autouse fixture)
)
from worker_svc.kv_pool import KvPool
from worker_svc.model_config import smollm2_135m_config, tiny_config
from worker_svc.runner import ModelRunner
from worker_svc.work import WorkItem


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_pool_bytes_formula() -> None:
    config = smollm2_135m_config()
    pool = KvPool(config, num_blocks=10, block_size=16, dtype=torch.bfloat16)
    assert pool.bytes_per_position == 30 * 2 * 3 * 64 * 2  # layers × K,V × kv heads × dim × 2B
    assert pool.pool_bytes == 160 * pool.bytes_per_position
    assert pool.k.shape == (30, 160, 3, 64) and pool.v.shape == (30, 160, 3, 64)
    assert pool.k.nbytes + pool.v.nbytes == pool.pool_bytes
    tiny32 = KvPool(tiny_config(), num_blocks=3, block_size=8, dtype=torch.float32)
    assert tiny32.bytes_per_position == 2 * 2 * 2 * 16 * 4


def test_pool_is_allocated_once_and_rss_is_stable() -> None:
    config, weights = model("tiny")
    runner = ModelRunner(config, weights, num_blocks=64, block_size=16, dtype=torch.float32)
    k_ptr, v_ptr = runner.pool.k.data_ptr(), runner.pool.v.data_ptr()
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(5)]

    def step(n: int) -> None:
        # 4 decodes cycling through contexts of 1..60 positions, plus a prefill chunk
        pos = n % 60
        items = [WorkItem(str(i), [(n + i) % 49152], pos, tables[i]) for i in range(4)]
        items.append(WorkItem("p", list(range(4)), 0, tables[4]))
        runner.execute(items)

    for n in range(60):  # warm up allocator caches
        step(n)
    before = rss_bytes()
    for n in range(1000):
        step(n)
    growth = rss_bytes() - before
    assert runner.pool.k.data_ptr() == k_ptr and runner.pool.v.data_ptr() == v_ptr
    assert growth < 8 * 1024 * 1024, f"RSS grew by {growth / 2**20:.1f} MiB over 1000 steps"
