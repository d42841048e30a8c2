"""Bad input to a benchmark: a trace file or an option that cannot be used as given."""

from __future__ import annotations

import grpc


class BenchError(ValueError):
    """The message names the problem (file, line, column or option) and what would be accepted;
    `llmserve` prints it as one line and exits with 2, as argparse does for a usage error."""


class TraceError(BenchError):
    """A trace (CSV or hash-id JSONL) that cannot be replayed: the message names the file and,
    for a bad line, its line number and column."""


class StatusUnavailable(grpc.RpcError):
    """A benchmark's first Status sample failed: the call's code, and details that name where it
    asked and the flag that chose it. `llmserve` prints it as any RPC error (exit status 1);
    `hinted`: the details already say what to try, so no other hint is added."""

    hinted = True

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details
