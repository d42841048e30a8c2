"""Tools on the chat completions API: OpenAI's `tools` and `tool_choice` (none, auto, required,
a named function), read into a ToolPlan (docs/structured-output.md, *Tools*).

- required / a named function: the answer is generated under a JSON grammar of
  `{"name": NAME, "arguments": ARGS}` where ARGS follows that function's `parameters` schema (one
  of the tools' for required): every call is valid JSON of the right shape.
- auto: the tools are described in a system prompt (Hermes' format, `SYSTEM_FORMAT`); the
  model's `<tool_call>{...}</tool_call>` blocks are parsed (`parse_calls`, tolerant: text without
  a call is a normal answer).
- none (or no tools): the tools are neither described nor called (as vLLM does by default).

Pure logic: no grpc, no torch."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from llmserve.v1 import common_pb2

Grammar = common_pb2.Grammar
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
ANY_OBJECT = {"type": "object"}
SYSTEM_FORMAT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions. Here are the "
    "available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)
CALL_TAG = "<tool_call>"
CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# a forced call as its grammar writes it (no free whitespace): the head before the arguments
FORCED_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]+)", "arguments": ')


class ToolsProblem(ValueError):
    """A malformed `tools` or `tool_choice`: the message, and the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]
    at: str = "tools"  # where the request holds it: tools[i]

    def parameters_grammar(self) -> common_pb2.Grammar:
        """Its parameters' schema as a grammar (checked alone to name the tool at fault)."""
        return Grammar(kind=Grammar.JSON_SCHEMA, spec=json.dumps(self.parameters))

    def described(self) -> dict[str, Any]:
        body: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            body["description"] = self.description
        return {"type": "function", "function": body}

    def call_schema(self) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"name": {"const": self.name}, "arguments": self.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    """One entry of OpenAI's `message.tool_calls` (arguments: JSON text)."""
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a request uses its tools: `forced` (required or named: `functions` are the ones it
    may call) or auto (`functions` described in the prompt, the answer parsed)."""

    functions: tuple[Function, ...]
    forced: bool

    def grammar(self) -> common_pb2.Grammar | None:
        """The grammar of one call of one of `functions` (forced only)."""
        if not self.forced:
            return None
        schemas = [f.call_schema() for f in self.functions]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return Grammar(kind=Grammar.JSON_SCHEMA, spec=json.dumps(schema))

    def system_prompt(self) -> str | None:
        """The tools described for the model (auto only)."""
        if self.forced:
            return None
        lines = "\n".join(json.dumps(f.described(), ensure_ascii=False) for f in self.functions)
        return SYSTEM_FORMAT.format(tools=lines)

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a whole answer; no calls: the text is the content."""
        if self.forced:
            call = forced_call(text)
            return (text, []) if call is None else (None, [call])
        return parse_calls(text, {f.name for f in self.functions})

    def stream(self) -> CallStream:
        return ForcedStream() if self.forced else AutoStream(plan=self)


def forced_call(text: str) -> dict[str, Any] | None:
    """The call a forced answer holds, its arguments as generated; None if cut short."""
    head = FORCED_HEAD.match(text)
    try:
        body = json.loads(text)
    except ValueError:
        return None
    if head is None or not isinstance(body, dict) or not text.endswith("}"):
        return None
    return tool_call(head.group(1), text[head.end() : -1])


def parse_calls(text: str, known: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """The `<tool_call>` blocks of an auto answer that call a known function (arguments an
    object or its JSON text, also under "parameters"; a last block may lack its closing tag);
    the rest of the text is the content (None when empty). A bare JSON call is one too."""
    calls, kept, at = [], [], 0
    for block in CALL_BLOCK.finditer(text):
        call = _call_of(block.group(1), known)
        if call is None:
            continue
        kept.append(text[at : block.start()])
        at = block.end()
        calls.append(call)
    kept.append(text[at:])
    if not calls:
        bare = _call_of(text.strip(), known)
        return (None, [bare]) if bare else (text, [])
    content = "".join(kept).strip()
    return content or None, calls


def _call_of(body: str, known: set[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in known:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return tool_call(value["name"], json.dumps(arguments, ensure_ascii=False))


# ---- streaming ------------------------------------------------------------------------------


@dataclass(slots=True)
class CallStream:
    """A choice's deltas as its text comes: `feed` and `end` give OpenAI's chat deltas
    ({"content": ...} or {"tool_calls": [...]}); `called` once a call was sent."""

    called: bool = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def end(self) -> list[dict[str, Any]]:
        raise NotImplementedError


@dataclass(slots=True)
class ForcedStream(CallStream):
    """A forced call streamed as OpenAI streams one: a first delta with index, id, type, the
    name and empty arguments, then the arguments' text in fragments (the call's closing brace,
    held back one character at a time, is not part of them)."""

    head: str = ""
    held: str = ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        out = []
        if not self.called:
            self.head += text
            match = FORCED_HEAD.match(self.head)
            if match is None:
                return []
            self.called = True
            name, text = match.group(1), self.head[match.end() :]
            out.append({"tool_calls": [{"index": 0} | tool_call(name, "")]})
        pending = self.held + text
        fragment, self.held = pending[:-1], pending[-1:]
        if fragment:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]})
        return out

    def end(self) -> list[dict[str, Any]]:
        if not self.called:  # cut short before the name: what came, as text
            return [{"content": self.head}] if self.head else []
        if self.held and self.held != "}":  # cut short inside the arguments
            return [{"tool_calls": [{"index": 0, "function": {"arguments": self.held}}]}]
        return []


@dataclass(slots=True)
class AutoStream(CallStream):
    """An auto answer's text is streamed as content until a `<tool_call>` begins (or until
    what may be its beginning, and trailing whitespace, are held back; an answer that starts
    with `{`, perhaps a bare JSON call, is held whole); at the end the answer is parsed
    (`parse_calls`) and the rest of its content and each call (its head, then its arguments
    whole) are sent."""

    plan: ToolPlan | None = None
    sent: str = ""  # the content sent so far
    unsent: str = ""
    holding: bool = False  # a call may have begun: nothing more is sent before the end

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.unsent += text
        if self.holding:
            return []
        if not self.sent and self.unsent.lstrip().startswith("{"):
            self.holding = True
            return []
        at = self.unsent.find(CALL_TAG)
        if at >= 0:
            self.holding = True
            ready = self.unsent[:at].rstrip()
        else:
            ready = _before_a_tag(self.unsent).rstrip()
        if not self.sent:
            ready = ready.lstrip()  # as the parsed content is, when it holds calls
        if not ready:
            return []
        self.sent += ready
        self.unsent = self.unsent[self.unsent.index(ready) + len(ready) :]
        return [{"content": ready}]

    def end(self) -> list[dict[str, Any]]:
        assert self.plan is not None
        content, calls = self.plan.calls(self.sent + self.unsent)
        if not calls:  # a normal answer: what was held back, as it came
            rest = self.unsent if self.sent else self.unsent.lstrip()
        else:
            rest = content[len(self.sent) :] if content else ""
        out: list[dict[str, Any]] = [{"content": rest}] if rest else []
        for index, call in enumerate(calls):
            function = call["function"]
            head = {"index": index} | tool_call(function["name"], "", call["id"])
            out.append({"tool_calls": [head]})
            arguments = {"index": index, "function": {"arguments": function["arguments"]}}
            out.append({"tool_calls": [arguments]})
        self.called = bool(calls)
        return out


def _before_a_tag(text: str) -> str:
    """`text` less a last part that may begin `<tool_call>`."""
    for size in range(min(len(CALL_TAG) - 1, len(text)), 0, -1):
        if CALL_TAG.startswith(text[-size:]):
            return text[:-size]
    return text


# ---- the request's fields -------------------------------------------------------------------


def tool_plan(tools: Any, choice: Any) -> ToolPlan | None:
    """The plan of `tools` and `tool_choice` as sent; None: no tools in play (none, or none
    given). ToolsProblem naming the field when malformed."""
    if tools is None:
        if choice not in (None, "none"):
            raise ToolsProblem("tool_choice needs tools", "tool_choice")
        return None
    functions = _functions(tools)
    if choice is None or choice == "auto":
        return ToolPlan(functions, forced=False) if functions else None
    if choice == "none":
        return None
    if not functions:
        raise ToolsProblem("tool_choice asks for a call and tools is empty", "tools")
    if choice == "required":
        return ToolPlan(functions, forced=True)
    named = _named(choice)
    chosen = tuple(f for f in functions if f.name == named)
    if not chosen:
        raise ToolsProblem(
            f"tool_choice names the function {named!r}, which is not in tools",
            "tool_choice.function.name",
        )
    return ToolPlan(chosen, forced=True)


def _named(choice: Any) -> str:
    if isinstance(choice, str):
        raise ToolsProblem(
            f"tool_choice {choice!r} is not one of none, auto, required or a named function",
            "tool_choice",
        )
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"):
        raise ToolsProblem(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolsProblem("tool_choice.function needs a name", "tool_choice.function.name")
    return function["name"]


def _functions(tools: Any) -> tuple[Function, ...]:
    if not isinstance(tools, list):
        raise ToolsProblem("tools must be a list of functions", "tools")
    functions = tuple(_function(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ToolsProblem(f"two tools are named {name!r}", f"tools[{i}].function.name")
    return functions


def _function(tool: Any, at: str) -> Function:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ToolsProblem(
            f'{at} must be {{"type": "function", "function": {{...}}}}', f"{at}.type"
        )
    body = tool.get("function")
    if not isinstance(body, dict):
        raise ToolsProblem(f"{at}.function must be an object", f"{at}.function")
    name = body.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        message = f"{at}.function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -"
        raise ToolsProblem(message, f"{at}.function.name")
    description = body.get("description") or ""
    if not isinstance(description, str):
        raise ToolsProblem(
            f"{at}.function.description must be a string", f"{at}.function.description"
        )
    parameters = body.get("parameters", ANY_OBJECT)
    if not isinstance(parameters, dict):
        message = f"{at}.function.parameters must be a JSON Schema object"
        raise ToolsProblem(message, f"{at}.function.parameters")
    return Function(name, description, parameters, at)
