"""The one shape of a refused request: a message a person can act on, and the field at fault."""

from __future__ import annotations


class RequestProblem(Exception):
    """A request refused: `message` says what to change, `param` which field (None: the request
    as a whole)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


MAX_DETAILS_CHARS = 2000  # a gRPC status's details travel as metadata (16 kB in all)


def bounded(message: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """`message` cut in its middle to at most about `limit` characters, saying how much was
    cut: an error that quotes what was sent (a 100 kB name) would otherwise exceed gRPC's
    metadata limit, and the caller would see RESOURCE_EXHAUSTED instead of the status meant."""
    if len(message) <= limit:
        return message
    tail = limit // 5
    head = limit - tail - 40
    cut = len(message) - head - tail
    return f"{message[:head]}... ({cut} characters cut) ...{message[-tail:]}"
