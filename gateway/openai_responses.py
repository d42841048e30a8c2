"""Response bodies of the OpenAI-compatible HTTP API: completions and chat completions, whole
or as the chunks of a stream (server-sent events ending in `data: [DONE]`)."""

from __future__ import annotations

import codecs
import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

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
    bytes_of: Callable[[int], bytes],
    offset: int = 0,
) -> dict | None:
    """OpenAI's logprobs of some tokens (None when none were asked): chat's `content` list, or
    completions' parallel lists (`text_offset` counts from `offset`, the text before them: where
    each token's first byte falls in the text). A token that is a part of a character is named
    as OpenAI names it, `bytes:\\xf0\\x9f`, with its own `bytes`; so tokens that differ keep
    apart, and completions' `top_logprobs` dict keeps each alternative under its own key (the
    likelier where two tokens spell the same)."""
    if not logprobs:
        return None
    token_name = partial(_token_name, text_of, bytes_of)
    names = [token_name(t) for t in token_ids]
    tops = [
        [(token_name(i), v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        for lp in logprobs
    ]
    if chat:
        return {
            "content": [
                _entry(name, lp.logprob) | {"top_logprobs": [_entry(n, v) for n, v in top]}
                for name, lp, top in zip(names, logprobs, tops, strict=True)
            ]
        }
    return {
        "tokens": [text for text, _ in names],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [_keyed(top) for top in tops],
        "text_offset": _offsets([raw for _, raw in names], offset),
    }


def _token_name(
    text_of: Callable[[int], str], bytes_of: Callable[[int], bytes], token_id: int
) -> tuple[str, bytes]:
    """(the token's name, its bytes): its text where its bytes are whole characters."""
    raw, text = bytes_of(token_id), text_of(token_id)
    if "\ufffd" in text and "\ufffd" not in raw.decode("utf-8", "ignore"):
        text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text, raw


def _keyed(top: list[tuple[tuple[str, bytes], float]]) -> dict[str, float]:
    keyed: dict[str, float] = {}
    for (text, _), value in top:  # the likeliest first
        keyed.setdefault(text, value)
    return keyed


def _offsets(raws: list[bytes], offset: int) -> list[int]:
    """Where each token's first byte falls in the text (a token inside a character: that
    character's index)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    offsets, at = [], offset
    for raw in raws:
        offsets.append(at)
        at += len(decoder.decode(raw))
    return offsets


def _entry(name: tuple[str, bytes], logprob: float) -> dict:
    text, raw = name
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


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
            delta = ({"role": "assistant"} if role else {}) | (delta or {})
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
