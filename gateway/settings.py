"""Settings of the gateway (flags are derived from these fields)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from llmserve.auth import read_secret_file


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 50051
    scheduler: str = "127.0.0.1:50052"
    model: str = ""  # the workers' --model (smollm2, tiny, sim, .gguf, HF dir); "" = theirs
    default_max_tokens: int = 128
    max_queued_requests: int = 256  # requests submitted but not yet admitted to a batch
    max_queued_tokens: int = 262144  # their prompt tokens
    metrics_port: int = 0  # Prometheus HTTP port; 0 = off
    http_port: int = 0  # the OpenAI-compatible HTTP API; 0 = off
    api_key_file: str = ""  # a file holding the API key; also $LLMSERVE_API_KEY; "" = no key
    internal_token_file: str = ""  # sent to the scheduler; also $LLMSERVE_INTERNAL_TOKEN
    tls_cert: str = ""  # PEM certificate chain; with --tls-key turns TLS on
    tls_key: str = ""  # PEM private key
    max_request_bytes: int = 1 << 20  # largest accepted request message, decompressed
    max_messages: int = 0  # chat messages per request; 0 = the model's context in tokens
    max_prompt_chars: int = 0  # characters of the prompt or of all messages; 0 = from the context
    tokenize_threads: int = 2  # threads that render and tokenize prompts, off the event loop
    resubmit_timeout: float = 30.0  # a restarted scheduler must be back this soon for resubmits
    drain_timeout: float = 60.0  # on SIGTERM: seconds for the streams in flight to finish

    def api_key(self) -> str:
        """The content of --api-key-file, else $LLMSERVE_API_KEY; "" = no key. A key file that
        is empty or unreadable is SystemExit with the reason: a configured key is never off."""
        if not self.api_key_file:
            return os.environ.get("LLMSERVE_API_KEY", "")
        raw = read_secret_file(self.api_key_file, "API key")
        if not raw:
            raise SystemExit(
                f"the API key file {self.api_key_file} is empty: write the key into it, or start "
                "without --api-key-file to serve without a key"
            )
        try:
            return raw.decode()
        except UnicodeDecodeError as err:
            raise SystemExit(f"the API key in {self.api_key_file} is not UTF-8: {err}") from None

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
            "tokenize_threads",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("max_messages", "max_prompt_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0 = from the context)")
