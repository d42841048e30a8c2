"""Back-to-back requests: each one arrives just as the previous one ends and the scheduler goes
idle (and tells the workers what it freed). None may be lost in between."""

from __future__ import annotations

from llmserve import client
from tests.stacks import running_stack, tiny_settings


def test_back_to_back_requests_never_wait_for_the_next_one(tmp_path) -> None:
    with running_stack(tiny_settings(), tmp_path) as stack:
        for i in range(60):
            request = client.make_request(prompt=f"n{i}", max_tokens=2, ignore_eos=True)
            messages = list(client.stream(stack.settings.gateway, request, timeout=10))
            assert messages[-1].final.usage.completion_tokens == 2
