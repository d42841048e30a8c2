"""Where a worker computes: `--device auto|cpu|cuda|cuda:N`, and how much memory it has there."""

from __future__ import annotations

import resource
import sys
import threading
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


def _status_bytes(field: str) -> int | None:
    """One `kB` field of /proc/self/status (Linux), in bytes; None elsewhere."""
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def peak_rss_bytes() -> int:
    """The process's peak resident memory (Linux: VmHWM, which `reset_peak_rss` may reset; else
    getrusage's, which only grows and may carry a parent's peak across exec)."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def rss_bytes() -> int:
    """The process's resident memory now (0 where the platform does not say)."""
    return _status_bytes("VmRSS") or 0


def reset_peak_rss() -> bool:
    """Linux: set the peak back to the current resident size (clear_refs 5), so a probe sees
    what its own work adds, not the model load's peak before it. False where the kernel or a
    sandbox does not allow it (then the peak must be sampled)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    peak, now = _status_bytes("VmHWM"), rss_bytes()
    return peak is not None and peak <= now + 4 * 2**20


class _RssSampler:
    """Samples the resident size every millisecond or so, for hosts where the peak cannot be
    reset; a short spike between samples can be missed, which the profile's margin covers."""

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak


class MemoryProbe:
    """Measures the peak memory one piece of work adds: CUDA's allocator statistics on a GPU,
    the peak resident size on the CPU (reset first where Linux allows, sampled otherwise)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sampler: _RssSampler | None = None

    def __enter__(self) -> MemoryProbe:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
        elif reset_peak_rss():
            self.before = peak_rss_bytes()
        else:
            self.before = rss_bytes()
            self._sampler = _RssSampler()
        self.peak = 0
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.before
        elif self._sampler is not None:
            self.peak = max(0, self._sampler.stop() - self.before)
        else:
            self.peak = max(0, peak_rss_bytes() - self.before)


def device_memory(device: torch.device, cpu_limit: int) -> tuple[int, int]:
    """(free, total) bytes: CUDA's report for a GPU; for the CPU, the limit chosen with
    --cpu-memory (the host's memory is shared with everything else on it)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    return cpu_limit, cpu_limit
