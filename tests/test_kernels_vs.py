"""`python -m llmserve.bench.kernels_vs`: the base kernels come from a git revision, built with
this checkout's flags, and both sides time the same work."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from llmserve.bench import kernels_vs
from worker_svc import cpu_kernels

HISTORY = shutil.which("git") is not None and (kernels_vs.REPO / ".git").exists()
needs_compiler = pytest.mark.skipif(
    cpu_kernels.load() is None or not HISTORY,
    reason="needs the fused kernels, git and this checkout's history",
)


@needs_compiler
def test_base_kernels_built_from_a_revision_compute_what_the_current_ones_do(
    tmp_path: Path,
) -> None:
    base = kernels_vs.base_kernels("HEAD", tmp_path)
    new = cpu_kernels.load()
    assert new is not None
    run, read, out = kernels_vs.attention_pass(nd=5, context=40)
    assert read == 30 * 5 * 41 * 3 * 64 * 2 * 2
    outs = []
    for kernels in (base, new):
        kernels.set_threads(1)
        out.fill_(float("nan"))
        run(kernels)
        outs.append(out.clone())
    # the same source at HEAD (in a checkout with changes to it, the same maths): close
    assert torch.isfinite(outs[0]).all() and torch.allclose(outs[0], outs[1], atol=2e-2)


def test_an_unknown_revision_is_a_clear_error(tmp_path: Path) -> None:
    if not HISTORY:
        pytest.skip("no git history here")
    with pytest.raises(SystemExit, match="git show no-such-revision"):
        kernels_vs.base_kernels("no-such-revision", tmp_path)
