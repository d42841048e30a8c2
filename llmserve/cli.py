"""The `llmserve` command: up, generate, status, get, set, reload-keys, demo, bench."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import grpc

from llmcommon.admin_auth import admin_key
from llmcommon.flags import add_flags, env_name, field_name, from_args
from llmserve import client
from llmserve.bench.errors import BenchError
from llmserve.prometheus import DASHBOARD, Prometheus, start_for_stack
from llmserve.stack import Stack, StackError, StackSettings, variable_prefix
from llmserve.status_text import format_status
from scheduler_svc.live_settings import NAMES, SettingError, parse_pairs


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGINT, _interrupt)  # also when started in the background
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        settings = from_args(StackSettings, args)
    except ValueError as err:  # the settings' own checks, as a bad flag: one line, exit 2
        print(f"llmserve up: error: {err}{from_variable(str(err))} (see llmserve up --help)",
              file=sys.stderr)  # fmt: skip
        return 2
    stack = Stack(settings, Path(args.log_dir))
    cells = f"{settings.cells} cells of " if settings.cells > 1 else ""
    print(
        f"starting {cells}{settings.workers} worker(s) and a scheduler, and the gateway "
        f"({settings.model}, {settings.policy}, {settings.mode}); logs in {args.log_dir}/",
        flush=True,
    )
    try:
        stack.start()  # stops what it started when one does not come up
    except (StackError, TimeoutError) as err:
        print(f"llmserve up: {err}", file=sys.stderr)
        return 1
    print(f"gateway   {settings.gateway}   (llmserve generate --target {settings.gateway} ...)")
    if settings.http_url:
        print(f"http      {settings.http_url}   (OpenAI-compatible; curl .../v1/models)")
    for cell in range(settings.cells):
        name = f"cell{cell} sch" if settings.cells > 1 else "scheduler"
        status = f"llmserve status --target {settings.gateway}"
        print(f"{name} {settings.cell_scheduler(cell)}   ({status})")
    if settings.admin_key_file:
        print(
            f"admin     llmserve set --target {settings.gateway} --admin-key-file "
            f"{settings.admin_key_file} key=value ...   (live settings; also get, status --explain)"
        )
    if settings.api_keys_file:
        print(
            f"tenants   the keys of {settings.api_keys_file}; after editing it: llmserve "
            f"reload-keys --target {settings.gateway} --admin-key-file FILE (docs/tenants.md)"
        )
    for i in range(settings.all_workers):
        print(f"worker{i}   {settings.worker_address(i)}")
    if settings.metrics_base_port:
        others = "".join(
            f", {settings.scheduler_metrics_port(c)} cell {c}'s scheduler"
            for c in range(1, settings.cells)
        )
        print(
            f"metrics   http://127.0.0.1:{settings.metrics_port(0)}/metrics (gateway), "
            f"+1 scheduler, +2.. workers{others}"
        )
    prometheus = _start_prometheus(settings, args)
    print("Ctrl-C stops everything.", flush=True)
    try:
        why = stack.supervise(args.restarts, say=lambda line: print(line, file=sys.stderr))
        print(f"{why}; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...")
        return 0
    finally:
        if prometheus is not None:
            prometheus.stop()
        codes = stack.stop()
        print("stopped: " + ", ".join(f"{n} exit {c}" for n, c in codes.items()))


def _start_prometheus(settings: StackSettings, args: argparse.Namespace) -> Prometheus | None:
    """Prometheus scraping the stack when asked for and installed; says where to look."""
    if not settings.metrics_base_port:
        return None
    workdir = Path(args.log_dir) / "prometheus"
    try:
        prometheus = start_for_stack(settings, args.prometheus_port, workdir)
    except (OSError, RuntimeError) as err:
        print(f"prometheus did not start ({err}); the metrics endpoints still work")
        prometheus = None
    if prometheus is not None:
        print(f"prometheus {prometheus.url}   (config {workdir}/prometheus.yml)")
    elif args.prometheus_port and not shutil.which("prometheus"):
        print("prometheus is not installed (`make prometheus` installs Debian's package)")
    where = prometheus.url if prometheus else "your Prometheus"
    print(f"dashboard {DASHBOARD}")
    print(f"          (import into Grafana with a datasource at {where}; docs/observability.md)")
    return prometheus


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.system is not None:  # a chat: the system message, then the prompt as the user's
        request = {"prompt": prompt, "system": args.system}
    elif args.chat:
        request = {"messages": [("user", prompt)]}
    else:
        request = {"prompt": prompt}
    llm = client.Client(args.target, api_key=args.api_key, tls_ca=args.tls_ca, timeout=args.timeout)
    with llm:
        done = llm.generate(
            **request,
            on_text=None if args.json else _print_text,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            top_p=args.top_p,
            top_k=args.top_k,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            priority=args.priority,
            slo_class=args.slo_class,
        )
    if args.json:
        print(json.dumps(dataclasses.asdict(done)))
    else:
        u = done.usage
        print(
            f"\n[{done.finish_reason}; {u['prompt_tokens']} prompt + {u['completion_tokens']} "
            f"generated tokens; queue {u['queue_time_s']:.3f} s, first token "
            f"{u['time_to_first_token_s']:.3f} s, total {u['total_time_s']:.3f} s]",
            file=sys.stderr,
        )
    return 0


def _print_text(text: str) -> None:
    print(text, end="", flush=True)


def cmd_status(args: argparse.Namespace) -> int:
    with admin_client(args) as llm:
        s = llm.status(explain=args.explain)
    print(json.dumps(s, indent=2) if args.json else format_status(s, explain=args.explain))
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    with admin_client(args) as llm:
        values = llm.get_settings()
    text = "\n".join(f"{k}={v}" for k, v in values.items())
    print(json.dumps(values, indent=2) if args.json else text)
    return 0


def cmd_set(args: argparse.Namespace) -> int:
    try:
        changes = parse_pairs(args.changes)
    except SettingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with admin_client(args) as llm:
        changed = llm.set_settings(changes)
    for name, (old, new) in changed.items():
        print(f"{name}: {old} -> {new}")
    if not changed:
        print("nothing changed (every value was already so)")
    return 0


def cmd_reload_keys(args: argparse.Namespace) -> int:
    with admin_client(args) as llm:
        print(f"API keys reloaded: {llm.reload_keys()}")
    return 0


def admin_client(args: argparse.Namespace) -> client.Client:
    key = admin_key(args.admin_key_file) if args.admin_key_file else ""
    return client.Client(args.target, api_key=args.api_key, tls_ca=args.tls_ca, admin_key=key)


def cmd_demo(args: argparse.Namespace) -> int:
    from llmserve.demo import run_demo

    return run_demo(Path(args.log_dir))


def from_variable(message: str, argv: list[str] | None = None) -> str:
    """ " (from $VARIABLE)" when a refused setting of `up` (the first word of the message)
    came from a service's variable rather than a flag ("" otherwise)."""
    name = field_name(message.split(" ", 1)[0].removeprefix("--"))
    prefix = variable_prefix(name)
    flag = "--" + name.replace("_", "-")
    given = any(a == flag or a.startswith(flag + "=") for a in (argv or sys.argv[1:]))
    if not prefix or given or env_name(prefix, name) not in os.environ:
        return ""
    return f" (from ${env_name(prefix, name)})"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="llmserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start scheduler + workers + gateway on loopback")
    add_flags(up, StackSettings, env_prefix=variable_prefix)  # the services' own variables
    up.add_argument(
        "--log-dir", default="results/logs", help="each service's log file (default: results/logs)"
    )
    up.add_argument(
        "--prometheus-port",
        type=int,
        default=0,
        help="also run Prometheus (when installed) on this loopback port, scraping the metrics "
        "ports every 5 s; needs --metrics-base-port (default: 0, off)",
    )
    up.add_argument(
        "--restarts",
        type=int,
        default=5,
        help="a service that exits is started again, up to this many times a minute; past "
        "that, or at its first exit with 0, the stack stops (default: 5)",
    )
    up.set_defaults(func=cmd_up)

    gen = sub.add_parser("generate", help="stream a completion from the gateway")
    add_gateway_flags(gen)
    gen.add_argument("--prompt", required=True, help="the prompt; - reads it from stdin")
    gen.add_argument("--system", help="a system message: sends a chat of it and the prompt")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--max-tokens", type=wire_int("max_tokens"), help="most tokens to generate")
    gen.add_argument("--temperature", type=float, help="0 = greedy")
    gen.add_argument("--top-p", type=float, help="nucleus sampling: the smallest set this likely")
    gen.add_argument(
        "--top-k", type=wire_int("top_k"), help="sample among the k likeliest tokens (0 = off)"
    )
    gen.add_argument(
        "--seed", type=wire_int("seed"), help="the same seed gives the same text (0 or more)"
    )
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence")
    gen.add_argument(
        "--priority",
        type=wire_int("priority"),
        help="lower is served first (default: the API key's)",
    )
    gen.add_argument(
        "--slo-class", default="", help="a class of the gateway's --slo-classes (default: key's)"
    )
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    gen.set_defaults(func=cmd_generate)

    st = sub.add_parser("status", help="the scheduler's snapshot and stalls, via the gateway")
    add_gateway_flags(st)
    st.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    st.add_argument(
        "--explain",
        action="store_true",
        help="also what would admit the head of the queue (needs --admin-key-file)",
    )
    st.set_defaults(func=cmd_status)

    get = sub.add_parser("get", help="the scheduler's live settings (needs the admin key)")
    add_gateway_flags(get)
    get.add_argument("--json", action="store_true", help="print them as JSON")
    get.set_defaults(func=cmd_get)

    put = sub.add_parser(
        "set", help="change live settings, all or nothing: key=value ... (needs the admin key)"
    )
    add_gateway_flags(put)
    put.add_argument("changes", nargs="+", metavar="key=value", help=f"one of {', '.join(NAMES)}")
    put.set_defaults(func=cmd_set)

    reload = sub.add_parser(
        "reload-keys",
        help="the gateway reads its --api-keys-file again, as on SIGHUP (needs the admin key)",
    )
    add_gateway_flags(reload)
    reload.set_defaults(func=cmd_reload_keys)

    demo = sub.add_parser("demo", help="the whole stack, a real workload, both KV policies")
    demo.add_argument("--log-dir", default="results/demo-logs")
    demo.set_defaults(func=cmd_demo)

    from llmserve.bench.cli import add_bench_parser

    add_bench_parser(sub)  # llmserve bench serve | sim | calibrate | core
    return parser


def add_gateway_flags(parser: argparse.ArgumentParser) -> None:
    """--target, --api-key and --tls-ca: the same gateway for every subcommand that calls one."""
    parser.add_argument(
        "--target", type=target_arg, default="127.0.0.1:50051", help="the gateway's address"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("LLMSERVE_API_KEY", ""),
        help="sent as `authorization: Bearer KEY` (default: $LLMSERVE_API_KEY)",
    )
    parser.add_argument(
        "--tls-ca", type=ca_file, default="", help="CA certificate (PEM) to reach a TLS gateway"
    )
    parser.add_argument(
        "--admin-key-file",
        default=os.environ.get("LLMSERVE_ADMIN_KEY_FILE", ""),
        help="a file holding the admin key, for set, get, reload-keys and status --explain; "
        "status always sends it: the operator also sees the prefix-cache figures (default: "
        "$LLMSERVE_ADMIN_KEY_FILE)",
    )


def target_arg(text: str) -> str:
    """An argparse type: an address whose port is 1 to 65535 (client.check_target)."""
    try:
        return client.check_target(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def wire_int(name: str) -> Callable[[str], int]:
    """An argparse type: a whole number the request's field `name` can carry (client.INT_RANGES;
    protobuf would refuse any other with a bare "Value out of range")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        problem = client.int_range_problem(name, value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return value

    return parse


def ca_file(text: str) -> str:
    """An argparse type: a readable file holding a PEM certificate ("": no TLS). gRPC would
    report a missing one as a traceback, and a non-PEM one as "empty address list"."""
    if not text:
        return text
    try:
        with open(text, "rb") as f:
            pem = f.read()
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {err.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise argparse.ArgumentTypeError(
            f"{text} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
        )
    return text


class OneLineParser(argparse.ArgumentParser):
    """A usage mistake is one line on stderr (and exit status 2), not the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# what `llmserve demo` and `llmserve bench` need beyond the services (requirements-bench.txt)
BENCH_EXTRA = {"rich", "tqdm", "matplotlib", "transformers", "safetensors", "openai"}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # Ctrl-C (SIGINT) interrupts every command, also one started in the background of a
    # non-interactive shell, which inherits SIGINT ignored (Python then keeps it ignored)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader that left shows here, not as a traceback at exit
    except BrokenPipeError:  # `llmserve status | head -1`: the reader has what it wanted
        # nothing more can reach it: quiet the flush at exit too. 141 = 128 + SIGPIPE, what a
        # shell reports for a C tool that wrote to a closed pipe (`set -o pipefail` sees it)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        code = 130
    except grpc.RpcError as err:
        after_text = "\n" if args.command == "generate" else ""  # ends a streamed line
        print(f"{after_text}error: {err.code().name}: {err.details()}", file=sys.stderr)
        hinted = getattr(err, "hinted", False)  # its details say what to try (a bench's poll)
        if (
            err.code() is grpc.StatusCode.UNIMPLEMENTED
            and getattr(args, "target", None)
            and not hinted
        ):
            print(
                f"(is {args.target} the gateway? The scheduler and the workers do not serve the "
                f"gateway's API: give --target the address `llmserve up` prints as the gateway's)",
                file=sys.stderr,
            )
        code = 1
    except BenchError as err:  # a bad trace or option: its message names it
        print(f"error: llmserve {args.command}: {err}", file=sys.stderr)
        code = 2
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] not in BENCH_EXTRA:
            raise
        print(
            f"error: llmserve {args.command} needs the bench extra ({err.name} is missing): "
            f"pip install 'llmserve[bench]'",
            file=sys.stderr,
        )
        code = 1
    except Exception as err:  # the openai package's (bench serve --backend openai): one line
        openai = sys.modules.get("openai")
        if openai is None or not isinstance(err, openai.OpenAIError):
            raise
        print(f"error: llmserve {args.command}: {type(err).__name__}: {err}", file=sys.stderr)
        code = 1
    sys.exit(code)
