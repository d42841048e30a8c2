"""The multi-turn workload through real processes (tiny model): each turn is sent after the
answer before it, with that answer in its chat history, and the scheduler serves the history
from its prefix cache."""

from __future__ import annotations

import asyncio
import functools

import pytest

from gateway.tokenizer import load_default_tokenizer
from llmserve.bench.multiturn import MultiTurn, multiturn
from llmserve.bench.served import run_workload
from llmserve.bench.stats import summarize
from llmserve.bench.tokens import TokenSource, checked_word_vocab, word_text
from tests.stacks import running_stack, tiny_settings

SHAPE = MultiTurn(
    conversations=2,
    turns=3,
    system_prompts=1,
    system_tokens=48,
    user_tokens=12,
    answer_tokens=6,
    think_s=0.1,
    rate=0,
)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tokenizer = load_default_tokenizer()
    source = TokenSource(checked_word_vocab(tokenizer))
    workload = multiturn(SHAPE, source, functools.partial(word_text, tokenizer=tokenizer))
    settings = tiny_settings(token_budget=128, max_running=4, kv_capacity=2048, dtype="fp32")
    with running_stack(settings, tmp_path_factory.mktemp("logs")):
        run = run_workload(
            settings.gateway, settings.scheduler, workload, "multiturn", progress=False
        )
        return workload, asyncio.run(run)


def test_each_turn_follows_the_answer_before_it_with_the_history(result) -> None:
    workload, run = result
    records = {r.index: r for r in run.records}
    assert all(r.ok and r.completion_tokens == SHAPE.answer_tokens for r in run.records)
    for spec in workload.requests:
        if spec.follows >= 0:
            before, this = records[spec.follows], records[spec.index]
            assert this.scheduled_s >= before.end_s + spec.think_s
            # the server's prompt count: the previous prompt, its answer, the new message
            grown = this.prompt_tokens - before.prompt_tokens
            assert grown >= SHAPE.answer_tokens + SHAPE.user_tokens


def test_the_scheduler_serves_the_history_from_its_cache(result) -> None:
    _, run = result
    prefix = summarize(run)["prefix"]
    assert prefix["source"] == "scheduler"
    # each of the 4 later turns finds at least its conversation's previous prompt cached
    assert prefix["hit_tokens"] >= 4 * (SHAPE.system_tokens + SHAPE.user_tokens)
    assert prefix["prefill_computed"] == prefix["prompt_tokens"] - prefix["hit_tokens"]
