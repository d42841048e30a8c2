"""Optional API key on the public API: `authorization: Bearer KEY` or `x-api-key: KEY` metadata
(gRPC) or headers (HTTP, gateway/http_api.py).

Health checks and reflection stay open so that probes work without the key.

With --api-keys-file each key names a tenant (gateway/api_keys.py); the one key of
--api-key-file is the tenant `default`.

The key also names a tenant of the prefix cache: `cache_salt` mixes a digest of it (never the
key; with --api-keys-file, of its tenant's name) with the request's own salt, so that clients of
different keys (tenants) or salts share no cached KV block and cannot learn through the cache
whether another's prompt starts like theirs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import grpc

from gateway.api_keys import ApiKeys
from llmcommon.auth import Metadata, Refusal, TokenInterceptor

PROTECTED_SERVICE = "llmserve.v1.Gateway"
API_KEY_REFUSAL = "missing or wrong API key: send `authorization: Bearer KEY`"


KEYS_DISAGREE = (
    "two different API keys were sent (`authorization` and `x-api-key`, or one of them twice): "
    "send one key"
)
_NO_KEY = "\x00"  # what a call whose keys disagree presents: no key of any table (printable only)


def key_from_metadata(metadata: Metadata) -> str:
    """The call's API key ("" when it sends none). Only the two key headers are read: other
    entries may be `-bin` ones holding any bytes (tracing's), never decoded here. Keys that
    disagree (a bearer token and a different `x-api-key`) are no key: which one named the
    tenant would depend on the headers' order."""
    sent = set()
    for name, value in metadata or ():
        if name not in ("x-api-key", "authorization"):
            continue
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        if name == "x-api-key":
            sent.add(text)
        elif text.lower().startswith("bearer "):
            sent.add(text[7:].strip())
    if len(sent) > 1:
        return _NO_KEY
    return sent.pop() if sent else ""


def key_refusal(metadata: Metadata) -> str:
    """Why a call's key was refused: keys that disagree, or a key missing or wrong."""
    return KEYS_DISAGREE if key_from_metadata(metadata) == _NO_KEY else API_KEY_REFUSAL


class ApiKeyInterceptor(TokenInterceptor):
    """Every Gateway call must carry a key of the table in force (`keys()`; a plain key: that
    one key), compared by digest in constant time (gateway/api_keys.py)."""

    def __init__(self, keys: str | Callable[[], ApiKeys]) -> None:
        super().__init__(
            [PROTECTED_SERVICE], "", token_of=key_from_metadata, refusal=API_KEY_REFUSAL
        )
        if isinstance(keys, str):
            fixed = ApiKeys.single(keys)
            keys = lambda: fixed  # noqa: E731
        self.keys = keys

    def refusal_of(self, metadata: Metadata) -> Refusal | None:
        if self.keys().entry(self.token_of(metadata)) is not None:
            return None
        return grpc.StatusCode.UNAUTHENTICATED, key_refusal(metadata)


def tenant_of(api_key: str) -> bytes:
    """The prefix-cache tenant of an API key: a digest of it (b"" without a key)."""
    if not api_key:
        return b""
    return hashlib.blake2b(api_key.encode(), person=b"llmserve-tenant").digest()


def cache_salt(tenant: bytes, request_salt: str) -> bytes:
    """The salt the scheduler seeds the request's block keys with: b"" (shared by every request
    with neither) when there is neither a tenant nor a request salt; else a
    keyed digest, so that equal (tenant, salt) pairs, and only those, share cached blocks."""
    if not tenant and not request_salt:
        return b""
    digest = hashlib.blake2b(request_salt.encode(), key=tenant, person=b"llmserve-cache")
    return digest.digest()
