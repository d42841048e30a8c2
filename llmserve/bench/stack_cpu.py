"""`python -m llmserve.bench.stack_cpu`: what the stack costs per token, outside the forward.

A real stack (gateway, scheduler, one worker) per run, under a closed loop of `concurrency`
streaming clients (gRPC to the gateway, or its OpenAI HTTP API); over a window after warm-up:
CPU seconds per 1,000 output tokens of each process (utime + stime from /proc/PID/stat, the
client's own too), output tok/s, the worker's forward time per step (its own reports), the
inter-token time the client sees (mean gap between one stream's tokens), and what the worker
alone would do for the same batches (tokens / forward seconds). Over HTTP a chunk counts as
one token in the inter-token time (a chunk of a stream that caught up holds several).

`--base DIR` runs another checkout side by side (a clone with its stubs and kernels; its
processes start from there with PYTHONPATH=DIR), alternating base and this tree, and prints
the ratios new / base (`--new DIR`: another checkout as new, e.g. base plus one change, when
this tree holds other work). `--small-step-threads -1,0` runs each checkout with each value of
the stack's --small-step-threads (-1: one fewer than --threads where the worker takes every
core; 0: --threads), alternating, one row each ("new s-1", "new s0"); `--decode-steps 1,8`
likewise with the scheduler's --decode-steps ("new d1", "new d8"). Each run is a child process
of its own (grpc.aio and several loops)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
PROCESSES = ("gateway", "scheduler", "worker0", "client")
IDLE_S = 2.0  # the idle stack's CPU is measured this long before the load starts


@dataclass(frozen=True, slots=True)
class Config:
    model: str
    concurrency: int
    api: str  # grpc | http
    window_s: float
    prompt_tokens: int
    max_tokens: int
    threads: int
    small_step_threads: int = -1  # the stack's --small-step-threads
    decode_steps: int = 1  # the scheduler's --decode-steps
    decode_runs: str = "auto"  # the scheduler's --decode-runs (a checkout without it: fixed)


@dataclass(slots=True)
class Row:
    rev: str
    model: str
    concurrency: int
    api: str
    tokens: int  # generated in the window (the scheduler's count)
    tok_s: float
    cpu_per_1k: dict[str, float]  # process -> CPU seconds per 1,000 output tokens
    step_ms: float  # the worker's forward time per step (its own reports)
    tokens_per_step: float
    worker_tok_s: float  # tokens / forward seconds: the worker alone for the same batches
    itl_ms: float  # mean gap between a stream's tokens after its first, as the client sees them
    tokens_per_message: float  # as the client receives them (more than 1: a stream caught up)
    busy: float  # forward seconds / wall
    idle_cpu: dict[str, float]  # process -> CPU s per s with no request, before the load


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


class ClosedLoop:
    """`n` streams, each starting its next request when one ends, until stopped; the gaps
    between a stream's tokens after its first (each gap / tokens in the delta)."""

    def __init__(self, config: Config, target: str) -> None:
        self.config, self.target = config, target
        self.tokens = 0
        self.messages = 0  # with tokens, in the window
        self.counted = 0  # their tokens
        self.gap_s = 0.0  # summed gaps between a stream's tokens after its first
        self.gaps = 0
        self.measuring = False
        self.stopping = False
        self.errors: list[str] = []

    def seen(self, count: int, last: float | None) -> float:
        now = time.perf_counter()
        self.tokens += count
        if self.measuring:
            self.messages, self.counted = self.messages + 1, self.counted + count
        if self.measuring and last is not None:
            self.gap_s += now - last
            self.gaps += count
        return now

    async def run(self) -> None:
        streams = self.grpc_stream if self.config.api == "grpc" else self.http_stream
        await asyncio.gather(*(streams(i) for i in range(self.config.concurrency)))

    async def grpc_stream(self, i: int) -> None:
        import grpc

        from llmcommon.v1 import gateway_pb2_grpc
        from llmserve import client
        from llmserve.bench.prompts import prompt_text

        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for round_ in itertools.count():
                request = client.make_request(
                    prompt=prompt_text(self.config.prompt_tokens),
                    max_tokens=self.config.max_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                    request_id=f"cpu-{i}-{round_}",
                )
                last = None
                try:
                    async for message in stub.Generate(request):
                        if message.delta.token_ids:
                            last = self.seen(len(message.delta.token_ids), last)
                        if self.stopping:
                            return
                except grpc.aio.AioRpcError as err:
                    self.errors.append(f"{err.code().name}: {err.details()}")
                    return

    async def http_stream(self, i: int) -> None:
        import httpx

        from llmserve.bench.prompts import prompt_text

        body = {
            "model": "default",
            "prompt": prompt_text(self.config.prompt_tokens),
            "max_tokens": self.config.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        async with httpx.AsyncClient(base_url=self.target, timeout=120) as http:
            model = (await http.get("/models")).json()["data"][0]["id"]
            body["model"] = model
            while not self.stopping:
                last = None
                async with http.stream("POST", "/completions", json=body) as reply:
                    if reply.status_code != 200:
                        self.errors.append(f"HTTP {reply.status_code}: {await reply.aread()}")
                        return
                    async for line in reply.aiter_lines():
                        if line.startswith("data: {"):
                            last = self.seen(1, last)  # a chunk counts as one token here
                        if self.stopping:
                            return


async def status(target: str):
    from llmcommon.auth import internal_token
    from llmcommon.server import internal_channel
    from llmcommon.v1 import scheduler_pb2, scheduler_pb2_grpc

    async with internal_channel(target, internal_token()) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        return await stub.Status(scheduler_pb2.StatusRequest(), timeout=10)


def sample(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


async def measure(config: Config, settings, pids: dict[str, int], rev: str) -> Row:
    target = settings.gateway if config.api == "grpc" else settings.http_url
    idle0, i0 = sample(pids), time.perf_counter()
    await asyncio.sleep(IDLE_S)
    idle1, i1 = sample(pids), time.perf_counter()
    load = ClosedLoop(config, target)
    task = asyncio.create_task(load.run())
    try:
        deadline = time.monotonic() + 120
        while (await status(settings.scheduler)).running < config.concurrency:
            if load.errors or task.done() or time.monotonic() > deadline:
                raise RuntimeError(f"never {config.concurrency} running: {load.errors[:3]}")
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # past the first prefills
        before, cpu0, t0 = await status(settings.scheduler), sample(pids), time.perf_counter()
        load.measuring = True
        await asyncio.sleep(config.window_s)
        load.measuring = False
        after, cpu1, t1 = await status(settings.scheduler), sample(pids), time.perf_counter()
    finally:
        load.stopping = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if load.errors:
        raise RuntimeError(f"the load failed: {load.errors[:3]}")
    wall = t1 - t0
    tokens = after.generated_tokens - before.generated_tokens
    w0, w1 = before.workers[0], after.workers[0]
    forward, steps = w1.forward_seconds - w0.forward_seconds, w1.steps - w0.steps
    return Row(
        rev=rev,
        model=config.model,
        concurrency=config.concurrency,
        api=config.api,
        tokens=tokens,
        tok_s=tokens / wall,
        cpu_per_1k={n: 1e3 * (cpu1[n] - cpu0[n]) / max(tokens, 1) for n in cpu0},
        step_ms=1e3 * forward / max(steps, 1),
        tokens_per_step=tokens / max(steps, 1),
        worker_tok_s=tokens / max(forward, 1e-9),
        itl_ms=1e3 * load.gap_s / max(load.gaps, 1),
        tokens_per_message=load.counted / max(load.messages, 1),
        busy=forward / wall,
        idle_cpu={n: (idle1[n] - idle0[n]) / (i1 - i0) for n in idle0},
    )


def child(config: Config, rev: str, log_dir: Path) -> Row:
    """One run, in this process: a stack of the checkout on PYTHONPATH, the load, the row."""
    from llmserve.ports import free_ports, free_run
    from llmserve.stack import Stack, StackSettings

    ports = free_ports(3)
    c = config.concurrency
    settings = StackSettings(
        model=config.model,
        workers=1,
        threads=config.threads,
        small_step_threads=config.small_step_threads,
        **known(StackSettings, decode_steps=config.decode_steps, decode_runs=config.decode_runs),
        token_budget=max(256, c * 2),
        max_running=c,
        kv_capacity=max(4096, c * 16 * -(-(config.prompt_tokens + config.max_tokens + 32) // 16)),
        gateway_port=ports[0],
        scheduler_port=ports[1],
        http_port=ports[2] if config.api == "http" else 0,
        worker_base_port=free_run(1, ports),
        max_queued_requests=c * 2,
        default_max_tokens=config.max_tokens,
    )
    with Stack(settings, log_dir) as stack:
        pids = {name: proc.pid for name, proc in stack.procs.items()} | {"client": os.getpid()}
        loop = asyncio.new_event_loop()  # not asyncio.run: its teardown can wait on gRPC
        return loop.run_until_complete(measure(config, settings, pids, rev))


def known(settings: type, **fields) -> dict:
    """The fields a checkout's settings have (an older one lacks the newer settings)."""
    return {k: v for k, v in fields.items() if k in settings.__dataclass_fields__}


def run_child(config: Config, rev: str, root: Path, out: Path) -> Row:
    log_dir = out / f"{rev.replace(' ', '-')}-{config.model}-{config.concurrency}-{config.api}"
    fields = asdict(config)
    if fields["small_step_threads"] == -1:  # the default: a checkout from before it knows none
        del fields["small_step_threads"]
    command = [sys.executable, str(HERE), "--child", json.dumps(fields), rev, str(log_dir)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    for attempt in (1, 2):
        done = subprocess.run(
            command, cwd=root, env=env, capture_output=True, text=True, timeout=600
        )
        if done.returncode == 0:
            return Row(**json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"  {rev} {config}: failed (attempt {attempt}):\n{done.stderr[-3000:]}", flush=True)
    raise RuntimeError(f"{rev} {config}: failed twice")


def median_row(rows: list[Row]) -> Row:
    return sorted(rows, key=lambda r: r.tok_s)[len(rows) // 2]


def table(rows: list[Row]) -> str:
    names = PROCESSES
    head = (
        "| rev | model | api | conc | out tok/s | worker alone tok/s | stack/worker | "
        "step ms | ITL ms | ITL/step | tok/step | tok/msg | "
        + " | ".join(f"{n} CPU s/1k" for n in names)
        + " |\n|"
        + "---|" * (12 + len(names))
    )
    lines = [head]
    for r in rows:
        cpu = " | ".join(f"{r.cpu_per_1k.get(n, 0):.3f}" for n in names)
        lines.append(
            f"| {r.rev} | {r.model} | {r.api} | {r.concurrency} | {r.tok_s:.1f} | "
            f"{r.worker_tok_s:.1f} | {r.tok_s / r.worker_tok_s:.2f} | {r.step_ms:.2f} | "
            f"{r.itl_ms:.2f} | {r.itl_ms / max(r.step_ms, 1e-9):.2f} | {r.tokens_per_step:.1f} | "
            f"{r.tokens_per_message:.2f} | "
            f"{cpu} |"
        )
    return "\n".join(lines)


def ratios(new: Row, base: Row) -> str:
    cpu = ", ".join(
        f"{n} {new.cpu_per_1k[n] / max(base.cpu_per_1k[n], 1e-9):.2f}x" for n in PROCESSES
    )
    return (
        f"{new.model} {new.api} c={new.concurrency}: tok/s {new.tok_s / base.tok_s:.2f}x, "
        f"ITL {new.itl_ms / max(base.itl_ms, 1e-9):.2f}x, CPU/token {cpu}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, help="another checkout, run side by side")
    p.add_argument(
        "--new", type=Path, default=ROOT, help="the checkout measured as new (default: this one)"
    )
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--concurrency", default="1,64")
    p.add_argument("--api", default="grpc", help="grpc, http, or grpc,http")
    p.add_argument("--window", type=float, default=8.0, help="seconds measured per run")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="the worker's torch threads")
    p.add_argument(
        "--small-step-threads", default="-1", help="the stack's, comma-separated: one run each"
    )
    p.add_argument(
        "--decode-steps",
        default="1",
        help="the scheduler's, comma-separated: one run each; K runs --decode-runs auto, Kf "
        "fixed (e.g. 1,8,8f)",
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("results/stack_cpu"))
    args = p.parse_args()
    roots = {"new": args.new.resolve()} | ({"base": args.base.resolve()} if args.base else {})
    smalls = [int(v) for v in args.small_step_threads.split(",")]
    runs_per_step = args.decode_steps.split(",")
    revs = {  # the variants run: a checkout, with one --small-step-threads and --decode-steps
        " ".join(
            [rev]
            + ([f"s{v}"] if len(smalls) > 1 else [])
            + ([f"d{d}"] if len(runs_per_step) > 1 else [])
        ): (root, v, d)
        for rev, root in roots.items()
        for v in smalls
        for d in runs_per_step
    }
    rows: list[Row] = []
    for model, conc, api in itertools.product(
        args.models.split(","), [int(c) for c in args.concurrency.split(",")], args.api.split(",")
    ):
        runs: dict[str, list[Row]] = {rev: [] for rev in revs}
        for _ in range(args.repeats):
            for rev, (root, small, d) in reversed(revs.items()):  # base first, then new
                config = Config(model, conc, api, args.window, args.prompt_tokens,
                                args.max_tokens, args.threads, small, int(d.rstrip("f")),
                                "fixed" if d.endswith("f") else "auto")  # fmt: skip
                row = run_child(config, rev, root, args.out.resolve())
                runs[rev].append(row)
                print(f"  {rev} {model} {api} c={conc}: {row.tok_s:.1f} tok/s, "
                      f"ITL {row.itl_ms:.2f} ms, step {row.step_ms:.2f} ms, "
                      f"{row.tokens_per_message:.2f} tok/msg, "
                      f"CPU/1k {json.dumps({k: round(v, 3) for k, v in row.cpu_per_1k.items()})}, "
                      f"idle CPU {json.dumps({k: round(v, 3) for k, v in row.idle_cpu.items()})}",
                      flush=True)  # fmt: skip
        medians = {rev: median_row(rs) for rev, rs in runs.items()}
        rows += medians.values()
        if "base" in medians:
            print("  ratio new/base: " + ratios(medians["new"], medians["base"]), flush=True)
    print(table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stack_cpu.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.path[0:1] = []  # this file's directory is not a package root
        row = child(Config(**json.loads(sys.argv[2])), sys.argv[3], Path(sys.argv[4]))
        print(json.dumps(asdict(row)), flush=True)
        os._exit(0)  # do not wait on gRPC's threads at exit
    sys.exit(main())
