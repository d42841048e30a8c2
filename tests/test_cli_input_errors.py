"""Bad input to `llmserve` is one line on stderr and exit status 2 naming the flag, never a
traceback: integers the wire cannot carry, an unreadable CA file, a bad load or policy list, a rate
of 0, a port outside 1..65535 (gRPC would wrap it), and a --out that cannot be written (refused
before the run, not after it). None of these needs a server: each is refused before any call."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmserve import client
from llmserve.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
LLMSERVE = [sys.executable, "-c", "from llmserve.cli import main; main()"]


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([*LLMSERVE, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def one_line_usage_error(done: subprocess.CompletedProcess, *names: str) -> str:
    """The command failed as a usage error: exit 2, one line on stderr naming every one of
    `names`, no traceback."""
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert done.returncode == 2, (done.returncode, done.stderr)
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def dead_target() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-tokens", "-5"),
        ("--max-tokens", str(2**32)),
        ("--top-k", "-3"),
        ("--seed", "-1"),
        ("--seed", str(2**64)),
        ("--priority", str(2**31)),
    ],
)
def test_generate_refuses_an_integer_the_request_cannot_carry(flag, value) -> None:
    done = run_cli("generate", "--target", dead_target(), "--prompt", "hi", flag, value)
    one_line_usage_error(done, flag, value)


def test_generate_with_a_missing_or_non_pem_tls_ca_is_one_line(tmp_path) -> None:
    missing = tmp_path / "ca.pem"
    done = run_cli(
        "generate", "--target", dead_target(), "--prompt", "hi", "--tls-ca", str(missing)
    )
    one_line_usage_error(done, "--tls-ca", str(missing))
    (tmp_path / "not-pem").write_text("hello\n")
    for command in (["generate", "--prompt", "hi"], ["status"]):
        done = run_cli(*command, "--target", dead_target(), "--tls-ca", str(tmp_path / "not-pem"))
        one_line_usage_error(done, "--tls-ca", "PEM")


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--prompt", "hi"],
        ["status"],
        ["get"],
        ["set", "policy=paged"],
        ["reload-keys"],
        ["bench", "serve", "--baselines", "none"],
    ],
)
@pytest.mark.parametrize("port", ["85136", "99999", "0"])
def test_a_target_port_outside_1_to_65535_is_refused_naming_the_target(command, port) -> None:
    """gRPC wraps it: 127.0.0.1:85136 would reach port 19600."""
    target = f"127.0.0.1:{port}"
    done = run_cli(*command, "--target", target)
    one_line_usage_error(done, "--target", target)


def test_bench_serve_refuses_a_status_target_port_outside_the_range() -> None:
    done = run_cli(
        "bench", "serve", "--target", dead_target(), "--status-target", "[::1]:70000",
        "--baselines", "none",
    )  # fmt: skip
    one_line_usage_error(done, "--status-target", "70000")


def test_check_target_passes_ordinary_addresses_and_names_a_bad_port() -> None:
    for good in ("127.0.0.1:50051", "localhost", "[::1]:443", "::1", "dns:///h:65535", "unix:/x"):
        assert client.check_target(good) == good
    for bad in ("h:65536", "[::1]:99999", "dns:///h:0", "ipv4:1.2.3.4:80,1.2.3.5:70000"):
        with pytest.raises(ValueError, match="outside 1 to 65535"):
            client.check_target(bad)


def test_make_request_names_the_keyword_of_an_integer_out_of_range() -> None:
    for keyword, value in (("max_tokens", -5), ("top_k", -3), ("seed", -1), ("priority", 2**31)):
        with pytest.raises(ValueError, match=f"^{keyword}: {value} is out of range"):
            client.make_request(prompt="hi", **{keyword: value})
    request = client.make_request(prompt="hi", max_tokens=0, seed=2**64 - 1, priority=-(2**31))
    assert request.sampling.seed == 2**64 - 1 and request.priority == -(2**31)


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--loads", "abc"], ["--loads", "abc"]),
        (["--loads", "1,0"], ["--loads", "0"]),
        (["--policies", "bogus+x"], ["--policies", "bogus+x"]),
        (["--policies", "continuous+paged,static+lru"], ["--policies", "static+lru"]),
    ],
)
def test_bench_sim_refuses_a_bad_load_or_policy_list(flags, names, tmp_path) -> None:
    done = run_cli(
        "bench", "sim", "--requests", "5", "--no-progress", "--out", str(tmp_path), *flags
    )
    one_line_usage_error(done, *names)


def test_bench_sim_names_a_bad_prefix_caching_value_in_one_line(tmp_path) -> None:
    done = run_cli(
        "bench", "sim", "--requests", "5", "--no-progress", "--out", str(tmp_path),
        "--prefix-caching", "maybe",
    )  # fmt: skip
    one_line_usage_error(done, "--prefix-caching", "maybe")


@pytest.mark.parametrize("rate", ["0", "-1"])
def test_bench_hash_sample_refuses_a_rate_of_zero_or_less(rate, tmp_path) -> None:
    out = tmp_path / "trace.jsonl"
    done = run_cli("bench", "hash-sample", "--requests", "20", "--rate", rate, "--output", str(out))
    one_line_usage_error(done, "--rate", rate)
    assert not out.exists()


def unwritable(tmp_path: Path) -> Path:
    """A directory that cannot be made, whoever runs the test (root too): a file is in its way."""
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file" / "out"


def test_bench_serve_refuses_an_unwritable_out_before_the_run(tmp_path) -> None:
    """Before: the whole run, then a traceback and the results lost. Nothing listens at the
    target: had the run begun, it would have failed otherwise (the gateway, exit status 1)."""
    out = unwritable(tmp_path)
    done = run_cli(
        "bench", "serve", "--target", dead_target(), "--requests", "2", "--concurrency", "1",
        "--prompt-tokens", "8", "--output-tokens", "4", "--baselines", "none", "--no-progress",
        "--out", str(out),
    )  # fmt: skip
    one_line_usage_error(done, "--out", str(out))


@pytest.mark.parametrize(
    "command",
    [
        ["sim", "--requests", "5", "--policies", "continuous+paged"],
        ["core", "--quick", "--rounds", "1"],
        ["overhead", "--step-ms", "2", "--running", "4", "--workers", "1", "--window", "0.5"],
    ],
)
def test_the_other_benchmarks_refuse_an_unwritable_out_before_the_run(command, tmp_path) -> None:
    out = unwritable(tmp_path)
    done = run_cli("bench", *command, "--no-progress", "--out", str(out))
    one_line_usage_error(done, "--out", str(out))


@pytest.mark.parametrize(
    "flags, name",
    [
        (["--queue-policies", "fcfs,bogus"], "--queue-policies"),
        (["--duration", "0"], "--duration"),
        (["--warmup", "-1"], "--warmup"),
        (["--batch-concurrency", "0"], "--batch-concurrency"),
        (["--chat-output-tokens", "x"], "--chat-output-tokens"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_bench_tenants_refuses_bad_flags_before_it_starts_a_stack(flags, name, tmp_path) -> None:
    # (a bad queue policy was found only by the stack it had started: "INVALID_ARGUMENT", exit 1)
    one_line_usage_error(run_cli("bench", "tenants", *flags, "--out", str(tmp_path)), name)
