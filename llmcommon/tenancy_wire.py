"""Tenancy (llmcommon/tenancy.py) to and from the wire's common.Tenancy."""

from __future__ import annotations

from llmcommon.tenancy import DEFAULT_TENANT, Tenancy
from llmcommon.v1 import common_pb2

__all__ = ["tenancy_of", "tenancy_to_wire"]


def tenancy_to_wire(t: Tenancy) -> common_pb2.Tenancy:
    return common_pb2.Tenancy(
        tenant=t.tenant,
        weight=t.weight,
        priority=t.priority,
        slo_class=t.slo_class,
        ttft_s=t.ttft_s,
        tpot_s=t.tpot_s,
    )


def tenancy_of(w: common_pb2.Tenancy) -> Tenancy:
    """As sent; the unset parts are the defaults (the default tenant, weight 1)."""
    return Tenancy(
        tenant=w.tenant or DEFAULT_TENANT,
        weight=w.weight or 1.0,
        priority=w.priority,
        slo_class=w.slo_class,
        ttft_s=w.ttft_s,
        tpot_s=w.tpot_s,
    )
