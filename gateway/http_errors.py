"""Errors of the HTTP API in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
with the HTTP status a refusal of the generation path (a gRPC status code) maps to.

`code` is the gRPC status name in lower case (`invalid_argument`, `resource_exhausted`, ...),
the same vocabulary as the gRPC API and the `code` label of the gateway's request metrics, except
where clients match on OpenAI's own code: a request over the model's context is
`context_length_exceeded` (gateway/context_fit.py). A 429 carries `Retry-After`.
"""

from __future__ import annotations

import json

import grpc
from starlette.responses import Response

from gateway.context_fit import CONTEXT_CODE
from gateway.generation_errors import ContextLengthExceeded, GenerationError, QueueFull
from llmcommon.errors import RequestProblem

# gRPC status -> HTTP status. A RESOURCE_EXHAUSTED from the scheduler is a request that can never
# fit (larger than the KV pool): 400, for the client must change it; only the gateway's queue
# limits (QueueFull) are 429, which clients retry later.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.CANCELLED: 499,  # the client left: nobody reads it
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
QUEUE_FULL_STATUS = 429
RETRY_AFTER_S = 1  # a full queue's `Retry-After`: the queue moves at the pace of requests ending
DEADLINE_HEADER = "x-request-timeout"  # a request's deadline in seconds (gRPC's is the call's)
ERROR_TYPE = {401: "authentication_error", 429: "rate_limit_error", 504: "timeout_error"}


class ApiError(RequestProblem):
    """A refusal of the HTTP API: `code` as the gRPC API would answer it; `status` the HTTP
    status (by default the one `code` maps to); `param` the request field at fault;
    `openai_code` the body's `code` where it is OpenAI's own rather than the gRPC status name."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        param: str | None = None,
        status: int | None = None,
        openai_code: str | None = None,
    ) -> None:
        super().__init__(message, param)
        self.code = code
        self.status = status or HTTP_STATUS.get(code, 500)
        self.openai_code = openai_code or code.name.lower()

    @property
    def type(self) -> str:
        default = "server_error" if self.status >= 500 else "invalid_request_error"
        return ERROR_TYPE.get(self.status, default)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.openai_code,
            }
        }

    def response(self) -> Response:
        headers = {"retry-after": str(RETRY_AFTER_S)} if self.status == 429 else None
        body = json.dumps(self.body())
        return Response(body, self.status, headers=headers, media_type="application/json")


def from_generation(err: GenerationError) -> ApiError:
    """The HTTP API's answer to a refusal of the generation path. Its UNAUTHENTICATED or
    PERMISSION_DENIED would be the scheduler refusing this gateway (a wrong internal token),
    not the client's key: 503, as any other failure of the stack behind the gateway."""
    if err.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return ApiError(grpc.StatusCode.UNAVAILABLE, f"the scheduler refused the gateway: {err}")
    if err.code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(err.code, f"the request's {DEADLINE_HEADER} passed before it finished")
    status = QUEUE_FULL_STATUS if isinstance(err, QueueFull) else None
    openai_code = CONTEXT_CODE if isinstance(err, ContextLengthExceeded) else None
    return ApiError(err.code, err.message, err.param, status, openai_code)
