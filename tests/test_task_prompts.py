"""The speculative benchmark's chat tasks: the same prompts from the same seed, each request its
own, the repetitive ones carrying the text their answer is to copy."""

from __future__ import annotations

import pytest

from llmserve.bench.task_prompts import TaskPrompts, open_prompt, repetitive_prompt, task_workload
from llmserve.bench.workload import RequestSpec


def test_prompts_come_from_the_seed_and_the_index_alone() -> None:
    assert repetitive_prompt(3, 5) == repetitive_prompt(3, 5)
    assert repetitive_prompt(3, 5) != repetitive_prompt(4, 5)
    assert len({repetitive_prompt(0, i) for i in range(30)}) == 30
    assert len({open_prompt(0, i) for i in range(30)}) > 20


def test_repetitive_prompts_hold_what_their_answers_copy() -> None:
    code, listed, text = (repetitive_prompt(0, i) for i in range(3))
    assert "```python" in code and code.count("def ") == 3 and "rename" in code
    assert listed.count("\n- ") == 24
    assert text.count("years old.") == 8


def test_a_task_workload_sends_chat_messages_in_a_closed_loop() -> None:
    load = task_workload("repetitive", 6, 96, 2, seed=1)
    assert load.concurrency == 2 and [r.output_tokens for r in load.requests] == [96] * 6
    assert all(r.prompt_tokens > 50 for r in load.requests)
    sent = load.content.served_input(RequestSpec(4, 0, 0), [])
    assert sent == [("user", repetitive_prompt(1, 4))]
    assert "repetitive chat tasks" in load.prompts
    with pytest.raises(ValueError, match="unknown task prompts"):
        TaskPrompts("poetry")
