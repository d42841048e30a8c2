"""Bad input to a benchmark: a trace file or an option that cannot be used as given."""

from __future__ import annotations


class BenchError(ValueError):
    """The message names the problem (file, line, column or option) and what would be accepted;
    `llmserve` prints it as one line and exits with 2, as argparse does for a usage error."""


class TraceError(BenchError):
    """A trace (CSV or hash-id JSONL) that cannot be replayed: the message names the file and,
    for a bad line, its line number and column."""
