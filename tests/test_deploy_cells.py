"""docker-compose.cells.yml (two cells behind the gateway) against `llmserve up --cells 2
--workers 1`: its commands and ports compared with the stack's (the YAML read as is, so that
this runs without docker-compose), and validated over the base file by docker-compose where it
is installed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from llmserve.prometheus import stack_targets
from llmserve.stack import Stack, StackSettings
from tests.test_deploy_compose import ADMIN_SECRET, TOKEN_SECRET, flags

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = StackSettings(cells=2, workers=1, metrics_base_port=9400, http_port=8000)
HOSTS = {
    50051: "gateway", 50052: "scheduler", 50053: "scheduler1", 50061: "worker0", 50062: "worker1"
}  # fmt: skip


def overlay() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.cells.yml").read_text())


def in_containers(command: list[str]) -> dict[str, str | None]:
    def address(match: re.Match) -> str:
        return f"{HOSTS[int(match.group(1))]}:{match.group(1)}"

    expected = flags([re.sub(r"127\.0\.0\.1:(\d+)", address, arg) for arg in command])
    extra = {"--host": "0.0.0.0", "--internal-token-file": TOKEN_SECRET}
    return expected | extra | {"--admin-key-file": ADMIN_SECRET}


def test_the_cells_file_runs_the_commands_of_llmserve_up_cells_2() -> None:
    commands = Stack(SETTINGS, ROOT / "results").commands()
    services = overlay()["services"]
    for name in ("scheduler", "scheduler1", "gateway"):
        assert flags(services[name]["command"]) == in_containers(commands[name]), name
    assert set(services["gateway"]["depends_on"]) == {"scheduler", "scheduler1"}
    assert set(services["scheduler"]["depends_on"]) == {"worker0"}
    assert set(services["scheduler1"]["depends_on"]) == {"worker1"}
    published = set(services["scheduler1"]["ports"])
    assert published == {"127.0.0.1:50053:50053", "127.0.0.1:9404:9404"}


def test_the_cells_file_over_the_base_one_is_valid_compose() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed: `make prometheus` installs Debian's package")
    done = subprocess.run(
        [binary, "-f", "docker-compose.yml", "-f", "docker-compose.cells.yml", "config"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    merged = yaml.safe_load(done.stdout)["services"]
    assert set(merged) >= {"gateway", "scheduler", "scheduler1", "worker0", "worker1"}
    assert "--cells" in merged["gateway"]["command"]
    mounted = [v for v in merged["prometheus"]["volumes"] if "prometheus.yml" in str(v)]
    assert [str(v).split(":")[0] for v in mounted] == [
        str(ROOT / "deploy/prometheus/prometheus.cells.yml")
    ]


def test_the_cells_prometheus_scrapes_every_service_of_the_cells_stack() -> None:
    """Every metrics port the cells stack listens on is scraped, by its service's name, and
    each job's ports are those `llmserve up --cells 2 --prometheus-port` scrapes. (The base
    file's config left cell 1's scheduler out: its queue, stalls and worker1's KV.)"""
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.cells.yml").read_text())
    jobs = {
        j["job_name"]: [t for s in j["static_configs"] for t in s["targets"]]
        for j in config["scrape_configs"]
    }
    plain = stack_targets(SETTINGS, host="HOST")
    assert {job: [t.split(":")[1] for t in ts] for job, ts in jobs.items()} == {
        job: [t.split(":")[1] for t in ts] for job, ts in plain.items()
    }
    commands = Stack(SETTINGS, ROOT / "results").commands()  # compose names its services so
    scraped = {tuple(t.split(":")) for ts in jobs.values() for t in ts}
    assert scraped == {(name, flags(c)["--metrics-port"]) for name, c in commands.items()}


def test_the_kubernetes_cells_overlay_runs_two_equal_cells_behind_the_gateways() -> None:
    """deploy/k8s/overlays/cpu-cells rendered and validated offline: cell 1 is cell 0's pair
    (a scheduler Deployment of one replica, its workers' StatefulSet behind a headless Service)
    but for names; the gateways (replicas > 1) take both schedulers' Services with --cells."""
    import kubernetes_validate

    from tests.test_deploy_k8s import by_kind, containers, flag_values, render

    docs = render("overlays/cpu-cells")
    for doc in docs:
        if doc["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(doc, "1.31.0", strict=True)
    c = containers(docs)

    def renamed(args: list[str]) -> list[str]:
        return [a.replace("-cell1", "") for a in args]

    for name in ("llmserve-scheduler", "llmserve-worker"):
        assert renamed(c[f"{name}-cell1"]["args"]) == c[name]["args"], name
    cells = flag_values(c["llmserve-gateway"]["args"])["--cells"].split(",")
    services = by_kind(docs, "Service")
    deployments = by_kind(docs, "Deployment")
    for cell, suffix in zip(cells, ("", "-cell1"), strict=True):
        host, port = cell.split(":")
        assert host == f"llmserve-scheduler{suffix}" and host in services
        assert deployments[host]["spec"]["replicas"] == 1
        workers = flag_values(c[host]["args"])["--workers"]
        assert workers == f"dns:llmserve-worker{suffix}:50061"
        assert by_kind(docs, "Service")[f"llmserve-worker{suffix}"]["spec"]["clusterIP"] == "None"
        assert port == flag_values(c[host]["args"])["--port"]
    assert deployments["llmserve-gateway"]["spec"]["replicas"] > 1
    assert "--scheduler" not in flag_values(c["llmserve-gateway"]["args"])
