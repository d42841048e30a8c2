"""Response bodies of the OpenAI-compatible HTTP API: completions and chat completions, whole
or as the chunks of a stream (server-sent events ending in `data: [DONE]`)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from gateway.core import Finish
from llmserve.v1 import common_pb2

FINISH_REASONS = {common_pb2.FINISH_REASON_LENGTH: "length"}  # anything else that ends: "stop"
DONE = b"data: [DONE]\n\n"


def finish_reason(finish: Finish) -> str:
    return FINISH_REASONS.get(finish.reason, "stop")


def usage(finish: Finish) -> dict[str, int]:
    prompt, completion = finish.usage.prompt_tokens, finish.usage.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


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

    def whole(self, text: str, finish: Finish) -> dict:
        """A response that is not streamed."""
        choice: dict = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice |= {"logprobs": None, "finish_reason": finish_reason(finish)}
        return self._head(chunk=False) | {"choices": [choice], "usage": usage(finish)}

    def chunk(self, text: str | None, finish: Finish | None = None, role: bool = False) -> bytes:
        """A streamed chunk: text (None: only the role, or only the finish reason)."""
        choice: dict = {"index": 0}
        if self.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice |= {"logprobs": None, "finish_reason": finish and finish_reason(finish)}
        body = self._head(chunk=True) | {"choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return event(body)

    def usage_chunk(self, finish: Finish) -> bytes:
        return event(self._head(chunk=True) | {"choices": [], "usage": usage(finish)})
