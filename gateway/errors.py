"""How a request ends without a result on the gateway's generation path, in the vocabulary of
gRPC status codes: the gRPC service passes them on as they are, the HTTP API maps them to an HTTP
status (gateway/http_errors.py)."""

from __future__ import annotations

import grpc

__all__ = ["ContextLengthExceeded", "GenerationError", "QueueFull"]


class GenerationError(Exception):
    """The request ends without a result: `code` says why, `message` what to do."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param  # param: the field at fault


class ContextLengthExceeded(GenerationError):
    """The prompt, or the prompt and max_tokens, do not fit the model's context."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message, param)


class QueueFull(GenerationError):
    """The gateway's queue limits refuse the request now; it may succeed later."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
