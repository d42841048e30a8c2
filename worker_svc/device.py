"""Where a worker computes: `--device auto|cpu|cuda|cuda:N`, and how much memory it has there."""

from __future__ import annotations

import contextlib
import resource
import sys
from pathlib import Path

import torch


def resolve_device(name: str) -> torch.device:
    """auto = the first CUDA device when there is one, else the CPU. A CUDA device that is
    not there is an error at start, never a silent fall back to the CPU."""
    name = name.strip().lower()
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"--device {name!r}: use auto, cpu, cuda or cuda:N") from err
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"--device {name!r}: use auto, cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = device.index or 0
    if index >= count:
        raise ValueError(f"--device {name}: this machine has {count} CUDA device(s)")
    return torch.device("cuda", index)


def peak_rss_bytes() -> int:
    """The process's peak resident memory (Linux: VmHWM, which `reset_peak_rss` resets; else
    getrusage's, which only grows and may carry a parent's peak across exec)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def reset_peak_rss() -> None:
    """Linux: set the peak back to the current resident size (clear_refs 5), so a probe sees
    what its own work adds, not the model load's peak before it."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


class MemoryProbe:
    """Measures the peak memory one piece of work adds: CUDA's allocator statistics on a GPU,
    the peak resident size on the CPU (reset first where Linux allows)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> MemoryProbe:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
        else:
            reset_peak_rss()
            self.before = peak_rss_bytes()
        self.peak = 0
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.before
        else:
            self.peak = max(0, peak_rss_bytes() - self.before)


def device_memory(device: torch.device, cpu_limit: int) -> tuple[int, int]:
    """(free, total) bytes: CUDA's report for a GPU; for the CPU, the limit chosen with
    --cpu-memory (the host's memory is shared with everything else on it)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    return cpu_limit, cpu_limit
