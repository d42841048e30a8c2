"""The GPU check's carried folder (llmserve.bench.gpu_carry): stubs generated here still import on
a machine whose grpcio or protobuf is older than the generator's, and `bootstrap` installs them
into a tree that has none."""

from __future__ import annotations

import os
import sys
import types
import warnings
from pathlib import Path

import grpc
import pytest
from google.protobuf import runtime_version

from llmserve.bench import gpu_carry
from llmserve.bench.gpu_carry import STUBS, bootstrap, build_carry, portable_source


@pytest.fixture(scope="module")
def carry(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("carry") / "gpu-carry"
    build_carry(dest)
    return dest


def generated(name: str) -> str:
    """A stub as grpcio-tools writes it (the tree's own, from `make stubs`)."""
    return (Path(__file__).resolve().parent.parent / STUBS / name).read_text()


def run_module(text: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(text, name, "exec"), module.__dict__)  # noqa: S102
    return module


def test_a_grpc_stub_made_portable_imports_with_an_older_grpcio(monkeypatch) -> None:
    text = generated("worker_pb2_grpc.py")
    monkeypatch.setattr(grpc, "__version__", "1.60.0")
    with pytest.raises(RuntimeError, match="grpcio>="):
        run_module(text, "as_generated")
    with pytest.warns(UserWarning, match="grpcio>="):
        module = run_module(portable_source(text), "portable")
    assert hasattr(module, "WorkerStub") and hasattr(module, "add_WorkerServicer_to_server")


def test_a_message_module_made_portable_imports_with_an_older_protobuf(monkeypatch) -> None:
    text = generated("common_pb2.py")
    monkeypatch.setattr(runtime_version, "MAJOR", 5)  # the runtime of protobuf 5
    with pytest.raises(runtime_version.VersionError):
        run_module(text, "as_generated")
    with pytest.warns(UserWarning, match="common.proto"):
        module = run_module(portable_source(text), "portable")
    assert module.SamplingParams(max_tokens=3).max_tokens == 3


def test_making_portable_twice_changes_nothing_more() -> None:
    for name in ("common_pb2.py", "worker_pb2_grpc.py"):
        once = portable_source(generated(name))
        assert once != generated(name) and portable_source(once) == once


def test_every_carried_generated_file_is_portable_and_compiles(carry: Path) -> None:
    files = sorted(carry.rglob("*_pb2*.py"))
    names = {f.relative_to(carry).as_posix() for f in files}
    assert {"llmcommon/v1/worker_pb2_grpc.py", "site/grpc_health/v1/health_pb2.py"} <= names
    for file in files:
        text = file.read_text()
        compile(text, str(file), "exec")
        assert "portable (llmserve.bench.gpu_carry)" in text or "Validate" not in text, file
        assert text.count("try:  # portable") <= 1, file


def test_bootstrap_installs_the_carried_stubs_into_a_tree_without_them(
    carry: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        told = bootstrap(carry, root=tmp_path)
    assert told.startswith("carried")
    assert (tmp_path / STUBS / "scheduler_pb2_grpc.py").read_text() == (
        carry / STUBS / "scheduler_pb2_grpc.py"
    ).read_text()
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [
        str(tmp_path), str(carry / "site"), "/elsewhere"
    ]  # fmt: skip
    assert bootstrap(carry, root=tmp_path).startswith("the tree's own")


def test_help_prints_usage_and_builds_nothing(tmp_path: Path, monkeypatch, capsys) -> None:
    """`--help` is an answer, not a folder named `--help` (it had built one in the cwd)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        gpu_carry.main(["--help"])
    assert stop.value.code == 0
    assert "usage:" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
