"""The router's cost at scale: µs per decision (route + done) at 64 cells, and the memory of its
index when every cell's is full. A benchmark, not a test: `python scripts/routing_cost.py`.

Prompts are conversations' growing histories over a few shared system prompts, block keys
precomputed (hashing them is timed apart: it is the gateway's per-request cost, not the
decision's)."""

from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc

from gateway.routing import RoutePolicy, Router, RouterSettings, prompt_keys

BS = 16


def prompts(n: int, blocks: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(50_000) for _ in range(32 * BS)] for _ in range(4)]
    out = []
    for _ in range(n):
        body = [rng.randrange(50_000) for _ in range((blocks - 32) * BS)]
        out.append(systems[rng.randrange(4)] + body)
    return out


def decision_us(cells: int, policy: RoutePolicy, keys: list[list[int]], reps: int) -> list[float]:
    router = Router([f"cell{i}" for i in range(cells)], RouterSettings(policy=policy))
    for k in keys:  # warm: every prompt routed once, so matches are found
        router.done(router.route(k, 2048, 128))
    times = []
    for _ in range(reps):
        for k in keys:
            t = time.perf_counter()
            router.done(router.route(k, 2048, 128, session="s"))
            times.append(1e6 * (time.perf_counter() - t))
    return times


def index_bytes(cells: int, capacity: int) -> tuple[int, int]:
    tracemalloc.start()
    router = Router([f"cell{i}" for i in range(cells)], RouterSettings(index_blocks=capacity))
    rng = random.Random(1)
    for i in range(cells):
        router.index.insert(i, [rng.getrandbits(63) for _ in range(capacity)])
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return size, sum(router.index.size(i) for i in range(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cells", type=int, default=64)
    p.add_argument("--prompt-blocks", type=int, default=128)
    p.add_argument("--prompts", type=int, default=500)
    p.add_argument("--memory-capacity", type=int, default=4096, help="keys a cell, for memory")
    args = p.parse_args()
    ids = prompts(args.prompts, args.prompt_blocks, 0)
    t = time.perf_counter()
    keys = [prompt_keys(x, BS) for x in ids]
    hash_us = 1e6 * (time.perf_counter() - t) / len(ids)
    print(f"{args.cells} cells, prompts of {args.prompt_blocks} blocks of {BS} tokens")
    print(f"block keys: {hash_us:.1f} µs a prompt ({hash_us / args.prompt_blocks:.2f} µs a block)")
    for policy in RoutePolicy:
        times = decision_us(args.cells, policy, keys, 3)
        q = statistics.quantiles(times, n=100)
        print(
            f"{policy.value:>13}: route + done median {statistics.median(times):.1f} µs, "
            f"p99 {q[98]:.1f} µs"
        )
    size, n = index_bytes(args.cells, args.memory_capacity)
    print(
        f"index: {n} keys ({args.cells} cells x {args.memory_capacity}) in {size / 2**20:.1f} MiB "
        f"= {size / n:.0f} bytes a key"
    )


if __name__ == "__main__":
    main()
