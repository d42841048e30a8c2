"""The scheduler's door: a Submit converted from the wire once and checked, for the gateway is a
caller like any other and one bad request must never reach a batch where it would fail the
others. The sampling settings' checks are the gateway's and the worker's too (SamplingParams,
llmcommon/sampling.py); what the scheduler adds is its own: max_tokens is set, resumed tokens
leave room, token ids are within the vocabulary. After `submission_of` nothing in the scheduler
checks the request again."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from llmcommon.sampling import InvalidSampling, SamplingParams
from llmcommon.sampling_wire import from_wire
from llmcommon.tenancy import Tenancy, valid_name
from llmcommon.tenancy_wire import tenancy_of
from llmcommon.v1 import scheduler_pb2

__all__ = ["InvalidSubmission", "Submission", "submission_of"]


class InvalidSubmission(ValueError):
    """A Submit the scheduler refuses (INVALID_ARGUMENT); the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Submission:
    """A Submit as the scheduler takes it: checked, its settings canonical, max_tokens set."""

    request_id: str
    prompt_ids: list[int]
    resume_ids: list[int]
    sampling: SamplingParams
    cache_salt: bytes
    tenancy: Tenancy

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens or 0  # set: submission_of checks it


MAX_ID_CHARS = 256  # a request id (the gateway's are 32), and a worker's address at Register


def submission_of(request: scheduler_pb2.SubmitRequest, vocab_size: int) -> Submission:
    """The request converted once and checked; raises InvalidSubmission. `vocab_size` 0 = not
    known (no worker said). A request without an id gets a new one."""
    prompt, resumed = list(request.prompt_token_ids), list(request.resume_token_ids)
    if not prompt:
        raise InvalidSubmission("the prompt has no tokens")
    try:
        sampling = from_wire(request.sampling)
    except InvalidSampling as err:
        raise InvalidSubmission(str(err)) from None
    problem = _problem(prompt, resumed, sampling, vocab_size)
    if problem:
        raise InvalidSubmission(problem)
    tenancy = tenancy_of(request.tenancy)
    problem = _tenancy_problem(tenancy)
    if problem:
        raise InvalidSubmission(problem)
    if len(request.request_id) > MAX_ID_CHARS:  # it is echoed in errors: not 100 kB of it
        raise InvalidSubmission(
            f"request_id has {len(request.request_id)} characters; at most {MAX_ID_CHARS}"
        )
    rid = request.request_id or uuid.uuid4().hex
    return Submission(rid, prompt, resumed, sampling, request.cache_salt, tenancy)


def _tenancy_problem(t: Tenancy) -> str | None:
    """What is wrong with a submission's tenancy (the gateway sets it), or None."""
    if not valid_name(t.tenant):
        return f"tenant {t.tenant!r} is not a name (letters, digits, _ . -, up to 64)"
    if t.slo_class and not valid_name(t.slo_class):
        return f"slo_class {t.slo_class!r} is not a name (letters, digits, _ . -, up to 64)"
    for name, value in (("weight", t.weight), ("ttft_s", t.ttft_s), ("tpot_s", t.tpot_s)):
        if not math.isfinite(value) or value < 0:
            return f"tenancy.{name} must be a finite number >= 0, got {value}"
    return None


def _problem(
    prompt_ids: list[int], resume_ids: list[int], sampling: SamplingParams, vocab_size: int
) -> str | None:
    """What the scheduler adds to the settings' own checks, or None."""
    if sampling.max_tokens is None:
        return "max_tokens is not set; the scheduler needs it (1 or more)"
    if len(resume_ids) >= sampling.max_tokens:
        return f"{len(resume_ids)} resumed tokens leave nothing of max_tokens {sampling.max_tokens}"
    if not vocab_size:
        return None
    worst = max(max(prompt_ids), max(resume_ids, default=0))
    if worst >= vocab_size:
        return f"token id {worst} is outside the vocabulary of {vocab_size} tokens"
    return sampling.vocab_problem(vocab_size)
