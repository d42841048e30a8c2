"""The one shape of a refused request: a message a person can act on, and the field at fault."""

from __future__ import annotations


class RequestProblem(Exception):
    """A request refused: `message` says what to change, `param` which field (None: the request
    as a whole)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param
