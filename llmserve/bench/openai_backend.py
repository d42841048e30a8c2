"""`llmserve bench serve --backend openai --base-url URL`: the same workload against any
OpenAI-compatible server (this stack's `--http-port`, llama.cpp's llama-server, vLLM), streamed
through the `openai` package and timed as the gRPC load generator times it.

A server streams text, not token ids. Requests ask for the usage in every chunk
(`stream_options`: `include_usage` and vLLM's `continuous_usage_stats`, dropped for a server
that refuses it): where a chunk carries it, the tokens it adds over the chunk before are the
chunk's tokens, when it comes; else each chunk with text (answer or reasoning) counts as one
token, and a usage at the end fixes the count, the tokens it adds counted as arriving with the
chunk that reports them. A request's
`tokens_basis` says which: `usage` or `chunks` (none came, or one that contradicts the text
streamed, which is then ignored and said). Requests ask for `ignore_eos` (vLLM's and
llama.cpp's extension) so that outputs have the workload's lengths.

A request fails (and is left out of the ok figures and the goodput) when it passes `--timeout`
from its sending (DEADLINE_EXCEEDED, as on the gRPC path), when the server answers an error (an
HTTP status, an `error` object or an `"object": "error"` chunk), when a data line is not JSON or
a chunk has another shape, when the answer is not an event stream, when the stream ends without
a finish reason, and when the server sends more tokens than max_tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import openai
from tqdm import tqdm

from llmserve.bench.errors import BenchError
from llmserve.bench.loadgen import WARMUP_TIMEOUT_S, Call, LoadGenerator, OnDone, deadline_error
from llmserve.bench.records import RequestRecord, RunResult
from llmserve.bench.workload import RequestSpec, Workload


def parse_base_urls(values: list[str]) -> list[tuple[str, str]]:
    """`[label=]URL` values as (label, URL); the label defaults to the URL's host:port."""
    out = []
    for value in values:
        label, sep, url = value.partition("=")
        if not sep or "://" in label:
            label, url = "", value
        out.append((label or f"openai {urlsplit(url).netloc}", url))
    return out


class BadStream(Exception):
    """An answer that cannot be measured: the message says why."""


class OpenAILoadGenerator(LoadGenerator):
    """LoadGenerator's closed and open loops, each request a streamed completion (a prompt) or
    chat completion (messages)."""

    def __init__(
        self,
        base_url: str,
        model: str = "",
        api_key: str = "none",
        timeout_s: float | None = None,
        temperature: float = 0.0,
    ) -> None:
        super().__init__(base_url, timeout_s=timeout_s, temperature=temperature)
        self.model, self.api_key = model, api_key
        self.api: openai.AsyncOpenAI | None = None
        self.continuous = True  # ask for the usage in every chunk (until a server refuses it)

    @contextlib.asynccontextmanager
    async def connected(self) -> AsyncIterator[None]:
        """The HTTP client (and the model, when not given) for the calls inside: built once,
        before any request is timed. Deadlines are the requests' own (`--timeout`)."""
        async with openai.AsyncOpenAI(
            base_url=self.target, api_key=self.api_key, max_retries=0, timeout=None
        ) as self.api:
            try:
                if not self.model:
                    self.model = await self._first_model()
                yield
            finally:
                self.api = None

    async def _first_model(self) -> str:
        bound = self.timeout_s or WARMUP_TIMEOUT_S
        try:
            async with asyncio.timeout(bound):
                models = (await self.api.models.list()).data
        except TimeoutError:
            why = f"no answer within {bound:g} s"
        except openai.APIStatusError as err:
            why = f"HTTP {err.status_code}"
        except (openai.OpenAIError, ValueError) as err:
            why = f"{type(err).__name__}: {err}"
        else:
            if models:
                return models[0].id
            why = "it lists none"
        raise BenchError(f"{self.target}: cannot list its models ({why}); give --api-model NAME")

    async def run(
        self, workload: Workload, t0: float, on_done: OnDone | None = None
    ) -> list[RequestRecord]:
        if self.api is None:
            async with self.connected():
                return await self.run(workload, t0, on_done)
        if workload.closed:
            return await self._closed(self.api, workload, t0, on_done)
        return await self._open(self.api, workload, t0, on_done)

    async def _stream(self, api: openai.AsyncOpenAI, call: Call) -> None:
        record = call.record
        record.tokens_basis = "chunks"  # until a usage counts them
        record.sent_s = call.now()
        asked = self.continuous
        try:
            async with asyncio.timeout(self.timeout_s):  # from the sending
                async with await self._create(api, call.spec, call.sent) as stream:
                    await self._read(stream, call)
        except TimeoutError:
            record.error = deadline_error(self.timeout_s)
        except openai.OpenAIError as err:
            if asked and _refuses_continuous(err):  # then the usage at the end only
                self.continuous = False
                return await self._stream(api, call)
            record.error = f"{type(err).__name__}: {err}"
        except json.JSONDecodeError as err:
            record.error = f"not JSON: a data line {err.doc[:60]!r} ({err.msg})"
        except BadStream as err:
            record.error = str(err)
        except Exception as err:  # a chunk of another shape: this request fails, not the run
            record.error = f"bad chunk: {type(err).__name__}: {err}"
        if not record.error and record.finish != "client_stop":
            record.error = _unfinished(record, call.spec)

    async def _read(self, stream: Any, call: Call) -> None:
        spec, record, answer = call.spec, call.record, call.answer
        chat = not isinstance(call.sent, str)
        seen = chunks = 0  # chunks, and those with text (answer or reasoning)
        reported: int | None = None  # the usage's completion tokens, the latest
        usage = None
        async for chunk in stream:
            now = call.now()
            seen += 1
            _check(chunk)
            usage = chunk.usage or usage
            so_far = _completion_tokens(chunk.usage)
            texts = 0
            for choice in chunk.choices:
                record.finish = choice.finish_reason or record.finish
                counted, shown = _text(choice, chat)
                if shown and answer is not None:
                    answer.append(shown)
                texts += bool(counted)
            chunks += texts
            n = texts if so_far is None else max(texts, so_far - record.completion_tokens)
            reported = reported if so_far is None else so_far
            if spec.limit > spec.output_tokens:  # a run's tokens past the length go unread
                n = min(n, spec.output_tokens - record.completion_tokens)
            record.took(n, now)
            if spec.limit > spec.output_tokens <= record.completion_tokens:
                record.finish = "client_stop"  # the workload's length: stop reading
                record.tokens_basis = "chunks" if so_far is None else "usage"
                break
        else:
            if not seen:
                kind = stream.response.headers.get("content-type", "no Content-Type")
                raise BadStream(f"not streamed: the answer ({kind}) has no events")
            record.tokens_basis, record.usage_note = _basis(usage, reported, record, chunks)
        prompt = getattr(usage, "prompt_tokens", None)
        if isinstance(prompt, int) and prompt > 0:
            record.prompt_tokens = prompt  # a chat's, with its template

    async def _create(
        self, api: openai.AsyncOpenAI, spec: RequestSpec, sent: str | list[tuple[str, str]]
    ):
        common: dict[str, Any] = dict(
            model=self.model,
            max_tokens=spec.limit,
            temperature=self.temperature,
            stream=True,
            stream_options={"include_usage": True}
            | ({"continuous_usage_stats": True} if self.continuous else {}),
            extra_body={"ignore_eos": True},
        )
        if isinstance(sent, str):
            return await api.completions.create(prompt=sent, **common)
        messages = [{"role": role, "content": content} for role, content in sent]
        return await api.chat.completions.create(messages=messages, **common)


def _check(chunk: Any) -> None:
    """An error in a chunk's own shape (vLLM's and FastChat's `"object": "error"` bodies; the
    SDK raises for an `error` key) or a chunk without choices fails its request."""
    if getattr(chunk, "object", "") == "error" or not isinstance(chunk.choices, list):
        message = getattr(chunk, "message", None) or "no choices in a chunk"
        raise BadStream(f"error chunk: {message}")


def _refuses_continuous(err: openai.OpenAIError) -> bool:
    """A server that takes no `continuous_usage_stats` (a strict request schema)."""
    return isinstance(err, openai.BadRequestError) and "continuous_usage_stats" in str(err)


def _text(choice: Any, chat: bool) -> tuple[str, str]:
    """The text that counts as tokens (reasoning deltas too: they are tokens when they come) and
    the answer's text (what a conversation sends back)."""
    if not chat:
        return choice.text or "", choice.text or ""
    delta = choice.delta
    content = (delta.content if delta else None) or ""
    thought = getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None)
    return content or thought or "", content


def _completion_tokens(usage: Any) -> int | None:
    count = getattr(usage, "completion_tokens", None)
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def _basis(usage: Any, reported: int | None, record: RequestRecord, chunks: int) -> tuple[str, str]:
    """Where the count came from, and why a usage the server sent was not taken."""
    if reported is None:
        return "chunks", "" if usage is None else "usage without completion_tokens: ignored"
    if reported < record.completion_tokens:  # fewer than streamed (zeros): the chunks count
        return "chunks", f"usage said {reported} completion tokens, {chunks} streamed: ignored"
    return "usage", ""


def _unfinished(record: RequestRecord, spec: RequestSpec) -> str:
    """Why an answer read to its end is not a whole one ("" when it is)."""
    if not record.finish:
        return "cut off: the stream ended without a finish_reason"
    if record.completion_tokens > spec.limit:
        return f"LENGTH: {record.completion_tokens} tokens, above max_tokens {spec.limit}"
    return ""


async def run_openai(
    label: str,
    base_url: str,
    workload: Workload,
    model: str = "",
    api_key: str = "none",
    progress: bool = True,
    warmup: int = 2,
    timeout_s: float | None = None,
) -> RunResult:
    """Warm up, then send `workload` to the server at `base_url` (no server counters: the
    figures are the client's)."""
    gen = OpenAILoadGenerator(base_url, model, api_key, timeout_s)
    async with gen.connected():
        await gen.warm_up(workload, warmup)
        gen.prepare(workload)
        bar = tqdm(total=len(workload.requests), desc=label, unit="req", disable=not progress)
        t0 = time.perf_counter()
        try:
            records = await gen.run(workload, t0, lambda record: bar.update(1))
        finally:
            wall = time.perf_counter() - t0
            bar.close()
    config = {"backend": "openai", "base_url": base_url, "model": gen.model}
    return RunResult(label, records, [], wall, config=config)
