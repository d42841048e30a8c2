"""Tenants through a real gateway process, its scheduler a fake that keeps every SubmitRequest
(tests/fake_scheduler.py): the tenant comes from the API key (never the body), priority and
slo_class reach the scheduler or are refused 400 naming the field with nothing queued, a tenant
over its own queue limit gets 429 with Retry-After while another still gets in, and the keys
file is read again by ReloadKeys and on SIGHUP."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmcommon.server import wait_healthy
from llmcommon.v1 import gateway_pb2_grpc
from llmserve import client
from llmserve.cli import build_parser
from llmserve.ports import free_ports
from tests.fake_scheduler import RunningFake
from tests.stack_checks import wait_for

pytestmark = pytest.mark.usefixtures("hang_guard")
ROOT = Path(__file__).resolve().parent.parent
CLASSES = "interactive=ttft:1,tpot:0.1 batch=ttft:60"
ADMIN = "admin-s3cret"
KEYS = f"""
# team-a: interactive chats, may jump ahead down to -5, two requests waiting at most
key-a    team-a weight=2 top_priority=-5 slo_class=interactive max_queued=2
key-a2   team-a weight=2   # a second key of the same tenant
sha256:{hashlib.sha256(b"key-b").hexdigest()}  team-b max_queued_tokens=100000
key-c    team-c priority=3 top_priority=1
"""


@dataclass
class Gateway:
    proc: subprocess.Popen
    grpc_port: int
    http_port: int
    metrics_port: int
    keys_file: Path
    admin_file: Path
    scheduler: RunningFake

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def submits(self) -> list:
        return self.scheduler.fake.submits

    def sdk(self, key: str) -> openai.OpenAI:
        url = f"http://127.0.0.1:{self.http_port}/v1"
        return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


@contextmanager
def gateway(tmp: Path, keys: str = KEYS) -> Iterator[Gateway]:
    keys_file, admin_file = tmp / "api-keys.txt", tmp / "admin.key"
    keys_file.write_text(keys)
    admin_file.write_text(ADMIN)
    grpc_port, http_port, metrics_port = free_ports(3)
    with RunningFake() as scheduler:
        command = [
            *(sys.executable, "-m", "gateway", "--scheduler", scheduler.address),
            *("--port", str(grpc_port), "--http-port", str(http_port)),
            *("--metrics-port", str(metrics_port), "--slo-classes", CLASSES),
            *("--api-keys-file", str(keys_file), "--admin-key-file", str(admin_file)),
        ]
        log = open(tmp / "gateway.log", "w")  # noqa: SIM115
        env = {k: v for k, v in os.environ.items() if k != "LLMSERVE_API_KEY"}
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            asyncio.run(wait_healthy(f"127.0.0.1:{grpc_port}", 120))
            yield Gateway(
                proc, grpc_port, http_port, metrics_port, keys_file, admin_file, scheduler
            )
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()


@pytest.fixture(scope="module")
def gw(tmp_path_factory) -> Iterator[Gateway]:
    with gateway(tmp_path_factory.mktemp("tenants")) as g:
        yield g


def post(gw: Gateway, body: dict, key: str, path: str = "/v1/completions") -> tuple:
    """(HTTP status, the body as JSON, the headers)."""
    url = f"http://127.0.0.1:{gw.http_port}{path}"
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read()), dict(reply.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


def grpc_generate(gw: Gateway, key: str, **request) -> list:
    request = client.make_request(prompt="Hello there", max_tokens=3, **request)
    return list(client.stream(gw.target, request, timeout=60, api_key=key))


def tenancy(submit) -> tuple:
    t = submit.tenancy
    return (t.tenant, t.weight, t.priority, t.slo_class, t.ttft_s, t.tpot_s)


def samples(gw: Gateway, name: str) -> dict[tuple, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{gw.metrics_port}/metrics").read().decode()
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


# ---- the tenant and its standing ------------------------------------------------------------


def test_the_tenant_comes_from_the_key_and_priority_and_class_from_the_request(gw) -> None:
    sdk, before = gw.sdk("key-a"), len(gw.submits)
    sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        extra_body={"priority": -3, "slo_class": "batch", "tenant": "team-b", "weight": 9},
    )
    sdk.completions.create(model="tiny", prompt="hi", max_tokens=3)  # the key's defaults
    gw.sdk("key-b").completions.create(model="tiny", prompt="hi", max_tokens=3)
    gw.sdk("key-c").completions.create(model="tiny", prompt="hi", max_tokens=3)
    assert [tenancy(s) for s in gw.submits[before:]] == [
        ("team-a", 2.0, -3, "batch", 60.0, 0.0),
        ("team-a", 2.0, 0, "interactive", 1.0, 0.1),
        ("team-b", 1.0, 0, "", 0.0, 0.0),  # its key written as a digest
        ("team-c", 1.0, 3, "", 0.0, 0.0),
    ]


def test_grpc_choices_each_carry_the_same_tenancy(gw) -> None:
    before = len(gw.submits)
    messages = grpc_generate(gw, "key-a", priority=-5, slo_class="batch", n=2)
    assert sum(m.HasField("final") for m in messages) == 2
    assert [tenancy(s) for s in gw.submits[before:]] == [
        ("team-a", 2.0, -5, "batch", 60.0, 0.0)
    ] * 2


def test_keys_of_one_tenant_share_the_prefix_cache_and_other_tenants_do_not(gw) -> None:
    before = len(gw.submits)
    for key in ("key-a", "key-a2", "key-b"):
        gw.sdk(key).completions.create(model="tiny", prompt="same", max_tokens=3)
    a, a2, b = (s.cache_salt for s in gw.submits[before:])
    assert a == a2 and a != b and b


@pytest.mark.parametrize(
    ("key", "fields", "param"),
    [
        ("key-a", {"priority": "1"}, "priority"),
        ("key-a", {"priority": 1.5}, "priority"),
        ("key-a", {"priority": True}, "priority"),
        ("key-a", {"priority": -6}, "priority"),  # above its cap of -5
        ("key-a", {"priority": 2**31}, "priority"),
        ("key-c", {"priority": 0}, "priority"),  # its cap is 1
        ("key-b", {"priority": -1}, "priority"),  # no top_priority: 0
        ("key-a", {"slo_class": "gold"}, "slo_class"),
        ("key-a", {"slo_class": 5}, "slo_class"),
    ],
)
def test_a_priority_or_class_it_may_not_ask_for_is_400_naming_it_and_nothing_queued(
    gw, key, fields, param
) -> None:
    before = len(gw.submits)
    status, body, _ = post(gw, {"prompt": "hi", "max_tokens": 3, **fields}, key)
    assert status == 400, body
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "invalid_argument",
        param,
    )
    assert len(gw.submits) == before


def test_binary_metadata_before_the_key_is_passed_over(gw) -> None:
    """A tracing interceptor's `-bin` entry of bytes that are not UTF-8, before the key: the
    call is served (it failed UNKNOWN, a UnicodeDecodeError, on every RPC of the gateway)."""
    request = client.make_request(prompt="Hello there", max_tokens=3)
    metadata = (("x-trace-bin", b"\xff\xfe\x00"), ("authorization", "Bearer key-a"))
    with grpc.insecure_channel(gw.target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        replies = list(stub.Generate(request, timeout=60, metadata=metadata))
        assert replies[-1].HasField("final")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=60, metadata=metadata[:1]))
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("fields", "words"), [({"priority": -6}, "-5"), ({"slo_class": "gold"}, "gold")]
)
def test_grpc_refuses_them_with_invalid_argument(gw, fields, words) -> None:
    before = len(gw.submits)
    with pytest.raises(grpc.RpcError) as err:
        grpc_generate(gw, "key-a", **fields)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()
    assert len(gw.submits) == before


# ---- per-tenant queue limits ----------------------------------------------------------------


def test_a_tenant_over_its_own_queue_limit_is_429_while_another_still_gets_in(gw) -> None:
    """team-a may have two requests waiting: both held by the scheduler, its third is refused
    at once over HTTP and gRPC, naming its limit, while team-b's request is submitted; once
    the scheduler admits them, every held request completes."""
    refused = ("team-a", "max_queued")
    before_refusals = samples(gw, "llmserve_gateway_tenant_queue_refusals_total")
    gw.scheduler.fake.hold = True
    start = len(gw.submits)
    results: list[int] = []

    def waiting(key: str) -> threading.Thread:
        body = {"prompt": "wait", "max_tokens": 3}
        thread = threading.Thread(target=lambda: results.append(post(gw, body, key)[0]))
        thread.start()
        return thread

    threads = [waiting("key-a"), waiting("key-a2")]
    wait_for(lambda: len(gw.submits) == start + 2, 30, "team-a's two requests held")
    status, body, headers = post(gw, {"prompt": "one more", "max_tokens": 3}, "key-a")
    assert status == 429 and headers["retry-after"] == "1"
    assert body["error"]["code"] == "resource_exhausted"
    assert "team-a" in body["error"]["message"] and "max_queued=2" in body["error"]["message"]
    with pytest.raises(grpc.RpcError) as err:
        grpc_generate(gw, "key-a2")
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == body["error"]["message"]
    threads.append(waiting("key-b"))
    wait_for(lambda: len(gw.submits) == start + 3, 30, "team-b's request submitted")
    assert gw.submits[-1].tenancy.tenant == "team-b"
    gw.scheduler.fake.release()
    for thread in threads:
        thread.join(60)
    assert results == [200, 200, 200]
    assert post(gw, {"prompt": "again", "max_tokens": 3}, "key-a")[0] == 200
    key = (("limit", "max_queued"), ("tenant", "team-a"))
    after = samples(gw, "llmserve_gateway_tenant_queue_refusals_total")
    assert after[key] - before_refusals.get(key, 0.0) == 2, refused


def test_a_requests_choices_are_refused_together_and_nothing_of_it_is_queued(gw) -> None:
    """team-a may have two requests waiting. `n` = 3 can never wait: 400 naming `n`, over HTTP
    and gRPC, nothing submitted. With one of its requests held, `n` = 2 is over the limit now:
    429, counted once, and none of its choices reaches the scheduler (they used to be
    submitted one by one and cancelled)."""
    before = len(gw.submits)
    status, body, headers = post(gw, {"prompt": "hi", "max_tokens": 3, "n": 3}, "key-a")
    assert status == 400 and "retry-after" not in {h.lower() for h in headers}, body
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "resource_exhausted",
        "n",
    )
    assert "team-a's queue limit of 2" in error["message"]
    with pytest.raises(grpc.RpcError) as err:
        grpc_generate(gw, "key-a", n=3)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == error["message"]
    assert len(gw.submits) == before
    refusals = samples(gw, "llmserve_gateway_tenant_queue_refusals_total")
    cancelled = samples(gw, "llmserve_gateway_tenant_requests_total")
    gw.scheduler.fake.hold = True
    results: list[int] = []
    body = {"prompt": "wait", "max_tokens": 3}
    thread = threading.Thread(target=lambda: results.append(post(gw, body, "key-a")[0]))
    thread.start()
    wait_for(lambda: len(gw.submits) == before + 1, 30, "team-a's request held")
    status, body, headers = post(gw, {"prompt": "two", "max_tokens": 3, "n": 2}, "key-a")
    assert status == 429 and headers["retry-after"] == "1", body
    assert body["error"]["message"].endswith("and this request's 2 choices would wait as 2")
    assert len(gw.submits) == before + 1
    gw.scheduler.fake.release()
    thread.join(60)
    assert results == [200]
    status, body, _ = post(gw, {"prompt": "two", "max_tokens": 3, "n": 2}, "key-a")
    assert status == 200 and len(body["choices"]) == 2, body
    key = (("limit", "max_queued"), ("tenant", "team-a"))
    assert samples(gw, "llmserve_gateway_tenant_queue_refusals_total")[key] == (
        refusals.get(key, 0.0) + 1
    )
    after = samples(gw, "llmserve_gateway_tenant_requests_total")
    gone = [k for k in after if dict(k).get("finish_reason") == "cancelled"]
    assert all(after[k] == cancelled.get(k, 0.0) for k in gone)


def test_tenant_metrics_count_requests_tokens_and_goodput_by_tenant_and_class(gw) -> None:
    name = "llmserve_gateway_tenant_generated_tokens_total"
    before = samples(gw, name).get((("tenant", "team-c"),), 0.0)
    finished = samples(gw, "llmserve_gateway_tenant_requests_total")
    labels = (("finish_reason", "length"), ("slo_class", "none"), ("tenant", "team-c"))
    gw.sdk("key-c").completions.create(model="tiny", prompt="count me", max_tokens=3)
    assert samples(gw, name)[(("tenant", "team-c"),)] - before == 3
    after = samples(gw, "llmserve_gateway_tenant_requests_total")
    assert after[labels] - finished.get(labels, 0.0) == 1
    slo = samples(gw, "llmserve_gateway_slo_requests_total")
    assert {dict(k)["slo_class"] for k in slo} == {"interactive", "batch"}  # configured only


# ---- reload ---------------------------------------------------------------------------------


def test_reload_keys_by_rpc_and_sighup_and_a_bad_file_keeps_the_keys_in_force(
    tmp_path, capsys
) -> None:
    with gateway(tmp_path) as g:
        admin = client.Client(g.target, admin_key=ADMIN)
        with pytest.raises(grpc.RpcError) as err:
            client.Client(g.target).reload_keys()
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(openai.AuthenticationError):
            g.sdk("key-d").completions.create(model="tiny", prompt="hi", max_tokens=3)

        g.keys_file.write_text(KEYS.replace("weight=2", "weight=3") + "key-d team-d\n")
        assert "team-d" in admin.reload_keys()
        g.sdk("key-d").completions.create(model="tiny", prompt="hi", max_tokens=3)
        g.sdk("key-a").completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert [tenancy(s)[:2] for s in g.submits[-2:]] == [("team-d", 1.0), ("team-a", 3.0)]

        g.keys_file.write_text("key-d team-d\nkey-e team e\n")
        with pytest.raises(grpc.RpcError) as err:
            admin.reload_keys()
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert f"{g.keys_file} line 2" in err.value.details()
        g.sdk("key-a").completions.create(model="tiny", prompt="hi", max_tokens=3)  # still in

        g.keys_file.write_text("key-f team-f\n")
        args = build_parser().parse_args(
            ["reload-keys", "--target", g.target, "--admin-key-file", str(g.admin_file)]
        )
        assert args.func(args) == 0
        assert (
            "API keys reloaded: 1 keys of 1 tenants: team-f (weight 1)" in capsys.readouterr().out
        )
        assert post(g, {"prompt": "hi", "max_tokens": 3}, "key-f")[0] == 200

        g.keys_file.write_text("key-e team-e weight=5\n")
        os.kill(g.proc.pid, signal.SIGHUP)
        wait_for(lambda: post(g, {"prompt": "hi", "max_tokens": 3}, "key-e")[0] == 200, 30,
                 "key-e taken after SIGHUP")  # fmt: skip
        assert tenancy(g.submits[-1])[:2] == ("team-e", 5.0)
        assert post(g, {"prompt": "hi", "max_tokens": 3}, "key-a")[0] == 401
        admin.close()


# ---- start ----------------------------------------------------------------------------------


def start_refusal(*flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gateway", "--scheduler", "127.0.0.1:9", *flags]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_bad_keys_file_stops_the_gateway_at_start_naming_the_file_and_line(tmp_path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# ok\nkey-a team-a\nkey-b team-b slo_class=gold\n")
    done = start_refusal("--api-keys-file", str(keys), "--slo-classes", CLASSES)
    assert done.returncode != 0
    assert f"{keys} line 3: slo_class=gold is not an --slo-classes class" in done.stderr


def test_the_one_key_file_and_the_keys_file_together_are_refused_at_start(tmp_path) -> None:
    (tmp_path / "k").write_text("key-a team-a\n")
    done = start_refusal(
        "--api-key-file", str(tmp_path / "k"), "--api-keys-file", str(tmp_path / "k")
    )
    assert done.returncode == 2
    assert "--api-key-file (one key) and --api-keys-file (a key per tenant) do not go together" in (
        done.stderr
    )


# ---- the real scheduler ---------------------------------------------------------------------


def test_the_real_scheduler_accepts_and_serves_each_tenants_requests(tmp_path) -> None:
    """`llmserve up --api-keys-file --slo-classes` on the tiny model: a request of each key, one
    with a priority and a class, is served to its end by the real scheduler and worker."""
    from dataclasses import replace

    from tests.stacks import running_stack, tiny_settings, with_http_port

    keys = tmp_path / "keys.txt"
    keys.write_text(KEYS)
    settings = with_http_port(tiny_settings(api_keys_file=str(keys), slo_classes=CLASSES))
    settings = replace(settings, queue_policy="priority")
    with running_stack(settings, tmp_path / "logs") as stack:
        for key, extra in (("key-a", {"priority": -5, "slo_class": "batch"}), ("key-b", {})):
            sdk = openai.OpenAI(base_url=stack.settings.http_url, api_key=key, max_retries=0)
            reply = sdk.completions.create(
                model="tiny", prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True, **extra}
            )
            assert reply.usage.completion_tokens == 4 and reply.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError):
            sdk.completions.create(model="tiny", prompt="Hello", extra_body={"priority": -1})
