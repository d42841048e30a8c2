"""Settings of the scheduler service: flags (and $LLMSERVE_SCHEDULER_* variables) are derived
from these fields, help text included."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from llmcommon.admin_auth import ADMIN_KEY_HELP
from llmcommon.auth import INTERNAL_TOKEN_HELP
from llmcommon.flags import setting
from llmcommon.metrics_http import METRICS_HOST_HELP
from scheduler_svc.config import CoreConfig

ENV_PREFIX = "LLMSERVE_SCHEDULER_"  # $LLMSERVE_SCHEDULER_TOKEN_BUDGET=512 = --token-budget 512


@dataclass(frozen=True, slots=True)
class SchedulerSettings(CoreConfig):
    """The core's settings (CoreConfig, defined once there) and the service's own."""

    host: str = setting("127.0.0.1", "the address to listen on")
    port: int = setting(50052, "the gRPC port")
    workers: str = setting(
        "127.0.0.1:50061",
        "comma-separated worker addresses, or dns:NAME:PORT for every address NAME resolves to "
        "(a headless Service), looked up again every --discovery-interval; more may join by "
        'registering (worker --scheduler); "" = only those',
    )
    discovery_interval: float = setting(5.0, "seconds between lookups of the dns: entries")
    kv_capacity: int = setting(
        0, "expected KV positions per worker, checked against the workers' reports; 0 = any"
    )
    execute_timeout: float = setting(120.0, "the longest a step may take, whatever the hang bound")
    hang_floor: float = setting(
        5.0,
        "a worker whose step answer or health check is missing this long (at least) is hung: "
        "failed, its requests recomputed elsewhere",
    )
    hang_factor: float = setting(10.0, "... or this many times its slowest step so far, if longer")
    worker_return_timeout: float = setting(
        30.0,
        "requests that only failed workers can hold wait this long for one to come back (the "
        "scheduler resumed after a stall that broke every worker's stream, the one worker "
        "restarted) before they fail; new ones are queued meanwhile; 0 = they fail at once",
    )
    overlap: bool = setting(
        True, "plan and send each worker's next step while its current one runs"
    )
    stream_interval_ms: float = setting(
        0.0, "gather token events this long before sending them (0 = every step)"
    )
    metrics_port: int = setting(0, "Prometheus /metrics port; 0 = off")
    metrics_host: str = setting("", METRICS_HOST_HELP)
    drain_timeout: float = setting(60.0, "on SIGTERM: seconds for the requests in flight to finish")
    internal_token_file: str = setting("", INTERNAL_TOKEN_HELP)
    admin_key_file: str = setting("", ADMIN_KEY_HELP)
    cost_model: str = setting(
        "",
        "a calibration file (llmserve bench calibrate) that seeds every worker's step-time "
        'model; "" = a built-in prior that over-predicts (the models learn from the first steps)',
    )

    def __post_init__(self) -> None:
        for entry in self.entries:
            if entry.startswith("dns:"):
                host, _, port = entry[4:].rpartition(":")
                if not host or not port.isdigit():
                    raise ValueError(f"--workers entry {entry!r}: use dns:NAME:PORT")
        if self.discovery_interval <= 0:
            raise ValueError("--discovery-interval must be > 0")
        if self.hang_floor <= 0 or self.hang_factor < 1 or self.execute_timeout <= 0:
            raise ValueError("--hang-floor and --execute-timeout must be > 0, --hang-factor >= 1")
        if self.worker_return_timeout < 0:
            raise ValueError("--worker-return-timeout must be >= 0")
        if self.stream_interval_ms < 0:
            raise ValueError("--stream-interval-ms must be >= 0")
        if self.cost_model and not Path(self.cost_model).is_file():
            raise ValueError(
                f"--cost-model {self.cost_model}: no such file "
                "(llmserve bench calibrate writes one)"
            )
        CoreConfig.__post_init__(self)  # validates budget and running limit (no super(): slots)

    def capacity_problem(self, positions: int) -> str | None:
        """Why a worker with a KV pool of `positions` cannot serve here (--kv-capacity)."""
        if self.kv_capacity and positions != self.kv_capacity:
            return (
                f"reports a KV pool of {positions} positions, but --kv-capacity is "
                f"{self.kv_capacity}"
            )
        return None

    @property
    def entries(self) -> list[str]:
        return [t.strip() for t in self.workers.split(",") if t.strip()]

    @property
    def worker_targets(self) -> list[str]:
        """The fixed addresses (waited for at start, polled when they fail)."""
        return [t for t in self.entries if not t.startswith("dns:")]

    @property
    def dns_names(self) -> list[tuple[str, int]]:
        """(name, port) of each dns: entry."""
        out = []
        for entry in self.entries:
            if entry.startswith("dns:"):
                host, _, port = entry[4:].rpartition(":")
                out.append((host, int(port)))
        return out

    def core(self) -> CoreConfig:
        return CoreConfig(**{f.name: getattr(self, f.name) for f in fields(CoreConfig)})
