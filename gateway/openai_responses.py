"""Response bodies of the OpenAI-compatible HTTP API: completions and chat completions, whole
or as the chunks of a stream (server-sent events ending in `data: [DONE]`)."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.core import Finish
from gateway.tools import ToolPlan
from llmcommon.v1 import common_pb2

FINISH_REASONS = {common_pb2.FINISH_REASON_LENGTH: "length"}  # anything else that ends: "stop"
DONE = b"data: [DONE]\n\n"


def finish_reason(finish: Finish, called: bool = False) -> str:
    """`tool_calls` when the answer called tools (and was not cut short)."""
    reason = FINISH_REASONS.get(finish.reason, "stop")
    return "tool_calls" if called and reason == "stop" else reason


def running_usage(prompt: int, completion: int) -> dict[str, int]:
    """The token counts so far (vLLM's `continuous_usage_stats`: one in every chunk)."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def usage(finish: Finish) -> dict:
    """A finished request's usage; `prompt_tokens_details.cached_tokens`: of its prompt, the
    tokens its first admission found in the prefix cache (their KV not computed again)."""
    counted = running_usage(finish.usage.prompt_tokens, finish.usage.completion_tokens)
    return counted | {"prompt_tokens_details": {"cached_tokens": finish.usage.cached_tokens}}


def usage_of(finishes: Sequence[Finish]) -> dict:
    """The usage of choices from one prompt: the prompt once, every choice's tokens."""
    total = usage(finishes[0])
    total["completion_tokens"] = sum(f.usage.completion_tokens for f in finishes)
    total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
    return total


def logprobs_body(
    chat: bool,
    token_ids: Sequence[int],
    logprobs: Sequence[common_pb2.TokenLogprobs],
    text_of: Callable[[int], str],
    offset: int = 0,
) -> dict | None:
    """OpenAI's logprobs of some tokens (None when none were asked): chat's `content` list, or
    completions' parallel lists (`text_offset` counts from `offset`, the text before them). A
    token's text is its own decoding (a part of a character shows as U+FFFD)."""
    if not logprobs:
        return None
    texts = [text_of(t) for t in token_ids]
    tops = [
        [(text_of(i), v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        for lp in logprobs
    ]
    if chat:
        return {
            "content": [
                _entry(text, lp.logprob) | {"top_logprobs": [_entry(t, v) for t, v in top]}
                for text, lp, top in zip(texts, logprobs, tops, strict=True)
            ]
        }
    offsets = list(itertools.accumulate((len(t) for t in texts[:-1]), initial=offset))
    return {
        "tokens": texts,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [dict(top) for top in tops],
        "text_offset": offsets,
    }


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def event(body: dict) -> bytes:
    """One server-sent event."""
    return (
        b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )


@dataclass(frozen=True, slots=True)
class Reply:
    """The identity of one response, the same in each of its chunks."""

    chat: bool
    model: str
    include_usage: bool = False  # streams: a last chunk with the usage, `usage: null` before
    continuous_usage: bool = False  # streams with include_usage: each chunk's usage so far
    tools: ToolPlan | None = None  # chat answers parsed for tool calls (gateway/tools.py)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def public_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    def _head(self, chunk: bool) -> dict:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.public_id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, results: Sequence[tuple[str, Finish, dict | None]]) -> dict:
        """A response that is not streamed: one choice per (text, finish, logprobs)."""
        choices = []
        for index, (text, finish, logprobs) in enumerate(results):
            choice: dict = {"index": index}
            called = False
            if self.chat:
                choice["message"] = message = {"role": "assistant", "content": text}
                if self.tools is not None:
                    message["content"], calls = self.tools.calls(text)
                    if calls:
                        message["tool_calls"], called = calls, True
            else:
                choice["text"] = text
            choice |= {"logprobs": logprobs, "finish_reason": finish_reason(finish, called)}
            choices.append(choice)
        total = usage_of([finish for _, finish, _ in results])
        return self._head(chunk=False) | {"choices": choices, "usage": total}

    def chunk(
        self,
        text: str | None,
        finish: Finish | None = None,
        role: bool = False,
        logprobs: dict | None = None,
        index: int = 0,
        so_far: dict | None = None,
        delta: dict | None = None,
        called: bool = False,
    ) -> bytes:
        """A streamed chunk of choice `index`: text (None: only the role, or only the finish
        reason) or a chat `delta` as given (tool calls); `so_far`: its usage (continuous_usage),
        else null; `called`: the choice called tools (its finish reason is `tool_calls`)."""
        choice: dict = {"index": index}
        if self.chat:
            delta = dict(delta or {})
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        reason = finish and finish_reason(finish, called)
        choice |= {"logprobs": logprobs, "finish_reason": reason}
        body = self._head(chunk=True) | {"choices": [choice]}
        if self.include_usage:
            body["usage"] = so_far if self.continuous_usage else None
        return event(body)

    def usage_chunk(self, finishes: Sequence[Finish]) -> bytes:
        return event(self._head(chunk=True) | {"choices": [], "usage": usage_of(finishes)})
