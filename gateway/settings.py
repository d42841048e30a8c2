"""Settings of the gateway: flags (and $LLMSERVE_GATEWAY_* variables) are derived from these
fields, help text included."""

from __future__ import annotations

import os
from dataclasses import dataclass

from gateway.routing import RouterSettings
from gateway.routing.settings import parse_policy
from llmcommon.admin_auth import ADMIN_KEY_HELP
from llmcommon.auth import INTERNAL_TOKEN_HELP, read_secret_file
from llmcommon.flags import help_of, setting
from llmcommon.metrics_http import METRICS_HOST_HELP
from llmcommon.tenancy import SloClass, parse_slo_classes

_ROUTER = RouterSettings()  # the router's defaults
ENV_PREFIX = "LLMSERVE_GATEWAY_"  # $LLMSERVE_GATEWAY_HTTP_PORT=8000 = --http-port 8000


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    host: str = setting("127.0.0.1", "the address to listen on (gRPC and HTTP)")
    port: int = setting(50051, "the gRPC port")
    scheduler: str = setting("127.0.0.1:50052", "address of the scheduler service")
    model: str = setting(
        "",
        "the model the workers serve, as their --model says it (smollm2, tiny, sim, a .gguf "
        "file or a Hugging Face model directory): the tokenizer and chat template are read from "
        "it; empty = the workers' model when it is a packaged one. The gateway refuses to start, "
        "or turns NOT_SERVING, while the workers serve another model or vocabulary",
    )
    default_max_tokens: int = setting(128, "max_tokens of a request that sets none")
    max_queued_requests: int = setting(
        256, "refuse with RESOURCE_EXHAUSTED beyond this many waiting requests"
    )
    max_queued_tokens: int = setting(
        262144, "refuse with RESOURCE_EXHAUSTED beyond this many waiting prompt tokens"
    )
    metrics_port: int = setting(0, "Prometheus /metrics port; 0 = off")
    metrics_host: str = setting("", METRICS_HOST_HELP)
    http_port: int = setting(
        0,
        "port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /tokenize, /detokenize; vLLM serves it on 8000), on --host with "
        "the same API key, TLS and limits as gRPC; 0 = off",
    )
    api_key_file: str = setting(
        "",
        "a file holding the API key clients must send (else $LLMSERVE_API_KEY); an empty or "
        "unreadable file stops the gateway at start",
    )
    api_keys_file: str = setting(
        "",
        "a file of API keys, one a line: `KEY TENANT [weight=W] [top_priority=P] [priority=P] "
        "[slo_class=NAME] [max_queued=N] [max_queued_tokens=N]` (docs/tenants.md); read again "
        "on SIGHUP and by `llmserve reload-keys`. Not with --api-key-file",
    )
    slo_classes: str = setting(
        "",
        "the SLO classes a request or a key may name, with their targets in seconds: "
        '"interactive=ttft:1,tpot:0.1 batch=ttft:60"; "" = none',
    )
    internal_token_file: str = setting("", INTERNAL_TOKEN_HELP)
    admin_key_file: str = setting("", ADMIN_KEY_HELP)
    tls_cert: str = setting("", "PEM certificate chain; with --tls-key turns TLS on")
    tls_key: str = setting("", "PEM private key")
    max_request_bytes: int = setting(
        1 << 20,
        "refuse larger requests with RESOURCE_EXHAUSTED (compressed ones too, as inflated)",
    )
    max_messages: int = setting(
        0,
        "refuse chats with more messages (INVALID_ARGUMENT) before rendering them; 0 = the "
        "model's context in tokens (a message renders to one token at least)",
    )
    max_prompt_chars: int = setting(
        0,
        "refuse longer prompts or chats (INVALID_ARGUMENT) before tokenizing them; 0 = the "
        "model's context times the longest token's characters (no longer text fits)",
    )
    tokenize_threads: int = setting(
        2,
        "threads that render chat templates and tokenize prompts, off the event loop that "
        "streams every response",
    )
    resubmit_timeout: float = setting(
        30.0,
        "a request held by a scheduler that dies is sent again, with the tokens already "
        "streamed, to its replacement if it is back within this many seconds",
    )
    scheduler_timeout: float = setting(
        5.0,
        "a scheduler that answers no health check this long (hung: its connection open, no "
        "answer) turns the gateway NOT_SERVING and new requests are refused; the requests it "
        "holds end with UNAVAILABLE after --resubmit-timeout, as had it died",
    )
    cells: str = setting(
        "",
        "several cells (a scheduler and its workers each): their schedulers' host:port, "
        "comma-separated, a name resolving to several addresses (a headless Service) one cell "
        "each; every request is routed to one by --router; empty = --scheduler alone",
    )
    router: str = setting("cache-aware", help_of(RouterSettings, "policy"))
    router_cache_threshold: float = setting(
        _ROUTER.cache_threshold, help_of(RouterSettings, "cache_threshold")
    )
    router_balance_abs_threshold: float = setting(
        _ROUTER.balance_abs_threshold, help_of(RouterSettings, "balance_abs_threshold")
    )
    router_balance_rel_threshold: float = setting(
        _ROUTER.balance_rel_threshold, help_of(RouterSettings, "balance_rel_threshold")
    )
    router_load_weight: float = setting(_ROUTER.load_weight, help_of(RouterSettings, "load_weight"))
    router_index_blocks: int = setting(
        _ROUTER.index_blocks, help_of(RouterSettings, "index_blocks")
    )
    router_recent_half_life_s: float = setting(
        _ROUTER.recent_half_life_s, help_of(RouterSettings, "recent_half_life_s")
    )
    scheduler_streams: str = setting(
        "session",
        "how requests travel to the scheduler: session = all of them on one stream, each "
        "step's tokens in one message (the default: less CPU per token); request = one Submit "
        "call per request, one message per request per step",
    )
    drain_timeout: float = setting(60.0, "on SIGTERM: seconds for the streams in flight to finish")
    http_header_timeout: float = setting(
        10.0,
        "seconds an HTTP client has to send a request's head, from its connection or its "
        "previous response; a slower one is closed",
    )
    http_body_timeout: float = setting(
        60.0, "seconds an HTTP client has to send a request's whole body once its head is in"
    )
    http_max_connections: int = setting(
        512,
        "HTTP connections open at once (at most half the open-file limit); more are answered "
        "503 and closed, so that idle clients cannot take what the gRPC API needs",
    )

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

    def classes(self) -> dict[str, SloClass]:
        """--slo-classes, parsed (checked at start)."""
        return parse_slo_classes(self.slo_classes)

    def router_settings(self, block_size: int = 16) -> RouterSettings:
        """--router and its thresholds (`block_size`: the cells' KV block, from their status)."""
        return RouterSettings(
            policy=parse_policy(self.router),
            cache_threshold=self.router_cache_threshold,
            balance_abs_threshold=self.router_balance_abs_threshold,
            balance_rel_threshold=self.router_balance_rel_threshold,
            load_weight=self.router_load_weight,
            index_blocks=self.router_index_blocks,
            recent_half_life_s=self.router_recent_half_life_s,
            block_size=block_size,
        )

    @property
    def tls(self) -> tuple[str, str] | None:
        return (self.tls_cert, self.tls_key) if self.tls_cert else None

    def __post_init__(self) -> None:
        if self.api_key_file and self.api_keys_file:
            raise ValueError(
                "--api-key-file (one key) and --api-keys-file (a key per tenant) do not go "
                "together: write the one key as a line of the keys file"
            )
        self.classes()  # TenancyError (a ValueError) naming the class at fault
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        for name in (
            "default_max_tokens",
            "max_queued_requests",
            "max_queued_tokens",
            "max_request_bytes",
            "tokenize_threads",
            "http_max_connections",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("http_header_timeout", "http_body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        self.router_settings()  # ValueError naming the policy or threshold at fault
        if self.scheduler_streams not in ("session", "request"):
            raise ValueError("--scheduler-streams must be session or request")
        if self.scheduler_timeout <= 0 or self.resubmit_timeout <= 0:
            raise ValueError("--scheduler-timeout and --resubmit-timeout must be > 0")
        if self.cells:
            entries = [e.strip() for e in self.cells.split(",") if e.strip()]
            if not entries:
                raise ValueError("--cells names no cell: give host:port entries")
            bad = [e for e in entries if not _host_port(e)]
            if bad:
                raise ValueError(f"--cells: {', '.join(map(repr, bad))}: not host:port")
        for name in ("max_messages", "max_prompt_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0 = from the context)")


def _host_port(entry: str) -> bool:
    """`host:port` (an IPv6 host in brackets), the port a number up to 65535."""
    host, _, port = entry.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
