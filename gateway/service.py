"""The public Gateway service: validate, tokenize, apply queue limits, stream text back."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from gateway.detokenizer import IncrementalDetokenizer
from gateway.settings import GatewaySettings
from gateway.stops import StopMatcher
from gateway.tokenizer import Tokenizer
from gateway.trim import trim_after
from gateway.validation import InputLimits, ValidatedParams, validate
from llmserve.protocol import ACCEPTED_KEY
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2

log = logging.getLogger("gateway")
RESUBMIT_PERIOD_S = 0.25  # a resubmission waiting for the scheduler tries again this often


@dataclass(slots=True)
class Tally:
    """One request's progress, for usage figures."""

    received: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_time: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    preemptions: int = 0
    resubmits: int = 0  # sent again to a restarted scheduler

    def usage(self) -> common_pb2.Usage:
        now = time.monotonic()
        ttft = (self.first_token_at - self.received) if self.first_token_at else 0.0
        return common_pb2.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            queue_time_s=self.queue_time,
            time_to_first_token_s=ttft,
            total_time_s=now - self.received,
            preemptions=self.preemptions,
        )


class AdmissionQueue:
    """The gateway's queue limits: requests and prompt tokens not yet admitted to a batch."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.requests = self.tokens = 0

    def refusal(self, tokens: int) -> str | None:
        if self.requests >= self.max_requests:
            return f"queue full: {self.requests} requests are waiting (limit {self.max_requests})"
        if self.tokens + tokens > self.max_tokens:
            return (
                f"queue full: {self.tokens} prompt tokens are waiting and this request adds "
                f"{tokens} (limit {self.max_tokens})"
            )
        return None

    def enter(self, tokens: int) -> None:
        self.requests += 1
        self.tokens += tokens

    def leave(self, tokens: int) -> None:
        self.requests -= 1
        self.tokens -= tokens


class GatewayService(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer: Tokenizer,
        scheduler,  # SchedulerStub
        max_context: int,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_context = max_context
        self.queue = AdmissionQueue(settings.max_queued_requests, settings.max_queued_tokens)
        self.pool = ThreadPoolExecutor(settings.tokenize_threads, thread_name_prefix="tokenize")
        self.observer = None  # metrics hook, set by the metrics module
        self.on_tokens = None  # metrics hook: (tally, count, now) before the tally counts them

    async def Generate(self, request, context):
        async for message in self._generate(request, context):
            yield message

    async def GenerateUnary(self, request, context):
        text, ids = [], []
        final = None
        async for message in self._generate(request, context):
            if message.HasField("delta"):
                text.append(message.delta.text)
                ids.extend(message.delta.token_ids)
            else:
                final = message.final
        if final is None:  # refused: the context holds the status
            return None
        return gateway_pb2.GenerateResult(
            request_id=final.request_id,
            text="".join(text),
            token_ids=ids,
            finish_reason=final.finish_reason,
            usage=final.usage,
            error=final.error,
        )

    def _limits(self) -> InputLimits:
        s = self.settings
        return InputLimits.for_context(
            self.max_context, self.tokenizer.longest_token_chars, s.max_messages, s.max_prompt_chars
        )

    async def _prepare(self, request) -> tuple[ValidatedParams, list[int]]:
        """Bound the request on counts alone, then validate, render and tokenize it in the pool:
        that work grows with the request, and the event loop serves every other stream."""
        limits = self._limits()
        if request.WhichOneof("input") == "chat":
            messages = request.chat.messages
            limits.check_messages(len(messages))
            limits.check_chars(sum(len(m.content) for m in messages), chat=True)
        else:
            limits.check_chars(len(request.prompt))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self._validate_and_tokenize, request)

    def _validate_and_tokenize(self, request) -> tuple[ValidatedParams, list[int]]:
        params = self._validate(request)
        return params, self._tokenize(params)

    def _validate(self, request) -> ValidatedParams:
        s = request.sampling
        kind = request.WhichOneof("input")
        messages = None
        if kind == "chat":
            messages = [(m.role, m.content) for m in request.chat.messages]
        return validate(
            prompt=request.prompt if kind == "prompt" else None,
            messages=messages,
            max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
            temperature=s.temperature if s.HasField("temperature") else None,
            top_p=s.top_p if s.HasField("top_p") else None,
            top_k=s.top_k if s.HasField("top_k") else None,
            stop=list(s.stop),
            max_context=self.max_context,
            default_max_tokens=self.settings.default_max_tokens,
        )

    def _tokenize(self, params: ValidatedParams) -> list[int]:
        if params.messages is not None:
            text = self.tokenizer.apply_chat_template(
                [{"role": r, "content": c} for r, c in params.messages]
            )
        else:
            text = params.prompt or ""
        # a rendered chat spells its special tokens (BOS too); a plain prompt gets the tokenizer's
        ids = self.tokenizer.encode(text, add_special_tokens=params.messages is None)
        trim_after(len(text))
        return ids

    def _refusal(self, prompt_ids: list[int]) -> tuple[grpc.StatusCode, str] | None:
        if not prompt_ids:
            return grpc.StatusCode.INVALID_ARGUMENT, "the prompt has no tokens"
        if len(prompt_ids) >= self.max_context:  # before the queue limit: it can never run
            return grpc.StatusCode.INVALID_ARGUMENT, (
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate within the "
                f"model's context of {self.max_context} tokens; shorten the prompt"
            )
        refusal = self.queue.refusal(len(prompt_ids))
        return (grpc.StatusCode.RESOURCE_EXHAUSTED, refusal) if refusal else None

    async def _generate(self, request, context) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        tally = Tally()
        rid = uuid.uuid4().hex  # the scheduler's key: never a client's id, which may collide
        shown_id = request.request_id or rid
        try:
            params, prompt_ids = await self._prepare(request)
        except ValueError as err:  # InvalidRequest, a template's refusal, invalid Unicode
            refusal = (grpc.StatusCode.INVALID_ARGUMENT, str(err))
        else:
            refusal = self._refusal(prompt_ids)
        if refusal is not None:
            _refuse(context, *refusal)
            return
        tally.prompt_tokens = len(prompt_ids)
        submit = scheduler_pb2.SubmitRequest(
            request_id=rid,
            prompt_token_ids=prompt_ids,
            sampling=common_pb2.SamplingParams(
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                ignore_eos=request.sampling.ignore_eos,
                seed=request.sampling.seed if request.sampling.HasField("seed") else None,
            ),
        )
        self.queue.enter(len(prompt_ids))
        queued = True
        call = self.scheduler.Submit(submit, timeout=context.time_remaining())
        detok = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=True, prompt_ids=prompt_ids
        )
        stops = StopMatcher(list(params.stop))
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        error = ""
        streamed: list[int] = []  # every token received: a resubmission resumes after them
        resume_by: float | None = None  # resubmitting: the scheduler must be back by then
        try:
            while True:
                try:
                    async for event in call:
                        if event.admitted and queued:
                            self.queue.leave(len(prompt_ids))
                            queued = False
                            tally.queue_time = event.queue_time_s
                        if event.token_ids:
                            now = time.monotonic()
                            if self.on_tokens is not None:
                                self.on_tokens(tally, len(event.token_ids), now)
                            tally.first_token_at = tally.first_token_at or now
                            tally.last_token_at = now
                            tally.completion_tokens += len(event.token_ids)
                            streamed += event.token_ids
                            text, hit = stops.push(detok.push(list(event.token_ids)))
                            yield _delta(text, event.token_ids)
                            if hit:
                                finish = common_pb2.FINISH_REASON_STOP
                                call.cancel()
                                break
                        if event.finish_reason:
                            finish, error, tally.preemptions = (
                                event.finish_reason,
                                event.error,
                                event.preemptions,
                            )
                    break
                except grpc.aio.AioRpcError as err:
                    if not await _scheduler_lost(call, err, resume_by is not None):
                        raise
                    if len(streamed) >= params.max_tokens:  # only its end was lost
                        finish = common_pb2.FINISH_REASON_LENGTH
                        break
                    now = time.monotonic()
                    if resume_by is None or await _accepted(call):
                        resume_by = now + self.settings.resubmit_timeout
                        why = err.code().name
                        log.warning("request %s: scheduler lost (%s); resubmitting", rid, why)
                    elif now > resume_by:
                        raise
                    else:
                        await asyncio.sleep(RESUBMIT_PERIOD_S)
                    tally.resubmits += 1
                    del submit.resume_token_ids[:]
                    submit.resume_token_ids.extend(streamed)
                    call = self.scheduler.Submit(submit, timeout=context.time_remaining())
            if finish == common_pb2.FINISH_REASON_ERROR:
                await context.abort(grpc.StatusCode.UNAVAILABLE, error or "generation failed")
            if not stops.stopped:
                tail, _ = stops.push(detok.flush())
                tail += stops.flush()
                if tail:
                    yield _delta(tail, [])
        except (asyncio.CancelledError, GeneratorExit):  # the client left, or its deadline passed
            finish = common_pb2.FINISH_REASON_CANCELLED
            raise
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED:  # the client's own deadline
                finish = common_pb2.FINISH_REASON_CANCELLED
            details = err.details() or "the scheduler failed"
            if err.code() is grpc.StatusCode.UNAVAILABLE:  # e.g. "Socket closed": say where
                details = f"the scheduler is unavailable or has no worker ({details}); retry"
            await context.abort(err.code(), details)
        finally:
            if queued:
                self.queue.leave(len(prompt_ids))
            call.cancel()
            if self.observer is not None:
                self.observer(finish, tally)
        yield gateway_pb2.GenerateResponse(
            final=gateway_pb2.Final(
                request_id=shown_id, finish_reason=finish, usage=tally.usage(), error=error
            )
        )


async def _accepted(call) -> bool:
    """Did the scheduler take this call's request (it says so in its first metadata)?"""
    metadata = await call.initial_metadata()
    return any(key == ACCEPTED_KEY for key, _ in metadata or ())


async def _scheduler_lost(call, err: grpc.aio.AioRpcError, resubmitting: bool) -> bool:
    """The scheduler went away (killed, restarted, stopped past its drain) while it held this
    request, or while a resubmission waits for it to come back: resubmit. A refusal of a new
    request, or an answer from a live scheduler, is the client's."""
    if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return False
    return resubmitting or await _accepted(call)


def _refuse(context, code: grpc.StatusCode, message: str) -> None:
    """End the call with `code` without raising. `context.abort` raises an exception that grpc
    keeps on the call's state: a reference cycle through every frame of the handler, which kept
    a refused request (a 0.8 MB chat parses into 100k messages) until a full garbage collection."""
    context.set_code(code)
    context.set_details(message)


def _delta(text: str, token_ids) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(
        delta=gateway_pb2.TokenDelta(text=text, token_ids=list(token_ids))
    )
