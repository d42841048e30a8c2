"""How many KV positions a worker's pool gets when --kv-capacity is not given: the rule of the
established GPU servers (vLLM's gpu_memory_utilization): the pool takes what is left of a
fraction of the device's memory once the weights and the peak forward pass are accounted for."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    total: int  # bytes of the device (or the CPU limit)
    used_before: int  # bytes in use before the worker loaded anything (other processes)
    weights: int  # bytes of the model's weights
    activation_peak: int  # bytes a forward at the token budget adds at its peak
    fraction: float  # --memory-fraction: the share of `total` this worker may use

    @property
    def kv_bytes(self) -> int:
        budget = int(self.total * self.fraction) - self.used_before
        return budget - self.weights - self.activation_peak

    def positions(self, bytes_per_position: int, block_size: int) -> int:
        """Whole blocks' worth of positions; an error (with the figures) if not one block fits."""
        blocks = max(0, self.kv_bytes) // (bytes_per_position * block_size)
        if blocks < 1:
            raise ValueError(
                f"no room for a KV pool: {self.fraction:.0%} of {mib(self.total)} minus "
                f"{mib(self.used_before)} in use, {mib(self.weights)} of weights and a "
                f"{mib(self.activation_peak)} peak forward leaves {mib(self.kv_bytes)}; raise "
                f"--memory-fraction, lower the token budget, or set --kv-capacity"
            )
        return blocks * block_size


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"
