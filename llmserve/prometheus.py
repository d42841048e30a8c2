"""Prometheus next to the plain-process stack: a scrape config for its metrics ports, and the
`prometheus` binary (Debian's package: `make prometheus`) run on loopback."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from llmcommon.server import PARENT_PID_VAR
from llmserve.stack import StackSettings

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "llmserve.json"
# a command's prefix: it gets SIGTERM when this process dies, even by SIGKILL (prctl's death
# signal survives exec), as the stack's services do (llmcommon.server.die_with_parent)
DIES_WITH_PARENT = [
    sys.executable,
    "-c",
    "import os, sys; from llmcommon.server import die_with_parent; die_with_parent(); "
    "os.execv(sys.argv[1], sys.argv[1:])",
]


def stack_targets(settings: StackSettings, host: str = "127.0.0.1") -> dict[str, list[str]]:
    """Scrape targets by job: gateway = base + 0, scheduler = + 1, workers = + 2 ... (every
    cell's: its workers after the cells before it, cell c's scheduler after all the workers)."""
    if not settings.metrics_base_port:
        raise ValueError("the stack runs without metrics: set --metrics-base-port")
    workers = [f"{host}:{settings.metrics_port(2 + i)}" for i in range(settings.all_workers)]
    schedulers = [f"{host}:{settings.scheduler_metrics_port(c)}" for c in range(settings.cells)]
    return {
        "gateway": [f"{host}:{settings.metrics_port(0)}"],
        "scheduler": schedulers,
        "worker": workers,
    }


def scrape_config(targets: dict[str, list[str]], interval_s: int = 5) -> dict:
    """A prometheus.yml (as a dict) scraping `targets` every `interval_s` seconds."""
    every = f"{interval_s}s"
    return {
        "global": {"scrape_interval": every, "scrape_timeout": every},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": hosts}]}
            for job, hosts in targets.items()
        ],
    }


class Prometheus:
    """One Prometheus server with its config and data under `workdir`."""

    def __init__(self, config: dict, workdir: Path, port: int, binary: str = "") -> None:
        self.config = config
        self.workdir = workdir
        self.port = port
        self.binary = binary or shutil.which("prometheus") or ""
        self.proc: subprocess.Popen | None = None
        self.config_file = workdir / "prometheus.yml"

    @property
    def installed(self) -> bool:
        return bool(self.binary)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        """Start it and wait until it is ready; OSError when the port is taken (another
        Prometheus there would answer as if it were this one), RuntimeError if it exits."""
        if not self.installed:
            raise FileNotFoundError("prometheus is not on PATH: run `make prometheus`")
        if not port_free(self.port):
            raise OSError(f"port {self.port} is in use (another Prometheus?)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(json.dumps(self.config, indent=2))  # JSON is YAML
        log = open(self.workdir / "prometheus.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                *DIES_WITH_PARENT,
                self.binary,
                f"--config.file={self.config_file}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, PARENT_PID_VAR: str(os.getpid()), "PYTHONPATH": str(ROOT)},
        )
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                log = (self.workdir / "prometheus.log").read_text()[-2000:]
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{log}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                    if reply.status == 200 and self._is_ours():
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"prometheus not ready after {timeout:.0f} s")
            time.sleep(0.1)

    def _is_ours(self) -> bool:
        """Does the Prometheus answering on the port read this one's config (not another that
        took the port first)?"""
        with urllib.request.urlopen(f"{self.url}/api/v1/status/flags", timeout=1) as reply:
            flags = json.load(reply).get("data", {})
        if flags.get("config.file") == str(self.config_file):
            return True
        raise RuntimeError(f"another Prometheus answers on port {self.port}")

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> Prometheus:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_for_stack(settings: StackSettings, port: int, workdir: Path) -> Prometheus | None:
    """Prometheus on `port` scraping the stack every 5 s, if installed and the stack has metrics."""
    if not port or not settings.metrics_base_port:
        return None
    prometheus = Prometheus(scrape_config(stack_targets(settings)), workdir, port)
    if not prometheus.installed:
        return None
    prometheus.start()
    return prometheus
