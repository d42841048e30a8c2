"""Settings of the gateway (flags are derived from these fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 50051
    scheduler: str = "127.0.0.1:50052"
    tokenizer: str = ""  # a .gguf file holding the tokenizer; "" = the default SmolLM2 file
    default_max_tokens: int = 128
    max_queued_requests: int = 256  # requests submitted but not yet admitted to a batch
    max_queued_tokens: int = 262144  # their prompt tokens
    metrics_port: int = 0  # Prometheus HTTP port; 0 = off

    def __post_init__(self) -> None:
        for name in ("default_max_tokens", "max_queued_requests", "max_queued_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
