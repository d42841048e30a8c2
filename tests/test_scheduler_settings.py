"""The scheduler's worker entries: fixed addresses, dns: names, or none (registration only);
its flags as the core and `llmserve up` take them."""

from __future__ import annotations

import argparse

import pytest

from llmcommon.flags import add_flags, from_args
from llmserve.stack import Stack, StackSettings
from scheduler_svc.settings import SchedulerSettings


def test_worker_entries_split_into_fixed_addresses_and_dns_names() -> None:
    s = SchedulerSettings(workers="10.0.0.1:50061, dns:workers.llm.svc:50061,127.0.0.1:7")
    assert s.worker_targets == ["10.0.0.1:50061", "127.0.0.1:7"]
    assert s.dns_names == [("workers.llm.svc", 50061)]


def test_no_worker_entries_means_workers_register_themselves() -> None:
    s = SchedulerSettings(workers="")
    assert s.worker_targets == [] and s.dns_names == []


@pytest.mark.parametrize("entry", ["dns:workers", "dns::50061", "dns:workers:port"])
def test_a_dns_entry_needs_a_name_and_a_port(entry) -> None:
    with pytest.raises(ValueError, match="dns:NAME:PORT"):
        SchedulerSettings(workers=entry)


def test_a_negative_stream_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="stream-interval"):
        SchedulerSettings(stream_interval_ms=-1)


def test_prefix_caching_is_on_by_default_and_off_by_flag_for_the_core_and_up() -> None:
    parser = add_flags(argparse.ArgumentParser(), SchedulerSettings)
    assert from_args(SchedulerSettings, parser.parse_args([])).core().prefix_caching
    off = from_args(SchedulerSettings, parser.parse_args(["--no-prefix-caching"]))
    assert off.core().prefix_caching is False
    scheduler = Stack(StackSettings(prefix_caching=False), None).commands()["scheduler"]
    assert "--no-prefix-caching" in scheduler
    assert "--prefix-caching" in Stack(StackSettings(), None).commands()["scheduler"]
