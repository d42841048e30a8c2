"""Optional API key on the public API: `authorization: Bearer KEY` or `x-api-key: KEY` metadata
(gRPC) or headers (HTTP, gateway/http_api.py).

Health checks and reflection stay open so that probes work without the key.
"""

from __future__ import annotations

from llmserve.runtime.auth import Metadata, TokenInterceptor

PROTECTED_SERVICE = "llmserve.v1.Gateway"
API_KEY_REFUSAL = "missing or wrong API key: send `authorization: Bearer KEY`"


def key_from_metadata(metadata: Metadata) -> str:
    for name, value in metadata or ():
        text = value.decode() if isinstance(value, bytes) else value
        if name == "x-api-key":
            return text
        if name == "authorization" and text.lower().startswith("bearer "):
            return text[7:].strip()
    return ""


class ApiKeyInterceptor(TokenInterceptor):
    def __init__(self, api_key: str) -> None:
        super().__init__(
            [PROTECTED_SERVICE],
            api_key,
            token_of=key_from_metadata,
            refusal=API_KEY_REFUSAL,
        )
