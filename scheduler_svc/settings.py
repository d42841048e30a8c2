"""Settings of the scheduler service (flags are derived from these fields)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.config import BatchMode, CoreConfig, KvPolicy


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    host: str = "127.0.0.1"
    port: int = 50052
    # comma-separated worker addresses; dns:NAME:PORT = every address NAME resolves to, looked
    # up again every discovery_interval seconds (a Kubernetes headless Service); workers may
    # also register themselves ("" = only those)
    workers: str = "127.0.0.1:50061"
    discovery_interval: float = 5.0
    policy: KvPolicy = KvPolicy.PAGED
    mode: BatchMode = BatchMode.CONTINUOUS
    token_budget: int = 256
    max_running: int = 32
    chunked_prefill: bool = True
    prefix_caching: bool = True  # reuse cached prompt prefixes' KV (paged only)
    kv_capacity: int = 0  # expected positions per worker; 0 = take the workers' reports
    execute_timeout: float = 120.0  # seconds before a silent worker counts as failed, at most
    # a worker is hung (failed, its requests recomputed elsewhere) when a step's answer, or its
    # health check, is missing for max(hang_floor, hang_factor x its slowest step so far)
    hang_floor: float = 5.0
    hang_factor: float = 10.0
    overlap: bool = True  # plan and send step N+1 while step N runs
    stream_interval_ms: float = 0.0  # gather token events this long before sending them
    metrics_port: int = 0  # Prometheus HTTP port; 0 = off
    drain_timeout: float = 60.0  # on SIGTERM: seconds for the requests in flight to finish
    internal_token_file: str = ""  # every call must carry this token; also $LLMSERVE_INTERNAL_TOKEN

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
        if self.stream_interval_ms < 0:
            raise ValueError("--stream-interval-ms must be >= 0")
        self.core()  # validates budget and running limit

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
        return CoreConfig(
            token_budget=self.token_budget,
            max_running=self.max_running,
            policy=self.policy,
            mode=self.mode,
            chunked_prefill=self.chunked_prefill,
            prefix_caching=self.prefix_caching,
        )
