"""Settings as flags: one flag per field with the field's own help, the same setting from an
environment variable (flag > environment > default), and a settings object turned back into the
flags that give a process the same settings (how `llmserve up` starts the services)."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from gateway.settings import GatewaySettings
from llmcommon.flags import add_flags, from_args, to_flags
from scheduler_svc.config import CoreConfig, KvPolicy
from scheduler_svc.settings import ENV_PREFIX as SCHEDULER_ENV
from scheduler_svc.settings import SchedulerSettings
from worker_svc.settings import ENV_PREFIX as WORKER_ENV
from worker_svc.settings import WorkerSettings


def parse(cls, argv, env_prefix=""):
    return from_args(
        cls, add_flags(argparse.ArgumentParser(), cls, env_prefix=env_prefix).parse_args(argv)
    )


@pytest.mark.parametrize("cls", [SchedulerSettings, WorkerSettings, GatewaySettings])
def test_every_field_has_help_text_of_its_own(cls) -> None:
    missing = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("help")]
    assert not missing


def test_the_scheduler_takes_the_cores_settings_from_the_core_itself() -> None:
    core_fields = [f.name for f in dataclasses.fields(CoreConfig)]
    own = [f.name for f in dataclasses.fields(SchedulerSettings)]
    assert own[: len(core_fields)] == core_fields
    settings = parse(SchedulerSettings, ["--policy", "reserve", "--token-budget", "8"])
    assert settings.core() == CoreConfig(token_budget=8, policy=KvPolicy.RESERVE)


def test_the_environment_sets_a_default_and_a_flag_wins(monkeypatch) -> None:
    monkeypatch.setenv(SCHEDULER_ENV + "TOKEN_BUDGET", "512")
    monkeypatch.setenv(SCHEDULER_ENV + "PREFIX_CACHING", "off")
    monkeypatch.setenv(SCHEDULER_ENV + "POLICY", "reserve")
    from_env = parse(SchedulerSettings, [], SCHEDULER_ENV)
    assert (from_env.token_budget, from_env.prefix_caching, from_env.policy) == (
        512,
        False,
        KvPolicy.RESERVE,
    )
    flagged = parse(SchedulerSettings, ["--token-budget", "64", "--prefix-caching"], SCHEDULER_ENV)
    assert (flagged.token_budget, flagged.prefix_caching) == (64, True)
    assert parse(SchedulerSettings, []).token_budget == 256  # no prefix: no environment


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("LLMSERVE_WORKER_BLOCK_SIZE", "sixteen", "'sixteen' is not a valid int"),
        ("LLMSERVE_WORKER_CUDA_GRAPHS", "maybe", "'maybe' is not a boolean"),
        ("LLMSERVE_WORKER_DTYPE", "fp8", "'fp8' is not one of bf16, fp32"),
    ],
)
def test_a_bad_environment_value_is_one_line_naming_the_variable(variable, value, message) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "worker_svc"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", variable: value},
    )
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"worker_svc: error: ${variable}: {message}")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "settings",
    [
        SchedulerSettings(
            policy="reserve", prefix_caching=False, workers="a:1,b:2", hang_floor=2.5
        ),
        WorkerSettings(dtype="fp32", kv_capacity=64, block_size=4, cuda_graphs=False, name="w"),
        GatewaySettings(model="tiny", http_port=8000, max_messages=3, resubmit_timeout=1.5),
    ],
)
def test_settings_turned_into_flags_give_the_same_settings(settings) -> None:
    cls = type(settings)
    assert parse(cls, to_flags(settings)) == settings


def test_the_help_of_a_flag_is_its_fields_text_with_default_and_variable() -> None:
    parser = add_flags(argparse.ArgumentParser(), WorkerSettings, env_prefix=WORKER_ENV)
    text = " ".join(parser.format_help().split())
    assert "positions per KV block (default: 16; env LLMSERVE_WORKER_BLOCK_SIZE)" in text


@pytest.mark.parametrize("cls", [SchedulerSettings, WorkerSettings, GatewaySettings])
def test_no_float_setting_takes_nan_from_a_flag_or_the_environment(cls, monkeypatch) -> None:
    """NaN passes every `>= 0` check (a NaN step-time budget crashed the step loop)."""
    floats = [f.name for f in dataclasses.fields(cls) if f.type in (float, "float")]
    assert floats
    parser = add_flags(argparse.ArgumentParser(), cls)
    for name in floats:
        with pytest.raises(SystemExit):
            parser.parse_args([f"--{name.replace('_', '-')}", "nan"])
    assert parse(cls, [f"--{floats[0].replace('_', '-')}", "0.5"])  # numbers still pass
    prefix = {SchedulerSettings: SCHEDULER_ENV, WorkerSettings: WORKER_ENV}.get(cls)
    if prefix:
        monkeypatch.setenv(prefix + floats[0].upper(), "NaN")
        with pytest.raises(SystemExit):
            parse(cls, [], prefix)
