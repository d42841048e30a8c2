"""What the scheduler checks in a Submit: the gateway is a caller like any other, and one bad
request must never reach a batch where it would fail the others. The sampling settings' checks
are the gateway's and the worker's too (SamplingParams, llmcommon/sampling.py)."""

from __future__ import annotations

from llmcommon.sampling import InvalidSampling
from llmcommon.sampling_wire import from_wire
from llmcommon.v1 import common_pb2


def submit_problem(
    prompt_ids: list[int], resume_ids: list[int], s: common_pb2.SamplingParams, vocab_size: int
) -> str | None:
    """What is wrong with a submitted request (a message for INVALID_ARGUMENT), or None.
    `vocab_size` 0 = not known (no worker said)."""
    if not prompt_ids:
        return "the prompt has no tokens"
    if s.max_tokens < 1:
        return f"max_tokens must be >= 1, got {s.max_tokens}"
    if len(resume_ids) >= s.max_tokens:
        return f"{len(resume_ids)} resumed tokens leave nothing of max_tokens {s.max_tokens}"
    if vocab_size:
        worst = max(max(prompt_ids), max(resume_ids, default=0))
        if worst >= vocab_size:
            return f"token id {worst} is outside the vocabulary of {vocab_size} tokens"
    try:
        params = from_wire(s)
    except InvalidSampling as err:
        return str(err)
    return params.vocab_problem(vocab_size) if vocab_size else None
