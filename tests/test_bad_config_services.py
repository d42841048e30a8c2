"""A service started with a bad configuration (a TLS file it cannot use, a port another process
holds, a worker with another internal token) exits at once with one line saying what is wrong:
no traceback, and no message that blames something else (gRPC reports an unusable certificate
as a port it cannot bind)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from llmserve.ports import free_port

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def held_port():
    """A loopback port this test listens on until the block ends."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def start(module: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", module, *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)


def assert_one_clean_line(done: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 1 or 2; the last line of stderr names `words`; no traceback anywhere."""
    assert done.returncode in (1, 2), done.stderr
    assert "Traceback" not in done.stderr and "never retrieved" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    for word in words:
        assert word in line, done.stderr
    return line


def make_pair(where: Path, name: str) -> tuple[str, str]:
    """A self-signed certificate and its key, PEM files under `where`."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = str(where / f"{name}-cert.pem"), str(where / f"{name}-key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out",
         cert, "-days", "1", "-subj", "/CN=localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def gateway(cert: str, key: str) -> subprocess.CompletedProcess:
    """A gateway with these TLS files and no scheduler: it must stop before asking one."""
    port, scheduler = free_port(), free_port()
    args = ["--port", str(port), "--scheduler", f"127.0.0.1:{scheduler}"]
    return start("gateway", *args, "--tls-cert", cert, "--tls-key", key)


@pytest.mark.parametrize("missing", ["--tls-cert", "--tls-key"])
def test_a_missing_tls_file_is_named_with_its_flag(missing, tmp_path) -> None:
    cert, key = make_pair(tmp_path, "a")
    files = {"--tls-cert": cert, "--tls-key": key} | {missing: str(tmp_path / "nope.pem")}
    done = gateway(files["--tls-cert"], files["--tls-key"])
    assert_one_clean_line(done, missing, str(tmp_path / "nope.pem"))


@pytest.mark.parametrize("case", ["garbage", "mismatch", "swapped"])
def test_an_unusable_certificate_or_key_is_named_not_the_port(case, tmp_path) -> None:
    cert, key = make_pair(tmp_path, "a")
    other_cert, other_key = make_pair(tmp_path, "b")
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    cert, key, blamed = {
        "garbage": (str(tmp_path / "garbage.pem"), key, "--tls-cert"),
        "mismatch": (cert, other_key, "--tls-key"),
        "swapped": (key, cert, "--tls-cert"),
    }[case]
    line = assert_one_clean_line(gateway(cert, key), blamed)
    assert "bind" not in line and "cannot listen" not in line


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, flag",
    [
        ("gateway", "--port"),
        ("scheduler_svc", "--port"),
        ("worker_svc", "--port"),
        ("worker_svc", "--metrics-port"),
    ],
)
def test_a_port_in_use_is_one_line_naming_the_address(module, flag) -> None:
    extra = {"worker_svc": ["--model", "sim"], "scheduler_svc": ["--workers", "127.0.0.1:1"]}
    with held_port() as port:
        grpc_port = [] if flag == "--port" else ["--port", str(free_port())]
        done = start(module, flag, str(port), *grpc_port, *extra.get(module, []))
    assert_one_clean_line(done, f"cannot listen on 127.0.0.1:{port}", "in use")
    assert done.returncode == 1


@contextmanager
def worker(port: int, token_file: Path, log: Path):
    """A simulated worker with this internal token, until the block ends."""
    args = ["--model", "sim", "--port", str(port), "--internal-token-file", str(token_file)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker_svc", *args], cwd=ROOT, stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 30
        while "serving on" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.slow
def test_a_worker_with_another_token_among_two_stops_the_scheduler_cleanly(tmp_path) -> None:
    right, wrong = tmp_path / "right", tmp_path / "wrong"
    right.write_text("right-token-0123456789\n")
    wrong.write_text("wrong-token-0123456789\n")
    with held_port() as a_port, held_port() as b_port:
        pass  # two distinct free ports
    with (
        worker(a_port, right, tmp_path / "a.log") as good,
        worker(b_port, wrong, tmp_path / "b.log") as bad,
    ):
        workers = f"--workers={good},{bad}"
        args = ["--port", str(free_port()), workers, "--internal-token-file", str(right)]
        done = start("scheduler_svc", *args)
    assert_one_clean_line(done, f"worker {bad}", "internal token")
    assert done.returncode == 1
