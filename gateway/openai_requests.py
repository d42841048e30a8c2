"""Request bodies of the OpenAI-compatible HTTP API, as pydantic models: the fields the gateway
serves, strictly typed (a wrong type is a 400 naming the field), unknown fields ignored as
OpenAI's servers do. Ranges and defaults are the gateway's own validation (gateway/validation.py),
the same for HTTP and gRPC; what is checked here is what JSON can say and protobuf cannot."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, ClassVar, NamedTuple

import grpc
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.choices import U64_MAX, choice_inputs, choices_problem
from gateway.http_errors import ApiError
from gateway.intake import GenerateInput
from gateway.structured import VLLM_KINDS, checked, from_response_format, from_vllm, invalid
from gateway.tools import ToolPlan, ToolsProblem
from gateway.tools import tool_plan as plan_of
from llmcommon.sampling import MAX_LOGPROBS, SamplingParams
from llmcommon.sampling_wire import grammar_of
from llmcommon.v1 import common_pb2

U32_MAX = 2**32 - 1
TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's union members
# Fields of OpenAI's API (and vLLM's) that would change the result and that the gateway does
# not implement yet, with their neutral values: a request that sets one to anything else is
# refused (400 naming it), not served as if it had not asked (a client reading logprobs that
# never come, a penalty silently off). Structured output and tools are not listed here: they
# have their own module (gateway/structured.py).
NOT_YET: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False, 0),
    "suffix": (None, ""),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "return_tokens_as_token_ids": (None, False),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "spaces_between_special_tokens": (None, True),
    "logits_processors": (None, []),
    "modalities": (None, ["text"]),
    "audio": (None,),
}
CHAT_NOT_YET: dict[str, tuple[Any, ...]] = {
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
    "add_special_tokens": (None, False),
    # OpenAI's deprecated forms of tools and tool_choice: their answer (`message.function_call`)
    # is not written; ignored, a client would get text where it asked for a call
    "functions": (None, []),
    "function_call": (None, "none"),
}
INSTEAD = {"functions": " and send tools", "function_call": " and send tool_choice"}
COMPLETION_NOT_YET: dict[str, tuple[Any, ...]] = {"add_special_tokens": (None, True)}


class StructuredFields(BaseModel):
    """The request fields of structured output, as sent (checked by `grammar`)."""

    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    def grammar(self) -> common_pb2.Grammar | None:
        """The one grammar the request asks for, or None; ApiError 400 naming the field."""
        outputs = self.structured_outputs
        if outputs is not None and not isinstance(outputs, dict):
            raise invalid("structured_outputs must be an object", "structured_outputs")
        unknown = sorted(set(outputs or {}) - set(VLLM_KINDS) - {"disable_any_whitespace"})
        if unknown:
            message = (
                f"structured_outputs.{unknown[0]} is not supported (json, regex, choice, grammar)"
            )
            raise invalid(message, f"structured_outputs.{unknown[0]}")
        asked = [
            g
            for g in (
                from_response_format(self.response_format),
                from_vllm({k: (outputs or {}).get(k) for k in VLLM_KINDS}, "structured_outputs."),
                from_vllm({k: getattr(self, f"guided_{k}") for k in VLLM_KINDS}, "guided_"),
            )
            if g is not None
        ]
        if len(asked) > 1:
            message = (
                "ask for one structured output: response_format, structured_outputs or guided_*"
            )
            raise invalid(message, "response_format")
        return asked[0] if asked else None


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
    """A chat message as the generation path takes it; `extra`: what else the chat template
    gets (an assistant turn's tool_calls, a tool result's tool_call_id and name)."""

    role: str
    content: str
    extra: dict[str, Any] | None = None


class ContentPart(Body):
    type: str
    text: str | None = None


class FunctionCall(Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Body):
    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: the call it answers

    def turn(self, index: int) -> Turn:
        """Text parts are joined by newlines (as vLLM does); null content is empty text. The
        content may be left out only by an assistant turn that called tools (OpenAI's rule):
        elsewhere a message without it is a client's bug, refused rather than served empty."""
        if "content" not in self.model_fields_set and not (
            self.role == "assistant" and self.tool_calls
        ):
            raise ApiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Missing required parameter: 'messages[{index}].content'",
                param=f"messages[{index}].content",
            )
        if self.role == "tool" and self.tool_call_id is None:
            raise ApiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a tool message needs the tool_call_id of the call it answers",
                param=f"messages[{index}].tool_call_id",
            )
        if self.tool_calls and self.role != "assistant":
            raise ApiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"only an assistant message carries tool_calls, not a {self.role!r} one",
                param=f"messages[{index}].tool_calls",
            )
        extra: dict[str, Any] = {}
        if self.tool_calls:
            extra["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            extra["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            extra["name"] = self.name
        return Turn(self.role, self._text(index), extra or None)

    def _text(self, index: int) -> str:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise ApiError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "only text content parts are supported (type 'text' with 'text')",
                    param=f"messages[{index}].content",
                )
            content = "\n".join(part.text or "" for part in content)
        return content or ""


class StreamOptions(Body):
    include_usage: bool | None = False  # null: false, as every optional field of OpenAI's
    continuous_usage_stats: bool | None = False  # vLLM's: every chunk carries the usage so far


class Sampling(StructuredFields, Body):
    """The fields completions and chat completions share."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=U32_MAX)  # an extension; -1 or 0 = off (vLLM: -1)
    seed: int | None = Field(None, ge=0, le=U64_MAX)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False  # null: false (OpenAI's schema has it nullable)
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # an extension, as in vLLM (null: false)
    cache_salt: str | None = None  # vLLM's: only requests of equal salt share cached KV blocks
    priority: Any = None  # vLLM's (lower first); checked with gRPC's (gateway/request_tenancy.py)
    slo_class: str | None = None  # an --slo-classes class; None: the API key's default
    user: str | None = None  # OpenAI's end-user id: what --router session sticks by (--cells)

    # ranges are checked with the gRPC API's (llmcommon/sampling.py)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # an extension, as in vLLM
    min_p: float | None = None  # an extension, as in vLLM
    min_tokens: int | None = Field(None, ge=0, le=U32_MAX)  # an extension, as in vLLM
    logit_bias: dict[str, float] | None = None  # token id (a JSON key: a string) -> bias
    stop_token_ids: list[int] | None = None  # an extension, as in vLLM
    include_stop_str_in_output: bool | None = False  # vLLM's: the stop string ends the text
    skip_special_tokens: bool | None = True  # vLLM's: the text leaves out special tokens
    # not implemented yet: refused unless neutral (NOT_YET)
    best_of: Any = None
    echo: Any = None
    suffix: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    spaces_between_special_tokens: Any = None
    logits_processors: Any = None
    modalities: Any = None
    audio: Any = None
    add_special_tokens: Any = None

    not_yet: ClassVar[dict[str, tuple[Any, ...]]] = NOT_YET

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        options = self.stream_options
        return self.include_usage and bool(options and options.continuous_usage_stats)

    def check_supported(self) -> None:
        problem = choices_problem(self.n)
        if problem is not None:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, problem, param="n")
        if self.stream_options is not None and not self.stream:
            message = "stream_options is only allowed when stream is true"  # OpenAI's and vLLM's
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param="stream_options")
        for name, neutral in self.not_yet.items():
            if getattr(self, name) not in neutral:
                at = f" (or at {json.dumps(neutral[1])})" if len(neutral) > 1 else ""
                message = f"{name} is not supported yet; leave it out{at}{INSTEAD.get(name, '')}"
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param=name)

    def top_logprobs_asked(self) -> int | None:
        """Alternatives to return with each token's logprob; None: no logprobs."""
        return None

    def choices(self, job: GenerateInput) -> list[GenerateInput]:
        """One request per choice (gateway.choices)."""
        return choice_inputs(job, self.n)

    def tool_plan(self) -> ToolPlan | None:
        """How the request uses tools (chat completions only: gateway/tools.py)."""
        return None

    def check_vocabulary(self, vocab_size: int) -> None:
        """Token ids of logit_bias and stop_token_ids within the model's vocabulary (the
        tokenizer's, as /detokenize takes them): else 400 naming the field (the scheduler's
        own check names neither)."""
        for name, ids in (
            ("logit_bias", [int(k) for k in self.logit_bias or {} if k.isascii() and k.isdigit()]),
            ("stop_token_ids", self.stop_token_ids or []),
        ):
            outside = [i for i in ids if i >= vocab_size]
            if outside:
                message = (
                    f"{name} holds the token id {outside[0]}, outside the vocabulary 0.."
                    f"{vocab_size - 1}"
                )
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param=name)

    def params(self, max_tokens: int | None) -> SamplingParams:
        """The sampling settings as sent, OpenAI's (and vLLM's) names mapped to SamplingParams'
        (the one mapping; unset: its default). Checked by the gateway's validation, as gRPC's."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        grammar = self.grammar()  # response_format, structured_outputs, guided_*
        sent = dict(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=0 if self.top_k == -1 else self.top_k,
            seed=self.seed,
            stop=stop,
            ignore_eos=bool(self.ignore_eos),
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop_token_ids=_token_ids(self.stop_token_ids or [], "stop_token_ids"),
            min_tokens=self.min_tokens,
            logit_bias=_logit_bias(self.logit_bias or {}),
            logprobs=self.top_logprobs_asked(),
            grammar=None if grammar is None else grammar_of(grammar),
        )
        return SamplingParams(**{k: v for k, v in sent.items() if v is not None})

    def job(self, max_tokens: int | None) -> dict[str, Any]:
        """The GenerateInput fields but the prompt: the sampling settings and the HTTP API's."""
        return dict(
            sampling=self.params(max_tokens),
            cache_salt=self.cache_salt or "",
            priority=self.priority,
            slo_class=self.slo_class or "",
            session=self.user or "",
            fit_context=True,
            include_stop=bool(self.include_stop_str_in_output),
            skip_special_tokens=self.skip_special_tokens is not False,
        )


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None
    tools: Any = None  # checked by gateway/tools.py
    tool_choice: Any = None
    functions: Any = None  # refused (CHAT_NOT_YET): tools
    function_call: Any = None  # refused (CHAT_NOT_YET): tool_choice
    parallel_tool_calls: bool | None = None  # None: true (several calls may come)

    not_yet: ClassVar[dict[str, tuple[Any, ...]]] = NOT_YET | CHAT_NOT_YET

    def tool_plan(self) -> ToolPlan | None:
        try:
            return plan_of(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolsProblem as err:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, str(err), param=err.param) from None

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
        if limit is not None and limit <= 0:  # named as sent (it wins over max_tokens)
            message = f"max_completion_tokens is {limit}; it must be at least 1"
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param="max_completion_tokens")
        limit = self.max_tokens if limit is None else limit
        fields = self.job(limit)
        plan = self.tool_plan()
        if plan is not None and plan.forced:
            sampling = fields["sampling"]
            if sampling.grammar is not None:
                message = "tool_choice forces a call: leave response_format and the like out"
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param="tool_choice")
            for function in plan.functions:
                checked(function.parameters_grammar(), f"{function.at}.function.parameters")
            grammar = grammar_of(checked(plan.grammar(), "tools"))
            fields["sampling"] = replace(sampling, grammar=grammar)
        tools = plan.described() if plan is not None else []  # to the chat template
        return GenerateInput(messages=turns, tools=tools, **fields)


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's and vLLM's default here; null: the rest of the context
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token

    not_yet: ClassVar[dict[str, tuple[Any, ...]]] = NOT_YET | COMPLETION_NOT_YET

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
        return GenerateInput(prompt=prompt, **self.job(self.max_tokens))


class TokenizeRequest(Body):
    """A prompt or a chat as the completions or chat completions route would render it: with the
    chat's `tools`, `tool_choice` and `parallel_tool_calls` (the tools the chat template gets:
    none for `none`, the named one alone for a named choice), so that `count` is the chat's
    usage.prompt_tokens. A grammar (`response_format`, ...) adds nothing to the prompt. The
    fields that would render it otherwise and are not implemented are refused, as on the chat."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: Any = None  # checked by gateway/tools.py
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None
    add_special_tokens: Any = None

    def generate_input(self) -> GenerateInput:
        messages = self.messages
        not_yet = COMPLETION_NOT_YET if messages is None else CHAT_NOT_YET
        for name, neutral in not_yet.items():
            if getattr(self, name, None) not in neutral:
                at = f" (or at {json.dumps(neutral[1])})" if len(neutral) > 1 else ""
                message = f"{name} is not supported yet; leave it out{at}"
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param=name)
        if messages is None:
            if self.tools is not None or self.tool_choice is not None:
                param = "tools" if self.tools is not None else "tool_choice"
                message = f"{param} goes with messages (a chat), not with a prompt"
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param=param)
            return GenerateInput(prompt=self.prompt)
        try:
            plan = plan_of(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolsProblem as err:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, str(err), param=err.param) from None
        turns = [m.turn(i) for i, m in enumerate(messages)]
        tools = plan.described() if plan is not None else []
        return GenerateInput(prompt=self.prompt, messages=turns, tools=tools)


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
    """400 naming the first field at fault. Where it failed every member of a union (`stop`: a
    string or a list of strings), the member that got deepest names the fault (`stop[1]` of
    ["a", 1], not `stop` for not being a string)."""
    errors = err.errors(include_url=False)
    first = errors[0]
    union = next((i for i, part in enumerate(first["loc"]) if _member(part)), None)
    if union is not None:  # the same union's members: the first of the deepest
        at = first["loc"][:union]
        members = [e for e in errors if e["loc"][:union] == at and _member(e["loc"][union:][:1])]
        first = max(members, key=lambda e: len(_param_of(e["loc"])))
    if first["type"] == "json_invalid":
        return ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"the body is not JSON: {first['msg']}")
    param = "".join(_param_of(first["loc"]))
    got = type(first.get("input")).__name__.replace("NoneType", "null")
    message = f"{param or 'the body'}: {first['msg']}" + (
        "" if first["type"] == "missing" else f" (got {got})"
    )
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param=param or None)


def _member(part: Any) -> bool:
    """Does a pydantic error's location part name a union's member (`str`, `list[str]`)? A
    one-part tuple: its part."""
    if isinstance(part, tuple):
        return bool(part) and _member(part[0])
    return isinstance(part, str) and (part.lower() in TYPE_TAGS or any(c in part for c in "[-("))


def _param_of(loc: tuple) -> list[str]:
    """The parts of the field a pydantic error's location names (its union members left out)."""
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif not _member(part):
            parts.append(f".{part}" if parts else part)
    return parts
