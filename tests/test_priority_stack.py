"""Priority through real processes (tiny model): a high-priority request arriving while two
low-priority ones fill the running limit preempts one of them and is served; the preempted one's
stream goes on with no gap and no token twice (its tokens are those it gets running alone)."""

from __future__ import annotations

import threading

from llmserve import client
from tests.stack_checks import wait_for
from tests.stacks import running_stack, tiny_settings

KEYS = "key-low low\nkey-high high top_priority=-5\n"
PROMPTS = ["The first low request says", "A second low one goes on about"]
LONG = 1500  # tokens: far more than the test waits for; the lows are cancelled at the end


def stream_tokens(target: str, key: str, prompt: str, max_tokens: int, out: list, **extra):
    request = client.make_request(prompt=prompt, max_tokens=max_tokens, temperature=0.0)
    request.sampling.ignore_eos = True
    for name, value in extra.items():
        setattr(request, name, value)
    try:
        for message in client.stream(target, request, api_key=key):
            if message.HasField("delta"):
                out.extend(message.delta.token_ids)
    except Exception as err:  # a cancelled stream ends here; the test reads what came
        out.append(repr(err))


def test_a_higher_priority_request_preempts_and_the_preempted_stream_loses_nothing(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    settings = tiny_settings(
        api_keys_file=str(keys), queue_policy="priority", max_running=2, kv_capacity=8192
    )
    with running_stack(settings, tmp_path / "logs") as stack:
        target = stack.settings.gateway
        lows: list[list] = [[], []]
        threads = [
            threading.Thread(
                target=stream_tokens,
                args=(target, "key-low", PROMPTS[i], LONG, lows[i]),
                kwargs={"priority": 5},
                daemon=True,
            )
            for i in range(2)
        ]
        for t in threads:
            t.start()
        wait_for(lambda: all(len(x) >= 4 for x in lows), 120, "both low requests streaming")
        high: list = []
        stream_tokens(target, "key-high", "Urgent:", 8, high, priority=0)
        assert len(high) == 8 and all(isinstance(t, int) for t in high)
        status = client.status(stack.settings.scheduler)
        assert status.preemptions >= 1
        reached = [len(x) for x in lows]  # then both go on: the preempted one recomputed
        wait_for(
            lambda: all(len(x) >= n + 4 for x, n in zip(lows, reached, strict=True)),
            120,
            "both low requests streaming again after the high one",
        )
        seen = [list(x) for x in lows]
        # the lows, alone now, to the length each reached: the same tokens, none twice
        for i, prompt in enumerate(PROMPTS):
            got = [t for t in seen[i] if isinstance(t, int)]
            alone: list = []
            stream_tokens(target, "key-low", prompt, len(got), alone, priority=5)
            assert got == alone, f"low {i}: the stream differs from the request run alone"
        stack.stop()  # the lows are still running: the stack's stop cancels them
