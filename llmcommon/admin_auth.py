"""The admin key: what the Admin service (live settings, the head's explanation) requires, on
the scheduler and on the gateway, apart from the API key and the internal token. Generation may
be open to anyone; changing how the stack schedules never is.

Sent as `x-llmserve-admin-key` metadata. Without it a call is UNAUTHENTICATED; with a wrong one,
or to a server started without --admin-key-file, PERMISSION_DENIED. Logs name a key by its id
(a digest), never the key."""

from __future__ import annotations

import hashlib
import hmac

import grpc

from llmcommon.auth import (
    Metadata,
    Refusal,
    ServiceGuard,
    metadata_secret,
    metadata_value,
    read_secret_file,
)

ADMIN_SERVICE = "llmserve.v1.Admin"
ADMIN_KEY_HEADER = "x-llmserve-admin-key"
FORWARDED_FOR = "x-llmserve-forwarded-for"  # the gateway's caller, on an Admin call it forwards
ADMIN_KEY_HELP = (
    "a file holding the admin key that the Admin calls (llmserve set / get / status --explain) "
    "must carry; '' = the Admin service refuses every call"
)
NO_KEY = "the admin key is missing: send it with --admin-key-file (x-llmserve-admin-key)"
WRONG_KEY = "wrong admin key"
ADMIN_OFF = "the admin API is off: start the service with --admin-key-file"


def admin_key(path: str) -> str:
    """The admin key in `path` ("" without a path). Empty, unreadable or not printable ASCII is
    SystemExit with the reason: a configured key is never silently off."""
    if not path:
        return ""
    return metadata_secret(read_secret_file(path, "admin key"), "admin key", path)


def admin_key_of(metadata: Metadata) -> str:
    return metadata_value(metadata, ADMIN_KEY_HEADER)


def admin_metadata(key: str) -> tuple[tuple[str, str], ...]:
    return ((ADMIN_KEY_HEADER, key),) if key else ()


def key_id(key: str) -> str:
    """A key's name in logs: 8 hex digits of a digest."""
    return hashlib.blake2b(key.encode(), digest_size=4, person=b"llmserve-admin").hexdigest()


def admin_refusal(key: str, metadata: Metadata) -> Refusal | None:
    """Why a call with `metadata` may not use the Admin service of a server whose key is
    `key`; None if it may."""
    given = admin_key_of(metadata)
    if not given:
        return grpc.StatusCode.UNAUTHENTICATED, NO_KEY
    if not key:
        return grpc.StatusCode.PERMISSION_DENIED, ADMIN_OFF
    if not hmac.compare_digest(given.encode(), key.encode()):
        return grpc.StatusCode.PERMISSION_DENIED, WRONG_KEY
    return None


class AdminKeyInterceptor(ServiceGuard):
    """Every call of the Admin service must carry the admin key; other services pass."""

    services = frozenset({ADMIN_SERVICE})

    def __init__(self, key: str) -> None:
        self.key = key

    def refusal_of(self, metadata: Metadata) -> Refusal | None:
        return admin_refusal(self.key, metadata)
