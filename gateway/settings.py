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
    api_key_file: str = ""  # a file holding the API key; also $LLMSERVE_API_KEY; "" = no key
    tls_cert: str = ""  # PEM certificate chain; with --tls-key turns TLS on
    tls_key: str = ""  # PEM private key
    max_request_bytes: int = 1 << 20  # largest accepted request message

    def api_key(self) -> str:
        import os

        if self.api_key_file:
            with open(self.api_key_file) as f:
                return f.read().strip()
        return os.environ.get("LLMSERVE_API_KEY", "")

    @property
    def tls(self) -> tuple[str, str] | None:
        return (self.tls_cert, self.tls_key) if self.tls_cert else None

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        for name in (
            "default_max_tokens",
            "max_queued_requests",
            "max_queued_tokens",
            "max_request_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
