"""gateway.inflate: compressed requests are inflated up to a limit, plain ones pass untouched."""

from __future__ import annotations

import gzip
import time
import zlib

import pytest

from gateway.inflate import TooLarge, inflate
from llmcommon.v1 import gateway_pb2

LIMIT = 1 << 20
REQUEST = gateway_pb2.GenerateRequest(request_id="r", prompt="hello " * 100).SerializeToString()


def test_a_plain_request_passes_untouched() -> None:
    assert inflate(REQUEST, LIMIT) == REQUEST


@pytest.mark.parametrize("compress", [gzip.compress, zlib.compress], ids=["gzip", "deflate"])
def test_a_compressed_request_is_inflated(compress) -> None:
    assert inflate(compress(REQUEST), LIMIT) == REQUEST


def test_a_bomb_is_refused_after_inflating_no_more_than_the_limit() -> None:
    bomb = gzip.compress(b"\0" * (64 << 20), compresslevel=1)  # 64 MB in ~0.1 MB
    started = time.process_time()
    with pytest.raises(TooLarge, match="more than 1048576 bytes"):
        inflate(bomb, LIMIT)
    assert time.process_time() - started < 0.05  # inflating all of it takes ~0.1 s


@pytest.mark.parametrize(
    "data", [gzip.compress(REQUEST)[:-9], b"\x1f\x8b\x08garbage"], ids=["cut", "corrupt"]
)
def test_broken_compressed_data_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError, match="compressed request"):
        inflate(data, LIMIT)
