"""Request bodies of the OpenAI-compatible HTTP API, as pydantic models: the fields the gateway
serves, strictly typed (a wrong type is a 400 naming the field), unknown fields ignored as
OpenAI's servers do. Ranges and defaults are the gateway's own validation (gateway/validation.py),
the same for HTTP and gRPC; what is checked here is what JSON can say and protobuf cannot."""

from __future__ import annotations

from typing import Any, NamedTuple

import grpc
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.choices import U64_MAX, choice_inputs, choices_problem
from gateway.core import GenerateInput
from gateway.http_errors import ApiError
from llmserve.runtime.request_checks import MAX_LOGPROBS

U32_MAX = 2**32 - 1
TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's union members
# Sampling fields of OpenAI's API (and vLLM's) that the gateway does not implement yet, with
# their neutral values: a request that sets one to anything else is refused, not served as if
# it had not asked (a client reading logprobs that never come, a penalty silently off).
NOT_YET: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, 0),
    "suffix": (None, ""),
}


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @classmethod
    def parse(cls, raw: bytes):
        """The body as this model, or ApiError 400 naming the first field at fault."""
        try:
            return cls.model_validate_json(raw)
        except ValidationError as err:
            raise _invalid(err) from None


class Turn(NamedTuple):
    """A chat message as the generation path takes it."""

    role: str
    content: str


class ContentPart(Body):
    type: str
    text: str | None = None


class ChatMessage(Body):
    role: str
    content: str | list[ContentPart] | None = None

    def turn(self, index: int) -> Turn:
        """Text parts are joined by newlines (as vLLM does); no content (an assistant turn that
        called tools) is empty text."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise ApiError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "only text content parts are supported (type 'text' with 'text')",
                    param=f"messages[{index}].content",
                )
            content = "\n".join(part.text or "" for part in content)
        return Turn(self.role, content or "")


class StreamOptions(Body):
    include_usage: bool = False


class Sampling(Body):
    """The fields completions and chat completions share."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=U32_MAX)  # an extension; -1 or 0 = off (vLLM: -1)
    seed: int | None = Field(None, ge=0, le=U64_MAX)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # an extension, as in vLLM
    cache_salt: str | None = None  # vLLM's: only requests of equal salt share cached KV blocks

    # ranges are checked with the gRPC API's (llmserve/runtime/request_checks.py)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # an extension, as in vLLM
    min_p: float | None = None  # an extension, as in vLLM
    min_tokens: int | None = Field(None, ge=0, le=U32_MAX)  # an extension, as in vLLM
    logit_bias: dict[str, float] | None = None  # token id (a JSON key: a string) -> bias
    stop_token_ids: list[int] | None = None  # an extension, as in vLLM
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        problem = choices_problem(self.n)
        if problem is not None:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, problem, param="n")
        for name, neutral in NOT_YET.items():
            if getattr(self, name) not in neutral:
                raise ApiError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{name} is not supported yet; leave it out (or at {neutral[1]!r})",
                    param=name,
                )

    def top_logprobs_asked(self) -> int | None:
        """Alternatives to return with each token's logprob; None: no logprobs."""
        return None

    def choices(self, job: GenerateInput) -> list[GenerateInput]:
        """One request per choice (gateway.choices)."""
        return choice_inputs(job, self.n)

    def sampling(self, max_tokens: int | None) -> dict[str, Any]:
        """The GenerateInput fields of the sampling settings."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return dict(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=0 if self.top_k == -1 else self.top_k,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty,
            stop_token_ids=_token_ids(self.stop_token_ids or [], "stop_token_ids"),
            min_tokens=self.min_tokens or 0,
            logit_bias=_logit_bias(self.logit_bias or {}),
            logprobs=self.top_logprobs_asked(),
            cache_salt=self.cache_salt or "",
        )


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def top_logprobs_asked(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ApiError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "top_logprobs needs logprobs set to true",
                    param="top_logprobs",
                )
            return None
        return self.top_logprobs or 0

    def generate_input(self) -> GenerateInput:
        self.check_supported()
        turns = [m.turn(i) for i, m in enumerate(self.messages)]
        limit = self.max_completion_tokens
        limit = self.max_tokens if limit is None else limit
        return GenerateInput(messages=turns, **self.sampling(limit))


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def generate_input(self) -> GenerateInput:
        self.check_supported()
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            what = "several prompts" if all(isinstance(p, str) for p in prompt) else "token ids"
            raise ApiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt holds {what}; only one text prompt per request is supported",
                param="prompt",
            )
        return GenerateInput(prompt=prompt, **self.sampling(self.max_tokens))


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    def generate_input(self) -> GenerateInput:
        messages = self.messages
        turns = None if messages is None else [m.turn(i) for i, m in enumerate(messages)]
        return GenerateInput(prompt=self.prompt, messages=turns)


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


def _token_ids(ids: list[int], param: str) -> list[int]:
    if any(not 0 <= i <= U32_MAX for i in ids):
        message = f"{param} holds an id that is not a token id (0 or more)"
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param=param)
    return ids


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's keys are token ids written as strings: ASCII digits only (`int` would also take
    " 3 ", "1_0" and other scripts' digits such as "١")."""
    for key in bias:
        if not (key.isascii() and key.isdigit()):
            raise ApiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"logit_bias key {key!r} is not a token id: write each id in digits 0-9",
                param="logit_bias",
            )
    out = {int(key): value for key, value in bias.items()}
    _token_ids(list(out), "logit_bias")
    return out


def _invalid(err: ValidationError) -> ApiError:
    first = err.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"the body is not JSON: {first['msg']}")
    param = ""
    for part in first["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.lower() not in TYPE_TAGS and not any(c in part for c in "[-("):
            param += f".{part}" if param else part
    got = type(first.get("input")).__name__.replace("NoneType", "null")
    message = f"{param or 'the body'}: {first['msg']}" + (
        "" if first["type"] == "missing" else f" (got {got})"
    )
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param=param or None)
