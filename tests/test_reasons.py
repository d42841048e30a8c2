"""Each stall and refusal reason is defined once (scheduler_svc/config.py) with its words; the
CLI, the metrics, the gRPC status codes and the docs use that one definition."""

from __future__ import annotations

import re
from pathlib import Path

import grpc

from llmserve.status_text import REASONS
from scheduler_svc.reasons import RefusalReason, StallReason
from scheduler_svc.service import REFUSED_CODE

ROOT = Path(__file__).resolve().parent.parent


def test_the_cli_explains_every_stall_in_the_cores_words() -> None:
    assert REASONS == {r.value: r.description for r in StallReason}


def test_the_readme_table_gives_every_stall_its_description() -> None:
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", (ROOT / "README.md").read_text(), re.M))
    for reason in StallReason:
        assert rows.get(reason.value, "").strip() == reason.description, reason


def test_every_refusal_has_a_grpc_status_and_a_documented_metric_label() -> None:
    assert set(REFUSED_CODE) == set(RefusalReason)
    assert grpc.StatusCode.UNKNOWN not in REFUSED_CODE.values()
    docs = (ROOT / "docs" / "observability.md").read_text()
    [row] = [line for line in docs.splitlines() if "llmserve_scheduler_refused_requests" in line]
    assert all(reason.value in row for reason in RefusalReason)
