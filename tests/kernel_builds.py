"""The kernel library built with other -march flags than this host's default, for the tests of
the paths a build without some instructions takes (no VNNI, no AVX-512)."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from worker_svc import cpu_kernels


def build_kernels(flags: list[str], tmp_path: Path) -> cpu_kernels.CpuKernels:
    """cpu_kernels.c built with `flags` (none: the compiler's generic x86-64) and loaded; the
    test skipped where this compiler does not take the flags."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    path = tmp_path / "k.so"
    done = cpu_kernels.compile_source(compiler, flags, str(path))
    if done.returncode and flags:
        pytest.skip(f"this compiler does not take {flags}: {done.stderr[-200:]}")
    assert done.returncode == 0, done.stderr
    return cpu_kernels.CpuKernels(ctypes.CDLL(str(path)))
