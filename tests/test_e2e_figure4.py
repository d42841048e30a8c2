"""The seed's Figure 4 through three real processes (capacity 24, block size 1), seen in
`llmserve status`: under `reserve` C waits with kv_reserved while the written KV is far below
capacity; under `paged` it is admitted at once."""

from __future__ import annotations

import json
import threading
import time

import pytest

from gateway.tokenizer import load_default_tokenizer
from llmserve import client
from llmserve.cli import main as llmserve
from tests.stacks import running_stack, tiny_settings

PROMPT = " a b c d e f"  # six tokens in SmolLM2's vocabulary


def send(target: str, max_tokens: int, results: dict, key: str) -> None:
    request = client.make_request(
        prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
    )
    results[key] = list(client.stream(target, request, timeout=60))


def status_cli(target: str, capsys, *flags: str) -> str:
    with pytest.raises(SystemExit) as done:
        llmserve(["status", "--target", target, *flags])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["reserve", "paged"])
def test_figure4_through_real_processes(policy: str, tmp_path, capsys) -> None:
    assert len(load_default_tokenizer().encode(PROMPT)) == 6
    # under reserve, C must arrive while B decodes: the simulated model, each step at least
    # 100 ms, keeps B (15 executions) 1.5 s or more on any host; the real model may run it in
    # 50 ms on a fast one. Under paged C is admitted at once either way: the real model.
    model = {"reserve": "sim", "paged": "smollm2"}[policy]
    settings = tiny_settings(
        model=model,
        sim_step_ms=100.0,
        dtype="bf16",
        kv_capacity=24,
        block_size=1,
        token_budget=8,
        policy=policy,
    )
    with running_stack(settings, tmp_path):
        results: dict = {}
        b = threading.Thread(target=send, args=(settings.gateway, 14, results, "B"))
        b.start()  # B: 6 + 14 = 20 positions, reserved in full under `reserve`
        deadline = time.monotonic() + 30
        while client.status(settings.scheduler).running == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        c = threading.Thread(target=send, args=(settings.gateway, 6, results, "C"))
        c.start()
        seen = []
        while c.is_alive() and time.monotonic() < deadline:
            seen.append(json.loads(status_cli(settings.gateway, capsys, "--json")))
        b.join(30)
        c.join(30)
        final = json.loads(status_cli(settings.gateway, capsys, "--json"))
        text = status_cli(settings.gateway, capsys)
    assert [results[k][-1].final.usage.completion_tokens for k in ("B", "C")] == [14, 6]
    waited = [s for s in seen if s["head_wait_reason"] == "kv_reserved"]
    if policy == "reserve":
        assert waited, "C never waited for kv_reserved under reserve"
        kv = waited[0]["workers"][0]
        assert kv["capacity"] == 24 and kv["written"] + 6 <= 24  # C's data would fit ...
        assert kv["free"] < 6 <= kv["free"] + kv["reserved_unwritten"]  # ... but B holds it
        assert final["stalls"]["kv_reserved"] > 0
        assert "kv_reserved" in text
    else:
        assert not waited and "kv_reserved" not in final["stalls"]
    kv = final["workers"][0]
    assert (kv["written"], kv["reserved_unwritten"], kv["free"]) == (0, 0, 24)
    served = {"sim": "sim", "smollm2": "SmolLM2-135M-Instruct"}[model]
    assert final["model"] == served  # the file's name, not GGUF's general.name
