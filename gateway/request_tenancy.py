"""A request's standing in the queue (llmcommon/tenancy.py Tenancy), from the API key that sent
it and the priority and SLO class it asks for: checked at the gateway's door, before anything is
queued. Pure: no grpc."""

from __future__ import annotations

from collections.abc import Mapping

from gateway.api_keys import KeyEntry
from gateway.validation import InvalidRequest
from llmcommon.tenancy import SloClass, Tenancy, priority_problem

__all__ = ["tenancy_for"]


def tenancy_for(
    entry: KeyEntry, priority: object, slo_class: str, classes: Mapping[str, SloClass]
) -> Tenancy:
    """The tenancy of a request of `entry`'s key asking for `priority` (None: the key's
    default) and `slo_class` ("": the key's default); InvalidRequest naming the field."""
    if priority is None:
        priority = entry.priority
    problem = priority_problem(priority, entry.top_priority)
    if problem is not None:
        raise InvalidRequest(problem, "priority")
    name = slo_class or entry.slo_class
    chosen = classes.get(name) if name else None
    if name and chosen is None:
        known = ", ".join(classes) if classes else "none (the gateway has no --slo-classes)"
        message = f"slo_class {name!r} is not a class of this gateway: {known}"
        raise InvalidRequest(message, "slo_class")
    assert isinstance(priority, int)
    return Tenancy(
        tenant=entry.tenant,
        weight=entry.weight,
        priority=priority,
        slo_class=name,
        ttft_s=chosen.ttft_s if chosen else 0.0,
        tpot_s=chosen.tpot_s if chosen else 0.0,
    )
