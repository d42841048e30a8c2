"""Malformed request bytes get INVALID_ARGUMENT, not UNKNOWN; compressed ones are inflated here.

gRPC parses a request before the service sees it; when the bytes are not a valid message (a
client that bypasses protobuf's checks can send a string field holding invalid UTF-8, such as an
encoded lone surrogate), the parse error surfaced as UNKNOWN "Unexpected DecodeError". This
interceptor (llmcommon.unreadable's, which every service's server has, with inflation added)
parses every request with one message itself and answers INVALID_ARGUMENT with what was wrong,
or RESOURCE_EXHAUSTED when a compressed request inflates past the limit (gateway/inflate.py: the
server hands compressed requests over as they came). Stream requests (reflection) are inflated
the same way.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import DecodeError

from gateway.inflate import TooLarge, inflate
from llmcommon.unreadable import Parse, ReadableRequests, Unreadable


class MalformedRequestInterceptor(ReadableRequests):
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes  # the largest request, inflated

    def read(self, parse: Parse, data: bytes) -> Any:
        return parse(inflate(data, self.max_bytes))

    def refusal(self, err: Exception) -> Unreadable:
        if isinstance(err, TooLarge):
            return Unreadable(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        if isinstance(err, DecodeError):
            problem = str(err) or "cannot parse"
            message = f"malformed request: {problem} (is every string field valid UTF-8?)"
            return Unreadable(grpc.StatusCode.INVALID_ARGUMENT, message)
        return Unreadable(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {err}")
