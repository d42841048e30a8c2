"""The Admin service of the scheduler: the live settings and the head's explanation, protobuf
in and out around the pure parts (scheduler_svc/live_settings.py, scheduler_svc/explain.py).

The admin key is checked before a handler runs (llmcommon/admin_auth.py). Every change
is logged with who made it (the peer, the gateway's client when forwarded, the key's id) and
what changed; the core counts it per setting (`Scheduler.setting_changes`, the metrics'
`llmserve_scheduler_setting_changes_total`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from llmcommon.admin_auth import FORWARDED_FOR, admin_key_of, admin_refusal, key_id
from llmcommon.errors import bounded
from llmcommon.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.core import Scheduler
from scheduler_svc.explain import Explanation, copy_of, explain_copy
from scheduler_svc.kv_rows import add_row
from scheduler_svc.live_settings import SettingError, apply, changed, changes_of, current
from scheduler_svc.order_view import OrderView, Standing, order_view

log = logging.getLogger("scheduler")


class AdminService(scheduler_pb2_grpc.AdminServicer):
    def __init__(self, core: Scheduler, wake_all: Callable[[], None], key: str = "") -> None:
        self.core = core
        self.wake_all = wake_all  # a change may admit the head: every loop plans again
        self.key = key  # the admin key (AdminKeyInterceptor checks the Admin calls with it)

    async def GetSettings(self, request, context):
        return scheduler_pb2.Settings(settings=settings_message(self.core))

    async def SetSettings(self, request, context):
        old = self.core.config
        try:
            new = apply(old, changes_of((c.name, c.value) for c in request.changes))
            self.core.reconfigure(new)
        except (SettingError, ValueError) as err:  # nothing has changed
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(str(err)))
        diff = changed(old, new)
        if diff:
            log.warning(
                "settings changed by %s: %s",
                who(context),
                ", ".join(f"{name} {a} -> {b}" for name, (a, b) in diff.items()),
            )
            self.wake_all()
        reply = scheduler_pb2.SetSettingsReply(
            settings=settings_message(self.core), steps=self.core.steps
        )
        reply.stalls.update(self.core.stalls)
        for name, (a, b) in diff.items():
            reply.changed.add(name=name, old_value=a, new_value=b)
        return reply

    async def Explain(self, request, context):
        return await explanation(self.core)

    async def explain_into(self, reply: scheduler_pb2.StatusReply, context) -> None:
        """A Status that asks for the explanation gets it with the admin key; without one it
        is told the explanation was withheld (it names other clients' requests); with a wrong
        one (or where no admin key is set) it is refused PERMISSION_DENIED, as `get` and `set`
        are: an operator who sent a key learns it is wrong."""
        refusal = admin_refusal(self.key, context.invocation_metadata())
        if refusal is None:
            reply.explanation.CopyFrom(await explanation(self.core))
        elif refusal[0] is grpc.StatusCode.PERMISSION_DENIED:
            await context.abort(*refusal)
        else:
            reply.explanation_withheld = True


def settings_message(core: Scheduler) -> list[scheduler_pb2.Setting]:
    return [scheduler_pb2.Setting(name=k, value=v) for k, v in current(core.config).items()]


def who(context) -> str:
    """The caller as a log names it: peer, forwarded client, admin key id."""
    metadata = context.invocation_metadata() or ()
    forwarded = next((v for k, v in metadata if k == FORWARDED_FOR), "")
    key = admin_key_of(metadata)
    via = f" for {forwarded}" if forwarded else ""
    return f"{context.peer()}{via} (admin key {key_id(key) if key else 'none'})"


async def explanation(core: Scheduler) -> scheduler_pb2.HeadExplanation:
    """The head's explanation: the core copied here, on its loop; the counterfactuals' planning
    passes on that copy in a thread, so the step loops go on meanwhile."""
    if not core.waiting:
        return scheduler_pb2.HeadExplanation()
    base, order = copy_of(core), order_view(core.waiting, core.clock())
    msg = explanation_message(await asyncio.to_thread(explain_copy, base, core.clock()))
    if order is not None:
        add_order(msg, order)
    return msg


def add_order(msg: scheduler_pb2.HeadExplanation, order: OrderView) -> None:
    """The queue's ordering into the explanation: the head's standing, the oldest's, and who
    is ahead of the oldest."""
    msg.queue_policy = order.policy

    def fill(into: scheduler_pb2.QueueStanding, s: Standing) -> None:
        into.request_id, into.wait_s = s.request_id, s.wait_s
        into.standing.update(s.standing)

    fill(msg.head_standing, order.head)
    if order.oldest is not None:
        fill(msg.oldest, order.oldest)
    for s in order.ahead:
        fill(msg.ahead.add(), s)


def explanation_message(why: Explanation) -> scheduler_pb2.HeadExplanation:
    msg = scheduler_pb2.HeadExplanation(
        request_id=why.request_id,
        wait_s=why.wait_seconds,
        reason=why.reason,
        worker=why.worker,
        tokens=why.tokens,
        budget_left=-1 if why.budget_left is None else why.budget_left,
        positions=why.positions,
        blocks=why.blocks,
        running=why.running,
        max_running=why.max_running,
        policy=why.policy,
        other_policy=why.other_policy,
        admitted_under_other_policy=why.admitted_under_other_policy,
        token_budget=why.token_budget or 0,
        running_limit=why.running_limit or 0,
        after_request_id=why.after.request_id if why.after else "",
        after_steps=why.after.steps if why.after else 0,
        step_time_budget_ms=why.step_time_budget_ms,
        step_predicted_ms=-1.0 if why.step_predicted_ms is None else why.step_predicted_ms,
        time_budget_ms=why.time_budget_ms or 0.0,
        step_limit_ms=-1.0 if why.step_limit_ms is None else why.step_limit_ms,
        step_time_window=why.step_time_window,
    )
    for room in why.workers:
        add_row(msg.workers, room)  # its holders too, largest first
    return msg
