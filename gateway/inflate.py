"""Compressed requests, inflated with a bound.

gRPC core inflates a compressed message whole and only then compares its size with
`grpc.max_receive_message_length`: a small gzip of a huge message passes the wire limit and stalls
the event loop while it inflates, only to be refused (the figures: docs/figures.md). The gateway's
server turns core's inflating off (`SERVER_OPTIONS`: compressed bytes reach the
deserializer as they came) and inflates here, never more than the limit and one byte.

A message carries no flag the deserializer can see, so compression is known by its header: gzip
starts with 1f 8b, which no protobuf message does (wire type 7 does not exist); zlib (gRPC's
"deflate") with a checked header whose first byte, read as a protobuf tag, is a varint on an odd
field of 1 to 15: no request sends one (its fields 1 and 3 are strings and messages).
"""

from __future__ import annotations

import zlib

__all__ = ["SERVER_OPTIONS", "TooLarge", "inflate"]

SERVER_OPTIONS = (("grpc.per_message_decompression", 0),)
_GZIP, _ZLIB = 16 + zlib.MAX_WBITS, zlib.MAX_WBITS


class TooLarge(ValueError):
    """The message inflates past the limit."""


def _wbits(data: bytes) -> int | None:
    if data[:2] == b"\x1f\x8b":
        return _GZIP
    cmf_flg = int.from_bytes(data[:2])
    if len(data) >= 2 and cmf_flg >> 8 & 0x0F == 8 and cmf_flg >> 12 <= 7 and cmf_flg % 31 == 0:
        return _ZLIB
    return None


def inflate(data: bytes, limit: int) -> bytes:
    """`data` inflated when it is gzip or zlib, else `data` itself. TooLarge when it inflates to
    more than `limit` bytes (found after inflating `limit` + 1); ValueError when it is corrupt."""
    wbits = _wbits(data)
    if wbits is None:
        return data
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as err:
        raise ValueError(f"cannot inflate the compressed request: {err}") from None
    if len(out) > limit:
        raise TooLarge(f"the request inflates to more than {limit} bytes, the limit")
    if not inflater.eof:
        raise ValueError("the compressed request is cut short")
    return out
