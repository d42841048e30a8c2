"""Settings of the scheduler service (flags are derived from these fields)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.config import BatchMode, CoreConfig, KvPolicy


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    host: str = "127.0.0.1"
    port: int = 50052
    workers: str = "127.0.0.1:50061"  # comma-separated worker addresses
    policy: KvPolicy = KvPolicy.PAGED
    mode: BatchMode = BatchMode.CONTINUOUS
    token_budget: int = 256
    max_running: int = 32
    chunked_prefill: bool = True
    kv_capacity: int = 0  # expected positions per worker; 0 = take the workers' reports
    execute_timeout: float = 120.0  # seconds before a silent worker counts as failed
    metrics_port: int = 0  # Prometheus HTTP port; 0 = off

    def __post_init__(self) -> None:
        if not self.worker_targets:
            raise ValueError("--workers needs at least one address")
        self.core()  # validates budget and running limit

    @property
    def worker_targets(self) -> list[str]:
        return [t.strip() for t in self.workers.split(",") if t.strip()]

    def core(self) -> CoreConfig:
        return CoreConfig(
            token_budget=self.token_budget,
            max_running=self.max_running,
            policy=self.policy,
            mode=self.mode,
            chunked_prefill=self.chunked_prefill,
        )
