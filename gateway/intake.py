"""The gateway's door: a request as a client sent it (`GenerateInput`, from the gRPC API's
gateway/service.py or the HTTP API's gateway/openai_requests.py) becomes one checked request.
Its size is bounded on counts alone, its fields are checked and their defaults resolved once
(gateway/validation.py), its grammar compiled, its prompt rendered and tokenized; what depends on
the prompt's length is checked once it is counted (`Intake.fitted`). What the gateway does after
(queue limits, the scheduler's Submit, the stream) trusts what it is given."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import grpc

from gateway.context_fit import completion_budget, completion_overflow, prompt_overflow
from gateway.generation_errors import ContextLengthExceeded, GenerationError
from gateway.settings import GatewaySettings
from gateway.structured import grpc_grammar_problem
from gateway.tokenizer import Tokenizer
from gateway.trim import trim_after
from gateway.validation import InputLimits, ValidatedParams, validate
from llmcommon.request_checks import context_problem
from llmcommon.sampling import InvalidSampling, SamplingParams

__all__ = ["ChatTurn", "GenerateInput", "Intake"]


class ChatTurn(Protocol):
    """A chat message: a gRPC ChatMessage, or the HTTP API's."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """What a client asks for, as sent: `validate` checks it and fills defaults. Messages are
    converted only after their count and size are checked."""

    prompt: str | None = None
    messages: Sequence[ChatTurn] | None = None
    sampling: SamplingParams = SamplingParams()  # as sent, not checked (max_tokens None: unset)
    cache_salt: str = ""  # only requests of equal salt (and API key) share cached KV blocks
    # The HTTP API's (vLLM's) rules: prompt + max_tokens must fit the context (else
    # ContextLengthExceeded), max_tokens unset is the rest of it (gateway/context_fit.py)
    fit_context: bool = False
    include_stop: bool = False  # the stop string that ended the text stays in it
    skip_special_tokens: bool = True
    tools: Sequence[dict] = ()  # offered (tool_choice auto): the chat template describes them
    priority: object = None  # as sent (None: the key's default); checked by gateway/request_tenancy
    slo_class: str = ""  # "" = the key's default class
    session: str = ""  # with --cells --router session: what sticks to a cell ("" = the tenant)


class Intake:
    """Checks what clients send against the model this gateway serves."""

    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer: Tokenizer,
        max_context: int,
        pool: ThreadPoolExecutor,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.pool = pool  # renders and tokenizes, off the event loop

    def _limits(self) -> InputLimits:
        s = self.settings
        return InputLimits.for_context(
            self.max_context, self.tokenizer.longest_token_chars, s.max_messages, s.max_prompt_chars
        )

    async def prepare(self, job: GenerateInput) -> tuple[ValidatedParams, list[int]]:
        """Bound the request on counts alone, then validate, render and tokenize it in the pool:
        that work grows with the request, and the event loop serves every other stream.
        Raises ValueError (InvalidRequest, a template's refusal, invalid Unicode)."""
        limits = self._limits()
        if job.messages is not None:
            limits.check_messages(len(job.messages))
            limits.check_chars(sum(len(m.content) for m in job.messages), chat=True)
        elif job.prompt is not None:
            limits.check_chars(len(job.prompt))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self._validate_and_tokenize, job)

    def _validate_and_tokenize(self, job: GenerateInput) -> tuple[ValidatedParams, list[int]]:
        params = self._validate(job)
        if params.sampling.grammar is not None:  # compiled once per grammar (cached)
            problem = grpc_grammar_problem(params.sampling.grammar)  # type: ignore[arg-type]
            if problem:
                raise ValueError(problem)
        return params, self._tokenize(params, job.messages, job.tools)

    def _validate(self, job: GenerateInput) -> ValidatedParams:
        messages = None
        if job.messages is not None:
            messages = [(m.role, m.content) for m in job.messages]
        return validate(
            prompt=job.prompt,
            messages=messages,
            sampling=job.sampling,
            max_context=self.max_context,
            default_max_tokens=self.settings.default_max_tokens,
            fit_context=job.fit_context,
        )

    def _tokenize(
        self,
        params: ValidatedParams,
        turns: Sequence[ChatTurn] | None = None,
        tools: Sequence[dict] = (),
    ) -> list[int]:
        if params.messages is not None:
            messages = _template_messages(params.messages, turns)
            text = self.tokenizer.apply_chat_template(messages, tools)
        else:
            text = params.prompt or ""
        # a rendered chat spells its special tokens (BOS too); a plain prompt gets the tokenizer's
        ids = self.tokenizer.encode(text, add_special_tokens=params.messages is None)
        trim_after(len(text))
        return ids

    def fitted(
        self, prompt_ids: list[int], job: GenerateInput, sampling: SamplingParams
    ) -> SamplingParams:
        """The checks on the prompt's length, once it is counted: room to generate, and under
        the HTTP API's rule max_tokens within the rest of the context (unset: all of it). The
        validated settings with max_tokens resolved, or GenerationError."""
        if not prompt_ids:
            raise GenerationError(grpc.StatusCode.INVALID_ARGUMENT, "the prompt has no tokens")
        if job.fit_context:
            sampling = self._fit(len(prompt_ids), job, sampling)
        too_long = context_problem(len(prompt_ids), self.max_context)
        if too_long:  # before the queue limit: it can never run
            raise GenerationError(grpc.StatusCode.INVALID_ARGUMENT, too_long)
        return sampling

    def _fit(self, prompt_tokens: int, job: GenerateInput, sampling: SamplingParams):
        """The HTTP API's rule: prompt + max_tokens within the context (gateway/context_fit)."""
        prompt_param = "prompt" if job.messages is None else "messages"
        too_long = prompt_overflow(prompt_tokens, self.max_context)
        if too_long:
            raise ContextLengthExceeded(too_long, prompt_param)
        if sampling.max_tokens is not None:
            too_long = completion_overflow(prompt_tokens, sampling.max_tokens, self.max_context)
            if too_long:
                raise ContextLengthExceeded(too_long, "max_tokens")
            return sampling
        try:  # the rest of the context, min_tokens within it
            return sampling.limited_to(completion_budget(prompt_tokens, None, self.max_context))
        except InvalidSampling as err:
            raise GenerationError(grpc.StatusCode.INVALID_ARGUMENT, str(err), err.param) from None


def _template_messages(
    checked: Sequence[tuple[str, str]], turns: Sequence[ChatTurn] | None
) -> list[dict]:
    """The checked (role, content) pairs with what else each turn carries for the chat template
    (`extra`: an HTTP message's tool_calls, tool_call_id, name; gRPC's carry none)."""
    extras = [getattr(t, "extra", None) or {} for t in turns] if turns else [{}] * len(checked)
    return [{"role": r, "content": c} | x for (r, c), x in zip(checked, extras, strict=True)]
