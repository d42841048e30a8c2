"""Prometheus next to the plain-process stack: a scrape config for its metrics ports, and the
`prometheus` binary (Debian's package: `make prometheus`) run on loopback."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from llmserve.stack import StackSettings

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "llmserve.json"


def stack_targets(settings: StackSettings, host: str = "127.0.0.1") -> dict[str, list[str]]:
    """Scrape targets by job: gateway = base + 0, scheduler = + 1, workers = + 2 ..."""
    if not settings.metrics_base_port:
        raise ValueError("the stack runs without metrics: set --metrics-base-port")
    workers = [f"{host}:{settings.metrics_port(2 + i)}" for i in range(settings.workers)]
    return {
        "gateway": [f"{host}:{settings.metrics_port(0)}"],
        "scheduler": [f"{host}:{settings.metrics_port(1)}"],
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

    @property
    def installed(self) -> bool:
        return bool(self.binary)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        if not self.installed:
            raise FileNotFoundError("prometheus is not on PATH: run `make prometheus`")
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(json.dumps(self.config, indent=2))  # JSON is YAML
        log = open(self.workdir / "prometheus.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
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
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"prometheus not ready after {timeout:.0f} s")
            time.sleep(0.1)

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


def start_for_stack(settings: StackSettings, port: int, workdir: Path) -> Prometheus | None:
    """Prometheus on `port` scraping the stack every 5 s, if installed and the stack has metrics."""
    if not port or not settings.metrics_base_port:
        return None
    prometheus = Prometheus(scrape_config(stack_targets(settings)), workdir, port)
    if not prometheus.installed:
        return None
    prometheus.start()
    return prometheus
