"""`llmserve bench serve --backend openai --base-url URL`: the same workload against any
OpenAI-compatible server (this stack's `--http-port`, llama.cpp's llama-server, vLLM), streamed
through the `openai` package and timed as the gRPC load generator times it.

A server streams text, not token ids: each chunk with text counts as one token when it comes
(TTFT is the first one), and the usage the server reports at the end (`stream_options`) fixes the
count, the tokens it adds counted as arriving with the last chunk. Requests ask for
`ignore_eos` (vLLM's and llama.cpp's extension) so that outputs have the workload's lengths.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit

import openai
from tqdm import tqdm

from llmserve.bench.loadgen import Call, LoadGenerator, OnDone
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

    async def run(
        self, workload: Workload, t0: float, on_done: OnDone | None = None
    ) -> list[RequestRecord]:
        async with openai.AsyncOpenAI(
            base_url=self.target, api_key=self.api_key, max_retries=0, timeout=self.timeout_s
        ) as api:
            if not self.model:  # the server's first model
                self.model = (await api.models.list()).data[0].id
            if workload.closed:
                return await self._closed(api, workload, t0, on_done)
            return await self._open(api, workload, t0, on_done)

    async def _stream(self, stub: openai.AsyncOpenAI, call: Call) -> None:
        spec, sent, record, answer = call.spec, call.sent, call.record, call.answer
        record.sent_s = call.now()
        usage = None
        last: float | None = None
        try:
            async with await self._create(stub, spec, sent) as stream:
                async for chunk in stream:
                    now = call.now()
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        record.finish = choice.finish_reason or record.finish
                        text = choice.text if isinstance(sent, str) else choice.delta.content
                        if not text:
                            continue
                        if answer is not None:
                            answer.append(text)
                        if last is None:
                            record.first_token_s = now
                        else:
                            record.token_gaps.append(now - last)
                        last = now
                        record.completion_tokens += 1
                    if spec.limit > spec.output_tokens <= record.completion_tokens:
                        record.finish = "client_stop"  # the workload's length: stop reading
                        break
        except openai.OpenAIError as err:
            record.error = f"{type(err).__name__}: {err}"
        if usage is not None and record.finish != "client_stop":
            record.prompt_tokens = usage.prompt_tokens or record.prompt_tokens
            extra = usage.completion_tokens - record.completion_tokens
            record.token_gaps.extend([0.0] * max(0, extra))  # tokens in chunks counted once
            record.completion_tokens = usage.completion_tokens

    async def _create(
        self, api: openai.AsyncOpenAI, spec: RequestSpec, sent: str | list[tuple[str, str]]
    ):
        common: dict[str, Any] = dict(
            model=self.model,
            max_tokens=spec.limit,
            temperature=self.temperature,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        if isinstance(sent, str):
            return await api.completions.create(prompt=sent, **common)
        messages = [{"role": role, "content": content} for role, content in sent]
        return await api.chat.completions.create(messages=messages, **common)


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
    await gen.warm_up(workload, warmup)
    bar = tqdm(total=len(workload.requests), desc=label, unit="req", disable=not progress)
    t0 = time.perf_counter()
    try:
        records = await gen.run(workload, t0, lambda record: bar.update(1))
    finally:
        wall = time.perf_counter() - t0
        bar.close()
    config = {"backend": "openai", "base_url": base_url, "model": gen.model}
    return RunResult(label, records, [], wall, config=config)
