"""Prefix-cache isolation through real processes (tiny model): a prompt shares cached KV blocks
only with requests of the same API key and the same cache_salt (gRPC field, or the OpenAI HTTP
body field vLLM uses); an ordinary client's Status through the gateway carries no cache figures
(they would tell it whether another client's prompt starts like its own); the operator, with
the internal token, gets them all."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
import urllib.request

import grpc
import pytest

from llmcommon.admin_auth import ADMIN_KEY_HEADER
from llmcommon.auth import INTERNAL_TOKEN_HEADER
from llmcommon.server import wait_healthy
from llmcommon.v1 import gateway_pb2_grpc, scheduler_pb2
from llmserve import client
from llmserve.status_text import CACHE_WITHHELD, format_status
from tests.stacks import free_port, free_run, running_stack, tiny_settings

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]

TOKEN = "llmserve-" + secrets.token_hex(16)
ADMIN_KEY = "admin-" + secrets.token_hex(16)
SECRET = "The launch code of the vault is 4 8 15 16 23 42, keep it to yourself. " * 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache-isolation")
    (root / "token").write_text(TOKEN)
    (root / "admin").write_text(ADMIN_KEY)
    settings = tiny_settings(
        internal_token_file=str(root / "token"),
        admin_key_file=str(root / "admin"),
        block_size=4,
        kv_capacity=4096,
        http_port=free_port(),
        metrics_base_port=free_run(3),
    )
    with running_stack(settings, root / "logs") as s:
        extra = {key: keyed_gateway(s, root, key) for key in ("key-of-alice", "key-of-bob")}
        try:
            s.keyed = {key: address for key, (address, _) in extra.items()}
            yield s
        finally:
            for _, proc in extra.values():
                proc.kill()
                proc.wait()


def keyed_gateway(stack, root, key: str) -> tuple[str, subprocess.Popen]:
    """One more gateway on the stack's scheduler, with its own API key."""
    (root / key).write_text(key)
    command = stack.commands()["gateway"]
    port = free_port()
    command[command.index("--port") + 1] = str(port)
    for flag in ("--metrics-port", "--http-port"):
        if flag in command:
            command[command.index(flag) + 1] = "0"
    log = (root / f"gateway-{key}.log").open("w")
    proc = subprocess.Popen(
        [*command, "--api-key-file", str(root / key)], stdout=log, stderr=subprocess.STDOUT
    )
    asyncio.run(wait_healthy(f"127.0.0.1:{port}", 120, "llmserve.v1.Gateway"))
    return f"127.0.0.1:{port}", proc


def hits(stack) -> int:
    """Prompt tokens the cache has served, as the operator reads them (the scheduler)."""
    return client.status(stack.settings.scheduler, token=TOKEN).hit_tokens


def served_from_cache(stack, gateway: str, api_key: str = "", salt: str = "") -> int:
    """Generate from SECRET through `gateway`; the prompt tokens the cache served it."""
    before = hits(stack)
    request = client.make_request(prompt=SECRET, max_tokens=2, temperature=0.0, ignore_eos=True)
    request.cache_salt = salt
    with grpc.insecure_channel(gateway) as channel:
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        done = gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(
            request, timeout=60, metadata=metadata
        )
    assert done.usage.completion_tokens == 2
    return hits(stack) - before


def http_served_from_cache(stack, salt: str | None) -> int:
    before = hits(stack)
    body = {"prompt": SECRET, "max_tokens": 2, "temperature": 0.0}
    if salt is not None:
        body["cache_salt"] = salt
    ask = urllib.request.Request(
        stack.settings.http_url + "/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(ask, timeout=60) as reply:
        assert json.load(reply)["usage"]["completion_tokens"] == 2
    return hits(stack) - before


def test_requests_of_one_salt_share_the_cache_and_of_another_do_not(stack) -> None:
    gateway = stack.settings.gateway
    served_from_cache(stack, gateway, salt="salt-1")  # fills the cache for salt-1
    assert served_from_cache(stack, gateway, salt="salt-1") > 0
    assert served_from_cache(stack, gateway, salt="salt-2") == 0
    assert served_from_cache(stack, gateway) == 0  # no salt: the shared default
    assert served_from_cache(stack, gateway) > 0  # ... which shares as before


def test_the_http_api_takes_the_cache_salt_field(stack) -> None:
    assert http_served_from_cache(stack, "http-salt") == 0
    assert http_served_from_cache(stack, "http-salt") > 0
    assert http_served_from_cache(stack, "http-other") == 0


def test_clients_of_different_api_keys_share_no_cached_block(stack) -> None:
    alice, bob = stack.keyed["key-of-alice"], stack.keyed["key-of-bob"]
    assert served_from_cache(stack, alice, "key-of-alice") == 0
    assert served_from_cache(stack, alice, "key-of-alice") > 0  # the same key shares
    assert served_from_cache(stack, bob, "key-of-bob") == 0  # another key's guess: no hit
    assert served_from_cache(stack, stack.settings.gateway) > 0  # keyless default untouched


def cache_figures(reply: scheduler_pb2.StatusReply) -> list[int]:
    fields = ("cached_blocks", "evictable_blocks", "evictions", "prompt_tokens", "hit_tokens")
    workers = [getattr(w, name) for w in reply.workers for name in fields]
    return [reply.prompt_tokens, reply.hit_tokens, reply.evictions, *workers]


def test_an_ordinary_clients_status_does_not_move_with_another_clients_hits(stack) -> None:
    alice = stack.keyed["key-of-alice"]
    before = client.gateway_status(alice, api_key="key-of-alice")
    served_from_cache(stack, stack.settings.gateway, salt="someone-else")
    assert served_from_cache(stack, stack.settings.gateway, salt="someone-else") > 0
    after = client.gateway_status(alice, api_key="key-of-alice")
    assert after.cache_figures_withheld and before.cache_figures_withheld
    assert cache_figures(after) == cache_figures(before) == [0] * len(cache_figures(after))
    assert after.finished > before.finished  # the rest of the status still moves
    text = format_status(client.status_dict(after))
    assert CACHE_WITHHELD in text and "hit rate" not in text


def test_the_operator_reads_the_cache_figures_through_the_gateway(stack) -> None:
    served_from_cache(stack, stack.settings.gateway, salt="operator")
    with grpc.insecure_channel(stack.settings.gateway) as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Status(
            scheduler_pb2.StatusRequest(), timeout=10, metadata=((INTERNAL_TOKEN_HEADER, TOKEN),)
        )
    assert not reply.cache_figures_withheld
    assert reply.hit_tokens == hits(stack) > 0
    assert "hit rate" in format_status(client.status_dict(reply))


@pytest.mark.parametrize(("key", "shown"), [(ADMIN_KEY, True), (ADMIN_KEY[:-1] + "x", False)])
def test_the_admin_key_also_shows_the_operator_the_cache_figures(stack, key, shown) -> None:
    """The admin key is the operator's too (`llmserve status --admin-key-file`); a wrong one
    is an ordinary client's status."""
    served_from_cache(stack, stack.settings.gateway, salt="admin")
    with grpc.insecure_channel(stack.settings.gateway) as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Status(
            scheduler_pb2.StatusRequest(), timeout=10, metadata=((ADMIN_KEY_HEADER, key),)
        )
    assert reply.cache_figures_withheld is not shown
    assert (reply.hit_tokens == hits(stack) > 0) is shown


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
