"""The demo's live-settings part as data (the demo prints it, a stack test checks it): the seed's
Figure 4 under `reserve` on a real stack, the head's explanation asked while C waits, then
`policy=paged` set live, and the step at which C joins, with the stall counts before and
after."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from llmserve import client
from llmserve.client import status_dict
from llmserve.stack import Stack, StackSettings

PROMPT = " a b c d e f"  # six tokens
KEY = "demo-admin-key"
SIM_STEP_MS = 300.0  # B's 14 steps: 4 s to ask and change while C waits


@dataclass
class LiveSwitch:
    explanation: dict  # while C waits under reserve
    waiting_status: dict  # `llmserve status` then
    changed: dict[str, tuple[str, str]]
    steps_to_admit: int  # steps the scheduler ran from the change until C was seen admitted
    stalls_before: dict[str, int]  # at the change (read by the scheduler as it applied it)
    stalls_after: dict[str, int]  # at the end
    outputs: list[int]  # tokens B and C got


def figure4_settings(base: StackSettings, key_file: Path) -> StackSettings:
    """Figure 4's numbers on simulated steps slow enough to ask and change while C waits (the
    seed's order: no overlap)."""
    return replace(
        base,
        model="sim",
        sim_step_ms=SIM_STEP_MS,
        policy="reserve",
        kv_capacity=24,
        block_size=1,
        token_budget=8,
        overlap=False,
        admin_key_file=str(key_file),
    )


def figure4_switch(base: StackSettings, log_dir: Path) -> LiveSwitch:
    log_dir.mkdir(parents=True, exist_ok=True)
    key_file = log_dir / "admin.key"
    key_file.write_text(KEY + "\n")
    settings = figure4_settings(base, key_file)
    with Stack(settings, log_dir) as stack:
        gateway = stack.settings.gateway
        status = lambda: status_dict(client.status(stack.settings.scheduler))  # noqa: E731
        got: dict[str, int] = {}
        b = start(gateway, 14, got, "B")
        wait(lambda: status()["running"] == 1)
        c = start(gateway, 6, got, "C")
        waiting = wait(lambda: (s := status())["head_wait_reason"] == "kv_reserved" and s)
        with client.Client(gateway, admin_key=KEY, timeout=30) as admin:
            why = admin.explain()
            change = admin.change_settings({"policy": "paged"})
        admitted = wait(lambda: (s := status())["admitted"] == 2 and s)
        b.join(60)
        c.join(60)
        after = status()
    return LiveSwitch(
        explanation=why or {},
        waiting_status=waiting,
        changed=change.changed,
        steps_to_admit=admitted["steps"] - change.steps,
        stalls_before=change.stalls,
        stalls_after=after["stalls"],
        outputs=[got.get("B", 0), got.get("C", 0)],
    )


def start(target: str, max_tokens: int, got: dict[str, int], name: str) -> threading.Thread:
    request = client.make_request(
        prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
    )

    def run() -> None:
        for message in client.stream(target, request, timeout=120):
            got[name] = got.get(name, 0) + len(message.delta.token_ids)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait(predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError("the demo's stack did not get there")
        time.sleep(0.005)
    return value
