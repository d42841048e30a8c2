"""What the GPU check carries to a machine that has no registry, no internet and no project venv
(docs/gpu.md): one folder, `build/gpu-carry` (`make gpu-carry`), holding

- `llmcommon/v1/`: the gRPC stubs generated here from protos/, made portable (the generated
  version checks warn instead of refusing a machine's older grpcio or protobuf);
- `site/`: the pure-Python packages the services import that such a machine lacks
  (grpcio-health-checking, grpcio-reflection), their generated files made portable the same way;
- `MANIFEST.json`: what is there, what generated it, and its size.

`bootstrap` (standard library only: it runs before anything else is importable) puts the folder
on the path of the check and of every process it starts, and installs the stubs into the tree
when the tree has none. This module imports nothing outside the standard library."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CARRY = ROOT / "build" / "gpu-carry"
STUBS = Path("llmcommon") / "v1"
LIMIT_BYTES = 64 * 2**20  # what the device machine's copy takes in all: the tree and the carry
# the services' pure-Python imports missing from the GPU machine (distribution: packages)
CARRIED_DISTRIBUTIONS = {
    "grpcio-health-checking": ("grpc_health",),
    "grpcio-reflection": ("grpc_reflection",),
}

_PB2_CHECK = re.compile(
    r"from google\.protobuf import runtime_version as _runtime_version\n(?P<rest>.*?)"
    r"_runtime_version\.ValidateProtobufRuntimeVersion\((?P<args>[^)]*)\)\n",
    re.DOTALL,
)
PORTABLE_MARK = "# portable (llmserve.bench.gpu_carry)"
_PB2_PORTABLE = (
    f"try:  {PORTABLE_MARK}: an older protobuf warns, it is not refused\n"
    "    from google.protobuf import runtime_version as _runtime_version\n"
    "    _runtime_version.ValidateProtobufRuntimeVersion({args})\n"
    "except Exception as _version_error:  # ImportError before protobuf 5.26, else VersionError\n"
    "    import warnings as _warnings\n"
    "    _warnings.warn(f'{{__name__}}: {{_version_error}}', stacklevel=1)\n"
)
_GRPC_CHECK = "if _version_not_supported:\n    raise RuntimeError("
_GRPC_PORTABLE = f"if _version_not_supported:  {PORTABLE_MARK}: a warning\n    warnings.warn("


def portable_source(text: str) -> str:
    """A generated *_pb2.py or *_pb2_grpc.py whose version check warns instead of raising (a
    file already made portable is returned as it is)."""
    if PORTABLE_MARK in text:
        return text
    match = _PB2_CHECK.search(text)
    if match:
        block = match.group("rest") + _PB2_PORTABLE.format(args=match.group("args").strip())
        text = text[: match.start()] + block + text[match.end() :]
    if _GRPC_CHECK in text:
        if "import warnings" not in text:
            text = text.replace("import grpc\n", "import grpc\nimport warnings\n", 1)
        text = text.replace(_GRPC_CHECK, _GRPC_PORTABLE)
    return text


def make_portable(folder: Path) -> int:
    """Rewrite every generated file under folder; the number rewritten."""
    changed = 0
    for path in sorted(folder.rglob("*_pb2*.py")):
        text = path.read_text()
        new = portable_source(text)
        if new != text:
            path.write_text(new)
            changed += 1
    return changed


def generate_stubs(dest: Path) -> None:
    """protoc (grpcio-tools, where it is installed) from protos/ into dest/llmcommon/v1."""
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}",
         f"--python_out={dest}", f"--grpc_python_out={dest}", *protos],
        check=True, cwd=ROOT / "protos",
    )  # fmt: skip
    (dest / STUBS / "__init__.py").touch()
    make_portable(dest / STUBS)


def copy_distribution(distribution: str, packages: tuple[str, ...], site: Path) -> str:
    """The installed packages of a distribution, as files (no caches); its version."""
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"{package} ({distribution}) is not installed here: make setup")
        source = Path(next(iter(spec.submodule_search_locations)))
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyi")
        shutil.copytree(source, site / package, ignore=ignore, dirs_exist_ok=True)
        make_portable(site / package)
    return importlib.metadata.version(distribution)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def build_carry(dest: Path = CARRY) -> dict:
    """dest built afresh; its manifest."""
    with tempfile.TemporaryDirectory(dir=dest.parent if dest.parent.is_dir() else None) as tmp:
        staged = Path(tmp) / "carry"
        generate_stubs(staged)
        versions = {
            name: copy_distribution(name, packages, staged / "site")
            for name, packages in CARRIED_DISTRIBUTIONS.items()
        }
        manifest = {
            "stubs": str(STUBS),
            "generated_with": {
                "grpcio-tools": importlib.metadata.version("grpcio-tools"),
                "protobuf": importlib.metadata.version("protobuf"),
            },
            "site": versions,
            "bytes": folder_bytes(staged),
        }
        (staged / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staged), dest)
    return manifest


def tree_files(root: Path = ROOT) -> list[Path]:
    """What the device tool copies of the tree: tracked files and untracked ones git does not
    ignore (as `git ls-files` lists them)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout  # fmt: skip
    paths = [root / name for name in listed.decode().split("\0") if name]
    return [p for p in paths if p.is_file()]


def tree_bytes(root: Path = ROOT) -> int:
    return sum(p.stat().st_size for p in tree_files(root))


# ---------------------------------------------------------------------------- on the machine


def bootstrap(carry: Path = CARRY, root: Path = ROOT) -> str:
    """The check's own path and its children's: the tree, then the carried site. Installs the
    carried stubs into the tree when it has none; without a carry, generates them where
    grpcio-tools is installed. Says where the stubs came from; SystemExit when there are none."""
    paths = [str(root), str(carry / "site")]
    sys.path[:0] = [p for p in paths if p not in sys.path]
    inherited = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + ([inherited] if inherited else []))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched, not even a config
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    stubs = root / STUBS
    if (stubs / "__init__.py").is_file():
        return f"the tree's own {STUBS}"
    if (carry / STUBS / "__init__.py").is_file():
        shutil.copytree(carry / STUBS, stubs, dirs_exist_ok=True)
        return f"carried ({carry / STUBS})"
    if importlib.util.find_spec("grpc_tools") is not None:
        generate_stubs(root)
        return "generated here with grpcio-tools"
    raise SystemExit(
        f"no gRPC stubs: {stubs} is missing, nothing is carried at {carry} and grpcio-tools is "
        "not installed; run `make gpu-carry` where the venv is and carry build/gpu-carry"
    )


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(
        prog="python -m llmserve.bench.gpu_carry",
        description="Build the folder a GPU check carries to a bare machine (docs/gpu.md).",
    )
    parser.add_argument(
        "dest", nargs="?", type=Path, default=CARRY, help=f"where to build it (default {CARRY})"
    )
    dest = parser.parse_args(argv).dest
    manifest = build_carry(dest.resolve())
    tree = tree_bytes()
    total = tree + manifest["bytes"]
    print(
        f"{dest}: {manifest['bytes'] / 2**20:.2f} MiB carried + {tree / 2**20:.2f} MiB of tree = "
        f"{total / 2**20:.2f} MiB of the {LIMIT_BYTES / 2**20:.0f} MiB a device run copies"
    )
    return 0 if total < LIMIT_BYTES else 1


if __name__ == "__main__":
    raise SystemExit(main())
