"""The package as a user installs it: a wheel built from a checkout without stubs carries them,
and the README's client example runs in a fresh virtual environment against a running stack."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.stacks import running_stack, tiny_settings

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["llmcommon", "llmserve", "gateway", "scheduler_svc", "worker_svc", "protos"]
FILES = ["pyproject.toml", "setup.py", "README.md"]
UNBUILT = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")


def readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- client-example[^>]*-->\n```python\n(.*?)```", readme, re.DOTALL)
    assert block, "README.md has no client example"
    return block.group(1)


def build_wheel(tmp: Path) -> Path:
    """A wheel from a copy of the sources without llmcommon/v1, built with this venv's setuptools
    and grpcio-tools (nothing downloaded)."""
    src = tmp / "src"
    for name in SOURCES:
        shutil.copytree(ROOT / name, src / name, ignore=UNBUILT)
    for name in FILES:
        shutil.copy(ROOT / name, src / name)
    shutil.rmtree(src / "llmcommon" / "v1", ignore_errors=True)  # a fresh checkout has no stubs
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", src],
        check=True, timeout=300,
    )  # fmt: skip
    return next((tmp / "dist").glob("llmserve-*.whl"))


def fresh_venv(tmp: Path, wheel: Path) -> Path:
    """A new venv with the wheel installed; its runtime deps (grpcio, protobuf) come from this
    venv's site-packages through a .pth line, so nothing is downloaded."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "-q", "--python", python, "install", "--no-deps",
         "--no-index", wheel],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "deps_from_dev_venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


@pytest.mark.slow
def test_the_readme_client_example_runs_from_the_wheel_in_a_fresh_venv(tmp_path) -> None:
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "llmcommon/v1/gateway_pb2_grpc.py" in names and "llmserve/client.py" in names
    python = fresh_venv(tmp_path, wheel)
    settings = tiny_settings()
    script = readme_example().replace("127.0.0.1:50051", settings.gateway)
    script = "import llmserve\nprint('from', llmserve.__file__)\n" + script
    with running_stack(settings, tmp_path / "logs"):
        done = subprocess.run(
            [python, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"from {tmp_path / 'venv'}")  # the wheel, not the checkout
    assert re.search(r" (length|stop) \d+$", done.stdout, re.MULTILINE), done.stdout
    assert lines[-1] == "served model: tiny"
