"""The layers (docs/architecture.md): the services and their runtime never import the
application, and the service image carries no benchmark, plotting or test-oracle library."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ("matplotlib", "rich", "transformers", "openai")  # not tqdm: torch.hub loads it if there


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_the_import_contracts_hold() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    declared = len(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    )
    assert declared >= 2 and f"{declared} kept, 0 broken" in done.stdout


def test_starting_a_service_loads_no_benchmark_library() -> None:
    done = run_python(
        "import sys, gateway.__main__, scheduler_svc.__main__, worker_svc.__main__\n"
        f"print(sorted(m for m in {BENCH!r} if m in sys.modules))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_image_installs_only_the_services_requirements() -> None:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    names = {line.split("==")[0] for line in lines if line and not line.startswith("#")}
    assert names and not names & set(BENCH)
    docker = (ROOT / "Dockerfile").read_text().splitlines()
    installs = [line for line in docker if "pip install" in line and "-r " in line]
    assert installs and all("-r requirements.txt" in line for line in installs)


def test_without_the_bench_extra_the_cli_runs_and_says_what_is_missing() -> None:
    blocked = "".join(f"sys.modules[{name!r}] = None\n" for name in BENCH)
    start = f"import sys\n{blocked}from llmserve.cli import main\n"
    demo = run_python(start + "main(['demo', '--log-dir', '/tmp/llmserve-no-extra'])")
    assert demo.returncode == 1
    assert "needs the bench extra" in demo.stderr and "pip install 'llmserve[bench]'" in demo.stderr
    assert "Traceback" not in demo.stderr
    status = run_python(start + "main(['status', '--help'])")
    assert status.returncode == 0 and "--target" in status.stdout
