"""The draft-step benchmark's case is a real draft step: each request's 1 + k rows verified in
one execution, over the same cached positions as its plain decode, every call alike."""

from __future__ import annotations

import torch

from llmserve.bench.draft_step import main
from llmserve.bench.forward_timing import Ours
from tests.model_support import one_torch_thread  # noqa: F401  (autouse fixture)
from worker_svc.loader import load_model


def test_a_draft_case_verifies_each_requests_draft_and_repeats_alike() -> None:
    config, weights = load_model("tiny", torch.bfloat16, "auto")
    ours = Ours(config, weights, torch.bfloat16, 3, context=40)
    step = ours.draft(3, 4)
    first, again = step(), step()
    assert [item.drafted for item in first] == [4, 4, 4]
    assert all(1 <= len(item.emitted) <= 5 for item in first)  # the kept draft + one token
    assert [i.emitted for i in first] == [i.emitted for i in again]  # fresh items, same answer


def test_the_command_prints_each_kernel_beside_the_plain_decode(capsys) -> None:
    main(["--source", "tiny", "--batches", "1,2", "--drafts", "2", "--context", "40",
          "--reps", "1", "--kernels", "torch,blocked"])  # fmt: skip
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("1", "0", "1"), ("1", "2", "3"), ("2", "0", "2"), ("2", "2", "6")
    ]  # fmt: skip
    assert all(r[4] == "1.00x" and r[6] == "1.00x" for r in rows if r[1] == "0")
