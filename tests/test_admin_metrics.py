"""A live change shows on /metrics: counted per setting, the info metric and gauges current."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from scheduler_svc.config import CoreConfig, KvPolicy, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.metrics import SchedulerMetrics


def test_a_change_is_counted_per_setting_and_the_current_values_are_exported() -> None:
    core = Scheduler(CoreConfig(policy=KvPolicy.RESERVE), [WorkerSpec("w0", 8, 1, 64)])
    metrics = SchedulerMetrics()
    metrics.attach(SimpleNamespace(core=core, on_step=None, on_join=None))
    value = metrics.registry.get_sample_value
    changes = "llmserve_scheduler_setting_changes_total"
    assert value(changes, {"setting": "policy"}) == 0
    core.reconfigure(dataclasses.replace(core.config, policy=KvPolicy.PAGED, token_budget=64))
    core.reconfigure(dataclasses.replace(core.config, policy=KvPolicy.RESERVE))
    assert value(changes, {"setting": "policy"}) == 2
    assert value(changes, {"setting": "token_budget"}) == 1
    assert value(changes, {"setting": "max_running"}) == 0
    assert value("llmserve_scheduler_token_budget") == 64
    info = {"policy": "reserve", "mode": "continuous", "chunked_prefill": "true"}
    assert value("llmserve_scheduler_info", info | {"prefix_caching": "false"}) == 1
