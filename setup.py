"""Building the package generates the gRPC stubs (protos/ -> llmcommon/v1), so a wheel or
`pip install .` brings a working `llmserve.client`; the stubs are never committed."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTOS = ROOT / "protos"


def generate_stubs(out: Path) -> None:
    """protoc over protos/llmcommon/v1/*.proto into out/llmcommon/v1 (as `make stubs`)."""
    from importlib.resources import files

    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "llmcommon/v1").glob("*.proto"))
    (out / "llmcommon/v1").mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"-I{files('grpc_tools') / '_proto'}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    (out / "llmcommon/v1/__init__.py").touch()


class BuildWithStubs(build_py):
    def run(self) -> None:
        # an editable install imports from the source tree; a wheel from build_lib
        generate_stubs(ROOT if self.editable_mode else Path(self.build_lib))
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
