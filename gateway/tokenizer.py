"""SmolLM2's tokenizer, rebuilt from the `tokenizer.ggml.*` metadata inside the model's GGUF file
(an HF model directory's tokenizer.json is read by `gateway.tokenizer_files` into the same class).

A GGUF carries no `tokenizer.json`: it stores the vocabulary, the merges, the token types and the
special token ids under llama.cpp's key names. We read those with a small header parser (the
`gguf` package's reader parses every tensor too and takes seconds) and assemble a byte-level BPE
with the `tokenizers` library.

The pre-tokenizer follows `tokenizer.ggml.pre`. For `smollm` llama.cpp first isolates every
Unicode number code point (`\\p{N}`) and then applies the GPT-2 split; that is what SmolLM2's own
`tokenizer.json` does too (`Digits(individual_digits=True)` before `ByteLevel`). transformers'
GGUF converter has no entry for `smollm` and falls back to plain GPT-2 splitting, which differs on
text such as `"a  1"` (we give `a ĠĠ 1`, as the model was trained; it gives `a Ġ Ġ 1`).
"""

from __future__ import annotations

import json
import mmap
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

__all__ = [
    "ChatTemplateError",
    "TemplateRoles",
    "Tokenizer",
    "load_default_tokenizer",
    "template_messages",
]

# llama.cpp's token types (tokenizer.ggml.token_type)
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

# splits applied before the GPT-2 byte-level split, by `tokenizer.ggml.pre`
_PRE_SPLITS: dict[str, list[str]] = {
    "smollm": [r"\p{N}"],
    "gpt2": [],
    "default": [],
}

# the metadata keys whose (large) arrays we keep; other arrays are skipped without decoding
_KEPT_ARRAYS = frozenset(
    {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"}
)


class ChatTemplateError(ValueError):
    """The chat template refused the messages (it called `raise_exception`) or failed to render."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


@cache
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


# ---- a minimal GGUF metadata reader -------------------------------------------------------------

_SCALAR = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}  # fmt: skip
_STRING, _ARRAY = 8, 9


def _read_str(buf: Any, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    return bytes(buf[pos : pos + n]).decode("utf-8", errors="replace"), pos + n


def _skip_or_read(buf: Any, pos: int, vtype: int, keep: bool) -> tuple[Any, int]:
    if vtype in _SCALAR:
        fmt, width = _SCALAR[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + width
    if vtype == _STRING:
        return _read_str(buf, pos)
    if vtype != _ARRAY:
        raise ValueError(f"unknown GGUF metadata value type {vtype}")
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in _SCALAR:
        fmt, width = _SCALAR[etype]
        if not keep:
            return count, pos + width * count
        return list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos)), pos + width * count
    if etype == _STRING:
        items: list[str] = []
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", buf, pos)
            if keep:
                items.append(bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"))
            pos += 8 + n
        return (items if keep else count), pos
    # nested arrays: walk them, never keep
    out: list[Any] = []
    for _ in range(count):
        value, pos = _skip_or_read(buf, pos, etype, keep)
        out.append(value)
    return (out if keep else count), pos


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The GGUF's key/value metadata. Large arrays other than the tokenizer's are left as counts."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        version, _tensor_count, kv_count = struct.unpack_from("<IQQ", mm, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version}")
        pos = 24
        meta: dict[str, Any] = {}
        for _ in range(kv_count):
            key, pos = _read_str(mm, pos)
            (vtype,) = struct.unpack_from("<I", mm, pos)
            meta[key], pos = _skip_or_read(mm, pos + 4, vtype, key in _KEPT_ARRAYS)
        return meta


# ---- chat template ------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile like transformers does: sandboxed, trim_blocks + lstrip_blocks, loopcontrols."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# ---- OpenAI's roles in a chat template -------------------------------------------------------
#
# `developer` (OpenAI's newer name for the system prompt) is a system message unless the template
# names the role itself. A template with tool support (it reads `tool_calls`, as Qwen2.5's,
# Llama 3.1's, Hermes' do) gets `tool` messages and the assistant's `tool_calls` as they are
# (each call's `arguments` parsed from its JSON text into an object, as vLLM and transformers
# hand them to templates). A template without it (SmolLM2's) gets the Hermes/Qwen plain format:
# an assistant turn's calls appended to its content, one `<tool_call>\n{"name": ..., "arguments":
# ...}\n</tool_call>` each; consecutive tool results as one user turn of
# `<tool_response>\n...\n</tool_response>` blocks, in the order of the calls.

#
# The tools a request offers (auto) go to a template that reads `tools` (as transformers'
# `apply_chat_template(..., tools=...)` hands them: Qwen2.5's, Llama 3.1's); any other template
# gets them described in Hermes' system prompt (`SYSTEM_FORMAT`), joined to the first system or
# developer turn, else a system turn of its own before the others.

TOOL_CALL_FORMAT = "<tool_call>\n{}\n</tool_call>"
TOOL_RESPONSE_FORMAT = "<tool_response>\n{}\n</tool_response>"
SYSTEM_FORMAT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions. Here are the "
    "available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)
READS_TOOLS = re.compile(r"\btools\b")


@dataclass(frozen=True, slots=True)
class TemplateRoles:
    """Which of OpenAI's newer roles a chat template renders itself; `takes_tools`: it renders
    the offered tools (reads `tools`)."""

    developer: bool
    tools: bool
    takes_tools: bool = False

    @classmethod
    def of(cls, source: str) -> TemplateRoles:
        return cls(
            developer="developer" in source,
            tools="tool_calls" in source,
            takes_tools=READS_TOOLS.search(source) is not None,
        )


def hermes_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The offered tools described for a template without tool support."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return SYSTEM_FORMAT.format(tools=lines)


def with_tools_described(messages: list[dict], tools: Sequence[dict[str, Any]]) -> list[dict]:
    """`messages` with Hermes' system prompt of `tools` (see above)."""
    text = hermes_system_prompt(tools)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        joined = f"{first['content']}\n\n{text}" if first["content"] else text
        return [first | {"content": joined}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def template_messages(messages: list[dict[str, Any]], roles: TemplateRoles) -> list[dict]:
    """`messages` as the template `roles` describes can render them (see above)."""
    out: list[dict] = []
    results = False  # the last turn of `out` holds tool results: the next one joins it
    for message in map(dict, messages):
        if message["role"] == "developer" and not roles.developer:
            message["role"] = "system"
        if message["role"] == "tool" and not roles.tools:
            block = TOOL_RESPONSE_FORMAT.format(message["content"])
            if results:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        calls = message.pop("tool_calls", None) or []
        if calls and roles.tools:
            message["tool_calls"] = [_parsed_arguments(c) for c in calls]
        elif calls:
            text = [message["content"]] if message["content"] else []
            message["content"] = "\n".join(text + [_call_text(c) for c in calls])
        out.append(message)
    return out


def _arguments(call: dict) -> Any:
    """A call's arguments as an object: OpenAI sends them as JSON text."""
    arguments = call["function"]["arguments"]
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments  # not JSON: the template gets the text as sent


def _parsed_arguments(call: dict) -> dict:
    return call | {"function": call["function"] | {"arguments": _arguments(call)}}


def _call_text(call: dict) -> str:
    body = {"name": call["function"]["name"], "arguments": _arguments(call)}
    return TOOL_CALL_FORMAT.format(json.dumps(body, ensure_ascii=False))


# ---- the tokenizer ------------------------------------------------------------------------------


class Tokenizer:
    """A `tokenizers` backend with its model's special tokens and chat template: byte-level BPE
    built from a GGUF's metadata (see the module docstring), or an HF directory's tokenizer."""

    def __init__(
        self,
        backend: _HFTokenizer,
        tokens: list[str],
        special_ids: frozenset[int],
        eos_token_id: int,
        bos_token_id: int | None,
        add_bos_token: bool,
        chat_template: str | None,
        pre_tokenizer_type: str,
    ) -> None:
        self._backend = backend
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._tokens = tokens
        self._longest_token_chars = max(map(len, tokens), default=1)
        self._special_ids = special_ids
        self._eos_token_id = eos_token_id
        self._bos_token_id = bos_token_id
        self._add_bos = add_bos_token
        self._chat_template_source = chat_template
        self._chat_template: jinja2.Template | None = None
        self.pre_tokenizer_type = pre_tokenizer_type

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        meta = read_gguf_metadata(path)
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"{path}: tokenizer model {model!r} is not byte-level BPE ('gpt2')")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
        merges_raw: list[str] = meta.get("tokenizer.ggml.merges") or []
        pre = str(meta.get("tokenizer.ggml.pre", "default"))
        if pre not in _PRE_SPLITS:
            raise ValueError(f"{path}: pre-tokenizer {pre!r} is not supported")

        byte_alphabet = set(_bytes_to_unicode().values())
        spelling = _bytes_to_unicode()
        vocab: dict[str, int] = {}
        for index, token in enumerate(tokens):
            # every real byte-level token is spelled in the byte alphabet; respell any that is not
            key = (
                token
                if set(token) <= byte_alphabet
                else "".join(spelling[b] for b in token.encode("utf-8"))
            )
            vocab.setdefault(key, index)
        merges = [tuple(m.split(" ", 1)) for m in merges_raw]

        backend = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]]
        backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
        backend.decoder = decoders.ByteLevel()

        special: list[AddedToken] = []
        user_defined: list[AddedToken] = []
        special_ids: set[int] = set()
        for index, (token, ttype) in enumerate(zip(tokens, types, strict=False)):
            if ttype == _TOKEN_CONTROL and set(token) <= byte_alphabet:
                special.append(AddedToken(token, normalized=False, special=True))
                special_ids.add(index)
            elif ttype == _TOKEN_USER_DEFINED:
                user_defined.append(AddedToken(token, normalized=False, special=False))
        backend.add_special_tokens(special)
        if user_defined:
            backend.add_tokens(user_defined)

        eos = meta.get("tokenizer.ggml.eos_token_id")
        if eos is None:
            raise ValueError(f"{path}: no tokenizer.ggml.eos_token_id")
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            backend=backend,
            tokens=tokens,
            special_ids=frozenset(special_ids),
            eos_token_id=int(eos),
            bos_token_id=None if bos is None else int(bos),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
            pre_tokenizer_type=pre,
        )

    # -- properties --

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def longest_token_chars(self) -> int:
        """The most characters one token spells (its byte-level spelling has one character per
        byte, never fewer than the text's characters): a text N times longer than this holds
        at least N tokens."""
        return self._longest_token_chars

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the control tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, ...)."""
        return self._special_ids

    @property
    def add_bos_token(self) -> bool:
        return self._add_bos

    @property
    def chat_template(self) -> str | None:
        return self._chat_template_source

    def id_to_token(self, token_id: int) -> str:
        """The token's spelling in the vocabulary (byte-level alphabet, e.g. `Ġworld`)."""
        if not 0 <= token_id < len(self._tokens):
            raise IndexError(
                f"token id {token_id} outside the vocabulary 0..{len(self._tokens) - 1}"
            )
        return self._tokens[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for (OpenAI's logprob `bytes`): a byte-level BPE token's
        spelling mapped back through GPT-2's byte table (a part of a character is its own bytes,
        not U+FFFD's), a control token's text, a SentencePiece byte token `<0xNN>` its byte;
        otherwise the token decoded alone."""
        spelling = self.id_to_token(token_id)
        if token_id not in self._special_ids and self._byte_level:
            byte_of = _unicode_to_bytes()
            if all(c in byte_of for c in spelling):
                return bytes(byte_of[c] for c in spelling)
        if token_id in self._special_ids:
            return spelling.encode()
        if match := _BYTE_TOKEN.fullmatch(spelling):
            return bytes([int(match.group(1), 16)])
        return self.decode([token_id]).encode()

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # -- encode / decode --

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Control tokens spelled in the text (`<|im_start|>`) are matched
        whole, as the chat template needs. With add_special_tokens (as transformers' default) a
        BOS is prepended where the GGUF asks for it, or tokenizer.json's post-processor adds
        its tokens; a rendered chat template spells its own, so it is encoded without.
        Through `encode_batch`, which releases the GIL (`encode` holds it): other threads, such
        as the gateway's event loop, run while a long text is tokenized."""
        try:
            batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
            ids = batch[0].ids
        except TypeError as exc:
            if isinstance(text, str):  # lone surrogates are not encodable text
                raise ValueError("text contains lone surrogates (invalid Unicode)") from exc
            raise
        if add_special_tokens and self._add_bos and self._bos_token_id is not None:
            return [self._bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids`; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat --

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] = ()
    ) -> str:
        """Render `messages` with the model's chat template, ending with the assistant prompt.
        The OpenAI roles the template does not know are rendered as `template_messages` says;
        `tools` (OpenAI's descriptions) go to the template, or to a system prompt (see above)."""
        source = self._chat_template_source
        if source is None:
            raise ChatTemplateError("this model has no chat template (tokenizer.chat_template)")
        if self._chat_template is None:
            self._chat_template = _compile_chat_template(source)
        roles = TemplateRoles.of(source)
        if tools and not roles.takes_tools:
            messages = with_tools_described(messages, tools)
        extra = {"tools": list(tools)} if tools and roles.takes_tools else {}

        def spelled(token_id: int | None) -> str | None:
            return None if token_id is None else self._tokens[token_id]

        try:
            return self._chat_template.render(
                messages=template_messages(messages, roles),
                add_generation_prompt=True,
                **extra,
                bos_token=spelled(self._bos_token_id),
                eos_token=spelled(self._eos_token_id),
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


@cache
def load_default_tokenizer() -> Tokenizer:
    """The tokenizer of the default model (SmolLM2-135M-Instruct), loaded once per process."""
    from llmcommon.model_files import default_gguf_path

    return Tokenizer.from_gguf(default_gguf_path())
