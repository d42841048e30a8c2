"""How the generation path refuses a request: a gRPC status code (the vocabulary of the
scheduler's answers), a message, and the field at fault. The gRPC service passes it on as is; the
HTTP API maps it to an HTTP status (gateway/http_errors.py)."""

from __future__ import annotations

import grpc

from llmcommon.errors import RequestProblem


class GenerationError(RequestProblem):
    """The request ends without a result: `code` says why, `message` what to do, `param` the
    field at fault."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        super().__init__(message, param)
        self.code = code


class ContextLengthExceeded(GenerationError):
    """The prompt, or the prompt and max_tokens, do not fit the model's context."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message, param)


class QueueFull(GenerationError):
    """The gateway's queue limits refuse the request now; it may succeed later."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


class NoCell(GenerationError):
    """With --cells: no live cell to send the request to (a resubmission waits for one)."""

    def __init__(self) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE, "no cell answers (every scheduler down); retry"
        )
