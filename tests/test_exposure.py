"""What the services expose: every socket a default stack listens on is on loopback (gRPC and
metrics alike), a server beyond loopback without a token says so loudly at start, and no code
deserializes with pickle."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.auth import ApiKeyInterceptor
from gateway.settings import GatewaySettings
from llmcommon.server import Server, wait_healthy
from llmserve.ports import free_ports
from llmserve.stack import Stack
from scheduler_svc.settings import SchedulerSettings
from tests.stacks import free_run, running_stack, tiny_settings
from worker_svc.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["llmcommon", "llmserve", "gateway", "scheduler_svc", "worker_svc"]
LISTEN = "0A"


def test_every_service_defaults_to_loopback() -> None:
    for settings in (GatewaySettings(), SchedulerSettings(), WorkerSettings()):
        assert ipaddress.ip_address(settings.host).is_loopback, settings


def test_the_stack_does_not_widen_the_defaults(tmp_path) -> None:
    commands = Stack(tiny_settings(workers=2), tmp_path).commands()
    assert all("--host" not in cmd for cmd in commands.values()), commands


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_addr)
    # /proc/net/tcp{,6} print each 32-bit word in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    return ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if m := re.fullmatch(r"socket:\[(\d+)\]", target):
            inodes.add(m.group(1))
    found = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and inode in inodes:
                addr, port = local.split(":")
                found.append((str(_address(addr)), int(port, 16)))
    return found


def test_a_running_stack_listens_on_loopback_only(tmp_path) -> None:
    settings = tiny_settings(workers=2, metrics_base_port=free_run(4))
    with running_stack(settings, tmp_path) as stack:
        sockets = {name: listening(proc.pid) for name, proc in stack.procs.items()}
    print(f"\nlistening: {sockets}")
    for name, found in sockets.items():
        assert len(found) >= 2, (name, found)  # gRPC and metrics
        for addr, port in found:
            assert ipaddress.ip_address(addr).is_loopback, (name, addr, port)


PICKLE = re.compile(
    r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle|shelve|joblib)\b"
    r"|\bpickle\.(load|loads|Unpickler)\b|\btorch\.load\(|allow_pickle\s*=\s*True|\bmarshal\.loads?\(",
    re.MULTILINE,
)


def test_nothing_is_deserialized_with_pickle() -> None:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "/v1/" not in str(p)]
    assert len(files) > 30
    hits = [f"{p.relative_to(ROOT)}: {m.group(0).strip()}" for p in files
            for m in PICKLE.finditer(p.read_text())]  # fmt: skip
    assert not hits, hits


def _warnings_at_start(caplog, host: str, **kwargs) -> list[str]:
    """The warnings a server logs when it is set up on `host` (it is never started)."""

    async def build() -> None:
        server = Server(host, 0, ["llmserve.v1.Worker"], **kwargs)
        await server.server.stop(None)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmserve"):
        asyncio.run(build())
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_server_beyond_loopback_without_a_token_warns_loudly_at_start(caplog) -> None:
    (warning,) = _warnings_at_start(caplog, "0.0.0.0")
    assert "0.0.0.0" in warning and "WITHOUT A TOKEN" in warning
    assert "--internal-token-file" in warning and "llmserve.v1.Worker" in warning


def test_loopback_or_a_token_needs_no_warning(caplog) -> None:
    assert _warnings_at_start(caplog, "127.0.0.1") == []
    assert _warnings_at_start(caplog, "0.0.0.0", token="secret") == []
    assert _warnings_at_start(caplog, "0.0.0.0", interceptors=[ApiKeyInterceptor("k")]) == []


@pytest.mark.parametrize("service", ["worker_svc", "scheduler_svc"])
def test_metrics_listen_on_metrics_host_apart_from_the_grpc_host(service, tmp_path) -> None:
    """--metrics-host: the operator's metrics on an address of their own (here another
    loopback address than the gRPC one)."""
    grpc_port, metrics_port, worker_port = free_ports(3)
    args = {
        "worker_svc": ["--model", "sim"],
        "scheduler_svc": ["--workers", f"127.0.0.1:{worker_port}"],
    }[service]
    log = (tmp_path / "log").open("w")
    worker = None
    if service == "scheduler_svc":  # the scheduler waits for its worker
        worker = subprocess.Popen(
            [sys.executable, "-m", "worker_svc", "--model", "sim", "--port", str(worker_port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    proc = subprocess.Popen(
        [sys.executable, "-m", service, "--host", "127.0.0.2", "--port", str(grpc_port),
         "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        asyncio.run(wait_healthy(f"127.0.0.2:{grpc_port}", 120))
        found = set(listening(proc.pid))
    finally:
        for p in (proc, worker):
            if p is not None:
                p.kill()
                p.wait()
    assert ("127.0.0.2", grpc_port) in found and ("127.0.0.1", metrics_port) in found, found
