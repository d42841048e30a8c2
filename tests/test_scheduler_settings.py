"""The scheduler's worker entries: fixed addresses, dns: names, or none (registration only)."""

from __future__ import annotations

import pytest

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
