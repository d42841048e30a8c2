"""A benchmark's --out, checked before the run: a report that cannot be written is found out at
once, not after minutes of load."""

from __future__ import annotations

import tempfile
from pathlib import Path

from llmserve.bench.errors import BenchError


def check_out_dir(path: Path, flag: str = "--out") -> None:
    """Create `path` (as the report would at the end) and write a file in it; BenchError naming
    `flag` when either fails (a read-only place, a file in the way, no such device)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        why = err.strerror or str(err)
        raise BenchError(f"{flag} {path}: the report cannot be written there ({why})") from None
