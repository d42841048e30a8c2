"""Which attention implementation runs for a device: Triton's paged kernels or the torch path.

auto (the default): Triton on CUDA when triton imports, else the torch path (with the fused C
kernels for small bf16 decode steps on CPU). LLMSERVE_ATTENTION=torch or =triton overrides it;
Triton on CPU tensors runs only in its interpreter (TRITON_INTERPRET=1), which the tests use.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

ENV = "LLMSERVE_ATTENTION"
CHOICES = ("auto", "torch", "triton")


@functools.cache
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def requested_backend() -> str:
    """The choice in $LLMSERVE_ATTENTION, "auto" when unset."""
    choice = os.environ.get(ENV, "auto")
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    return choice


def attention_backend(device: torch.device, requested: str = "auto") -> str:
    """The backend for tensors on device: "triton" or "torch". Asked for "triton" where it cannot
    run, raises (never a silent fall back)."""
    if requested not in CHOICES:
        raise ValueError(f"attention backend {requested!r}: expected one of {', '.join(CHOICES)}")
    if requested == "torch":
        return "torch"
    if requested == "auto":
        return "triton" if device.type == "cuda" and triton_importable() else "torch"
    if not triton_importable():
        raise ValueError("Triton attention was asked for but triton is not installed")
    if device.type != "cuda" and not triton_interpreting():
        raise ValueError(
            f"Triton attention on {device.type} tensors needs TRITON_INTERPRET=1 "
            "(set before triton is first imported)"
        )
    return "triton"
