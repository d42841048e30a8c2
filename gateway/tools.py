"""Tools on the chat completions API: OpenAI's `tools` and `tool_choice` (none, auto, required,
a named function), read into a ToolPlan (docs/structured-output.md, *Tools*).

- required / a named function: the answer is generated under a JSON grammar of
  `{"name": NAME, "arguments": ARGS}` where ARGS follows that function's `parameters` schema (one
  of the tools' for required): every call is valid JSON of the right shape. Required with
  `parallel_tool_calls` true or absent: a JSON array of one or more such calls.
- auto: the tools go to the chat template (`described`): the template's own tool format where it
  has one, else a system prompt in Hermes' format (gateway/tokenizer.py). The model's
  `<tool_call>{...}</tool_call>` blocks, the calls after Mistral's `[TOOL_CALLS]` or Llama
  3.1's `<|python_tag|>`, or plain JSON calls (one object, several, or an array: Llama 3.1's
  form, `parameters` for `arguments`), are parsed (`parse_calls`, tolerant: text without a
  call is a normal answer); with `parallel_tool_calls` false only the first call. Streamed, a
  `<tool_call>` block is held until its closing tag and judged as the whole answer's parse
  judges it (`AutoStream`): streamed and whole answers agree.
- none (or no tools): the tools are neither described nor called (as vLLM does by default).

Pure logic: no grpc, no torch."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from llmcommon.errors import RequestProblem
from llmcommon.v1 import common_pb2

Grammar = common_pb2.Grammar
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
ANY_OBJECT = {"type": "object"}
CALL_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
# a template's own mark before its plain JSON calls: Mistral's (also `NAME[ARGS]{...}`), Llama
# 3.1's (where the detokenizer keeps special tokens; without them the calls are plain JSON)
MARKERS = ("[TOOL_CALLS]", "<|python_tag|>")
ARGS_FORM = re.compile(r"\s*([A-Za-z0-9_-]{1,64})\[ARGS\]")
# a Hermes block's head, streamed once whole: `{"name": NAME, "arguments": {` (call_head)
HEAD_PARTS = ("{", '"name"', ":", "NAME", ",", '"arguments"|"parameters"', ":", "{")
HEAD_NAME = re.compile(r'"([A-Za-z0-9_-]*)("?)')
CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# a forced call as its grammar writes it (no free whitespace): the head before the arguments,
# alone or in an array of calls (after its `[` or a `, `)
NEXT_HEAD = re.compile(r'\s*[\[,]?\s*\{"name": "([A-Za-z0-9_-]+)", "arguments": ')


class ToolsProblem(RequestProblem, ValueError):
    """A malformed `tools` or `tool_choice`: the message, and the field at fault."""


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
        body: dict[str, Any] = {"name": self.name}
        if self.description:
            body["description"] = self.description
        return {"type": "function", "function": body | {"parameters": self.parameters}}

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
    may call) or auto (`functions` described in the prompt, the answer parsed); `parallel`: an
    answer may hold several calls (a forced one is then an array of calls)."""

    functions: tuple[Function, ...]
    forced: bool
    parallel: bool = False

    def grammar(self) -> common_pb2.Grammar | None:
        """The grammar of one call of one of `functions`, or of one or more (forced only)."""
        if not self.forced:
            return None
        schemas = [f.call_schema() for f in self.functions]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        if self.parallel:
            schema = {"type": "array", "items": schema, "minItems": 1}
        return Grammar(kind=Grammar.JSON_SCHEMA, spec=json.dumps(schema))

    def described(self) -> list[dict[str, Any]]:
        """The tools as OpenAI describes them, for the chat template: forced or not, the model
        sees what it may call (their descriptions and parameters), as OpenAI's and vLLM's do;
        a forced call's grammar then holds it to one of them."""
        return [f.described() for f in self.functions]

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a whole answer; no calls: the text is the content. A forced
        answer has no content (its text is the grammar's JSON, not the model's words): its
        calls, the last one cut short with the arguments generated so far (as streamed)."""
        if self.forced:
            return None, forced_calls(text)
        content, calls = parse_calls(text, {f.name for f in self.functions})
        return content, calls if self.parallel else calls[:1]

    def stream(self) -> CallStream:
        return ForcedStream() if self.forced else AutoStream(plan=self)


def forced_call(text: str) -> dict[str, Any] | None:
    """The call a forced answer of one call holds, its arguments as generated; None if cut
    short."""
    stream = ForcedStream()
    stream.feed(text)
    stream.end()
    whole = len(stream.done) == 1 and not stream.cut and text.lstrip().startswith("{")
    return stream.done[0] if whole else None


def forced_calls(text: str) -> list[dict[str, Any]]:
    """The calls a forced answer holds (one call, or an array of calls), their arguments as
    generated; of an answer cut short, every call whose name came, the last one with the
    arguments generated before the cut (as streamed: OpenAI's and vLLM's answer to a call cut
    by max_tokens). None before the first call's name."""
    stream = ForcedStream()
    stream.feed(text)
    stream.end()
    return stream.done


def parse_calls(text: str, known: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """The `<tool_call>` blocks of an auto answer that call a known function (arguments an
    object or its JSON text, also under "parameters"; a last block may lack its closing tag);
    the rest of the text is the content (None when empty). A bare JSON call is one too."""
    outside, calls = split_calls(text, known)
    if not calls:
        marked = _marked_calls(text, known)
        if marked is not None:
            return marked
        bare = _bare_calls(text.strip(), known)
        return (None, bare) if bare else (text, [])
    return outside.strip() or None, calls


def _marked_calls(text: str, known: set[str]) -> tuple[str | None, list[dict[str, Any]]] | None:
    """(content, calls) of an answer whose calls follow a MARKERS mark (each call, or the array
    of them, after it); None: no such calls. The text before the first mark is the content."""
    for marker in MARKERS:
        at = text.find(marker)
        if at < 0:
            continue
        calls: list[dict[str, Any]] = []
        for part in text[at:].split(marker)[1:]:
            found = _args_form(part, known) or _bare_calls(part.strip(), known)
            if not found:
                return None
            calls += found
        return text[:at].strip() or None, calls
    return None


def _args_form(part: str, known: set[str]) -> list[dict[str, Any]]:
    """Mistral's newer `NAME[ARGS]{...}` call (after its mark), as a list of one or none."""
    match = ARGS_FORM.match(part)
    if match is None:
        return []
    call = _call_of({"name": match.group(1), "arguments": part[match.end() :].strip()}, known)
    return [call] if call else []


def split_calls(text: str, known: set[str]) -> tuple[str, list[dict[str, Any]]]:
    """The calls of `text`'s `<tool_call>` blocks that call a known function, and the text
    outside those blocks."""
    calls, kept, at = [], [], 0
    for block in CALL_BLOCK.finditer(text):
        call = _call_text_of(block.group(1), known)
        if call is None:
            continue
        kept.append(text[at : block.start()])
        at = block.end()
        calls.append(call)
    kept.append(text[at:])
    return "".join(kept), calls


def _bare_calls(text: str, known: set[str]) -> list[dict[str, Any]]:
    """Plain JSON calls, the whole answer: one object, an array of them, or several objects
    one after another (apart by whitespace, `;` or `,`); none unless each is a known call."""
    values, at, decoder = [], 0, json.JSONDecoder()
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return []
        values += value if isinstance(value, list) else [value]
        at = len(text) - len(text[at:].lstrip(" \t\r\n;,"))
    calls = [_call_of(value, known) for value in values]
    return [] if not calls or None in calls else calls  # type: ignore[return-value]


def _call_text_of(body: str, known: set[str]) -> dict[str, Any] | None:
    """The call of a block's JSON; arguments written as an object keep their text as written
    (what a stream of the block sends)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    call = _call_of(value, known)
    head = call_head(body)
    if call is not None and isinstance(head, tuple):
        start = head[1]
        end = json.JSONDecoder().raw_decode(body, start)[1]
        call["function"]["arguments"] = body[start:end]
    return call


def _call_of(value: Any, known: set[str]) -> dict[str, Any] | None:
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
    """Forced calls (one, or an array of them) streamed as OpenAI streams them: for each call a
    first delta with its index, id, type, the name and empty arguments, then the arguments'
    text in fragments as it comes (the scan of the JSON tells where they end). `done`: the calls
    whose name came, their arguments as far as they came; `cut`: the last one's did not end.
    What comes before the first name is the grammar's JSON, not the model's words: not sent."""

    text: str = ""  # all that came
    at: int = 0  # scanned up to here
    index: int = -1  # the call being streamed
    inside: bool = False  # in a call's arguments
    scan: JsonEnd = field(default_factory=lambda: JsonEnd(depth=1))  # of the arguments
    done: list[dict[str, Any]] = field(default_factory=list)
    cut: bool = False  # the answer ended inside the last call's arguments

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        out: list[dict[str, Any]] = []
        while True:
            if not self.inside and not self._head(out):
                return out
            if self.inside and not self._arguments(out):
                return out

    def _head(self, out: list[dict[str, Any]]) -> bool:
        match = NEXT_HEAD.match(self.text, self.at)
        if match is None:
            return False
        self.index, self.inside, self.called = self.index + 1, True, True
        self.at, self.scan = match.end(), JsonEnd(depth=1)  # past the arguments' `{`
        self.done.append(tool_call(match.group(1), ""))
        head = {"index": self.index} | tool_call(match.group(1), "", self.done[-1]["id"])
        out.append({"tool_calls": [head]})
        return True

    def _arguments(self, out: list[dict[str, Any]]) -> bool:
        """Scan to the end of the arguments (True) or of the text (False)."""
        start, end = self.at, self.scan.end_in(self.text, self.at)
        ended = end is not None
        self.at = len(self.text) if end is None else end
        fragment = self.text[start : self.at]
        if fragment:
            self.done[-1]["function"]["arguments"] += fragment
            out.append({"tool_calls": [{"index": self.index, "function": {"arguments": fragment}}]})
        if ended:
            self.at += 1  # the call's closing brace
            self.inside = False
        return ended

    def end(self) -> list[dict[str, Any]]:
        """Nothing more to send: a call cut short inside its arguments stays a call with the
        arguments sent so far (finish_reason `length`), as OpenAI and vLLM answer one; an
        answer cut before the first name has no call and no content."""
        self.cut = self.inside
        return []


@dataclass(slots=True)
class JsonEnd:
    """Where a JSON object or array ends, fed one character at a time from its first."""

    depth: int = 0
    quoted: bool = False  # in a string
    escaped: bool = False

    def ends_at(self, char: str) -> bool:
        """Does the value end with `char`?"""
        if self.quoted:
            was = self.escaped
            self.escaped = not was and char == "\\"
            self.quoted = was or char != '"'
        elif char == '"':
            self.quoted = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            return self.depth == 0
        return False

    def end_in(self, text: str, start: int) -> int | None:
        """Where in `text`, fed from `start` on, the value ends (its last character); None:
        not within it (what was fed is remembered)."""
        for at in range(start, len(text)):
            if self.ends_at(text[at]):
                return at
        return None


@dataclass(slots=True)
class AutoStream(CallStream):
    """An auto answer as OpenAI streams it: its text as content deltas until a `<tool_call>`
    tag begins (what may be the start of one, and trailing whitespace, are held back). Each
    block is held until its closing tag has come, then judged as the whole answer's parse
    judges it (`CALL_BLOCK`, `_call_text_of`): a call of a known tool whose JSON parses is sent,
    a first delta (index, id, type, name, empty arguments) then its arguments' text as written;
    anything else (broken JSON, an unknown name) is not a call, and from there on the answer is
    held and parsed at the end with the rest (`parse_calls`). Whatever cannot be streamed so (an
    answer that starts with `{` or `[`, perhaps plain JSON calls; a template's mark; a block
    without its closing tag) is held too, and sent at the end: the rest of the content, each
    further call's head, then its arguments whole. So the deltas add up to the answer parsed
    whole, whatever the model wrote."""

    plan: ToolPlan | None = None
    text: str = ""  # all that came
    at: int = 0  # handled up to here
    mode: str = "content"  # content, block (to its closing tag), held (parsed at the end)
    sent: str = ""  # the content sent so far
    sent_to: int = 0  # the end of its text
    outside: str = ""  # the text up to `at` outside the calls streamed (content, whitespace)
    block: int = 0  # where the current block's tag begins
    calls: list[dict[str, Any]] = field(default_factory=list)  # sent

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        out: list[dict[str, Any]] = []
        step = {"content": self._content, "block": self._block}
        while self.mode in step and step[self.mode](out):
            pass
        return out

    def _content(self, out: list[dict[str, Any]]) -> bool:
        """Content up to a tag (True: a block begins) or what is safe to send of it (False)."""
        pending = self.text[self.at :]
        if not self.sent and not self.calls and self.text.lstrip()[:1] in ("{", "["):
            self.mode = "held"
            return False
        tag = pending.find(CALL_TAG)
        mark = min((at for m in MARKERS if (at := pending.find(m)) >= 0), default=-1)
        marked = mark >= 0 and not 0 <= tag < mark  # a template's own calls: held to the end
        end = mark if marked else tag
        if self.calls:  # after a call: held to the end (parsed with the rest)
            ready = ""
        elif end >= 0:
            ready = pending[:end].rstrip()
        else:
            ready = _before_a_tag(pending).rstrip()
        if not self.sent:
            ready = ready.lstrip()  # as the parsed content is, when it holds calls
        if ready:
            out.append({"content": ready})
            self.sent += ready
            self.sent_to = self.at + pending.index(ready) + len(ready)
        if marked or (tag >= 0 and self.calls and not self.plan.parallel):  # type: ignore[union-attr]
            self.mode = "held"  # parsed at the end (after a call without parallel: dropped)
            return False
        if tag < 0:
            self.outside += self.text[self.at : self.sent_to]
            self.at = max(self.at, self.sent_to)
            return False
        self.outside += pending[:tag]
        self.at = self.block = self.at + tag
        self.mode = "block"
        return True

    def _block(self, out: list[dict[str, Any]]) -> bool:
        """A block once its closing tag has come: a call is sent whole (True), anything else
        held with the rest of the answer (False); False too while the tag has not come."""
        if self.text.find(CLOSE_TAG, self.block + len(CALL_TAG)) < 0:
            return False
        block = CALL_BLOCK.match(self.text, self.block)
        assert block is not None
        call = _call_text_of(block.group(1), {f.name for f in self.plan.functions})  # type: ignore[union-attr]
        if call is None:  # not a call: text, parsed whole at the end (as not streamed)
            self.mode = "held"
            return False
        out += _whole_deltas([call], len(self.calls))
        self.calls.append(call)
        self.called = True
        self.at, self.mode = block.end(), "content"
        return True

    def end(self) -> list[dict[str, Any]]:
        assert self.plan is not None
        if not self.called:  # a last block without its closing tag, too
            return self._parsed_whole()
        rest, calls = split_calls(self.text[self.at :], {f.name for f in self.plan.functions})
        content = (self.outside + rest).strip()
        out: list[dict[str, Any]] = []
        if content[len(self.sent) :]:
            out.append({"content": content[len(self.sent) :]})
        if self.plan.parallel:
            out += _whole_deltas(calls, len(self.calls))
            self.calls += calls
        return out

    def _parsed_whole(self) -> list[dict[str, Any]]:
        """No call streamed: the answer parsed whole, what was held back sent."""
        assert self.plan is not None
        content, calls = self.plan.calls(self.text)
        held = self.text[self.sent_to :]
        if not calls:  # a normal answer: what was held back, as it came
            rest = held if self.sent else held.lstrip()
        else:
            rest = content[len(self.sent) :] if content else ""
        self.called = bool(calls)
        return ([{"content": rest}] if rest else []) + _whole_deltas(calls, 0)


def _whole_deltas(calls: list[dict[str, Any]], first: int) -> list[dict[str, Any]]:
    """Each call's two deltas: its head, then its arguments whole; indices from `first`."""
    out: list[dict[str, Any]] = []
    for index, call in enumerate(calls, start=first):
        function = call["function"]
        head = {"index": index} | tool_call(function["name"], "", call["id"])
        out.append({"tool_calls": [head]})
        out.append(
            {"tool_calls": [{"index": index, "function": {"arguments": function["arguments"]}}]}
        )
    return out


def call_head(text: str) -> tuple[str, int] | bool:
    """Of a `<tool_call>` block's JSON: (name, where its arguments object begins) once
    `{"name": NAME, "arguments": {` (or "parameters", any whitespace) has come; True while
    `text` may still become that; False when it cannot."""
    at, name = 0, ""
    for part in HEAD_PARTS:
        at = len(text) - len(text[at:].lstrip())
        if at == len(text):
            return True
        if part == "NAME":
            match = HEAD_NAME.match(text, at)
            if match is None:
                return False
            if not match.group(2):
                return match.end() == len(text)
            name, at = match.group(1), match.end()
            continue
        options = part.split("|")
        found = next((o for o in options if text.startswith(o, at)), None)
        if found is None:
            return any(o.startswith(text[at:]) for o in options)
        at += len(found)
    return (name, at - 1)


def _before_a_tag(text: str) -> str:
    """`text` less a last part that may begin `<tool_call>` or one of MARKERS."""
    for size in range(min(max(map(len, (CALL_TAG, *MARKERS))) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-size:]) for tag in (CALL_TAG, *MARKERS)):
            return text[:-size]
    return text


# ---- the request's fields -------------------------------------------------------------------


def tool_plan(tools: Any, choice: Any, parallel: bool | None = None) -> ToolPlan | None:
    """The plan of `tools`, `tool_choice` and `parallel_tool_calls` (None: true, as OpenAI's
    default) as sent; None: no tools in play (none, or none given). ToolsProblem naming the
    field when malformed. A named function is called once."""
    several = parallel is not False
    if tools is None:
        if choice not in (None, "none"):
            raise ToolsProblem("tool_choice needs tools", "tool_choice")
        return None
    functions = _functions(tools)
    if choice is None or choice == "auto":
        return ToolPlan(functions, forced=False, parallel=several) if functions else None
    if choice == "none":
        return None
    if not functions:
        raise ToolsProblem("tool_choice asks for a call and tools is empty", "tools")
    if choice == "required":
        return ToolPlan(functions, forced=True, parallel=several)
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
