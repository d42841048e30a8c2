"""Structured output on the worker: one llguidance matcher per constrained request, which says
what tokens may come next (a mask over the vocabulary) and advances with each token sampled.

The token table is the model's own vocabulary, read from the files the worker loads (a GGUF's
`tokenizer.ggml.*` metadata, an HF directory's tokenizer.json): the gateway's tokenizer reads the
same files. Building it takes seconds (the GGUF reader), so it starts in the background when the
worker starts (`TokenTable.start`) and the first constrained request waits for it.

Compiled grammars are cached by (kind, spec): a request takes a copy of the compiled matcher.
A JSON schema's comes with a second matcher, the bound on its numbers' digits (json_numbers.py):
a row's mask is what both allow.
A matcher's state is a function of the tokens it consumed, so a request recomputed after a
preemption, a failover or a resubmission rebuilds it from its generated tokens (`sync`).

A step's masks are one bitmask for all its constrained rows (`allowed_rows`): llguidance writes
each row's words in place (several rows in parallel, its executor's threads), and one op unpacks
them all.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

try:
    import llguidance
except ImportError:  # e.g. the GPU machine's own packages (the GPU check): grammars refused
    llguidance = None

from llmcommon.v1 import common_pb2
from worker_svc.json_numbers import DigitBounds, digit_bounds

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (each a matcher to copy)
TABLE_WAIT_SECONDS = 120.0  # the first constrained request waits this long for the table
# JSON as OpenAI's and vLLM's servers write it under a schema: no free whitespace (a model cannot
# pad the answer with newlines until max_tokens), one space after ',' and ':'
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CONTROL = 3  # llama.cpp's token type of a special (control) token
_executor: list = []  # llguidance's LLExecutor, made at the first batch of several rows


NO_ENGINE = "structured output needs the llguidance package, which this worker does not have"


def grammar_text(grammar: common_pb2.Grammar) -> str:
    """The llguidance grammar of a Grammar message. Raises ValueError on a malformed spec."""
    if llguidance is None:
        raise ValueError(NO_ENGINE)
    kind, spec = grammar.kind, grammar.spec
    if kind == common_pb2.Grammar.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == common_pb2.Grammar.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == common_pb2.Grammar.CHOICE:
        return llguidance.grammar_from("choice", spec)
    if kind == common_pb2.Grammar.LARK:
        return llguidance.grammar_from("grammar", spec)
    raise ValueError(f"grammar kind {kind} is not one of JSON_SCHEMA, REGEX, CHOICE, LARK")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable character -> byte table (byte-level BPE vocabularies spell bytes so)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class ByteVocab:
    """A vocabulary as llguidance's TokenizerWrapper takes it: each token's bytes, the special
    ids and a (greedy, longest-match) encoder, which masks never use."""

    def __init__(self, tokens: list[bytes], special: list[int], eos: int, bos: int | None):
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos
        self.bos_token_id = bos
        skip = set(special)
        self.ids = {t: i for i, t in enumerate(tokens) if i not in skip and t}
        self.longest = max((len(t) for t in self.ids), default=1)

    def __call__(self, text: bytes) -> list[int]:
        out, at = [], 0
        while at < len(text):
            for size in range(min(self.longest, len(text) - at), 0, -1):
                token = self.ids.get(text[at : at + size])
                if token is not None:
                    out.append(token)
                    at += size
                    break
            else:
                at += 1  # a byte no token spells: skipped
        return out


def gguf_vocab(path: Path, eos: int) -> ByteVocab:
    import gguf

    fields = gguf.GGUFReader(path).fields
    names = fields["tokenizer.ggml.tokens"]
    kinds = fields.get("tokenizer.ggml.token_type")
    words = [bytes(names.parts[i]).decode() for i in names.data]
    types = [int(kinds.parts[i][0]) for i in kinds.data] if kinds else [1] * len(words)
    decoder = _byte_decoder()
    special = [i for i, t in enumerate(types) if t == _CONTROL]
    tokens = [
        w.encode() if t == _CONTROL else bytes(decoder.get(c, 0) for c in w)
        for w, t in zip(words, types, strict=True)
    ]
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return ByteVocab(tokens, special, eos, int(bos.parts[-1][0]) if bos else None)


def model_tokenizer(source: str, vocab_size: int, eos_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of the worker's --model: tiny, sim and smollm2 share SmolLM2's
    vocabulary (the default GGUF); else the GGUF file or the HF directory's tokenizer.json."""
    if llguidance is None:
        raise RuntimeError(NO_ENGINE)
    eos = list(eos_ids) or [0]
    path = Path(source).expanduser()
    if path.is_dir():
        text = (path / "tokenizer.json").read_text()
        return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
    if not (path.is_file() and path.suffix == ".gguf"):
        from llmcommon.model_files import default_gguf_path

        path = default_gguf_path()
    vocab = gguf_vocab(path, eos[0])
    wrapper = llguidance.TokenizerWrapper(vocab)
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)


class TokenTable:
    """The tokenizer, built once in a background thread; `get` waits for it."""

    def __init__(self, build: Callable[[], llguidance.LLTokenizer]) -> None:
        self.build = build
        self.future: Future = Future()
        self.started = False
        self.lock = threading.Lock()

    def start(self) -> None:
        with self.lock:
            if self.started:
                return
            self.started = True
        threading.Thread(target=self._run, name="token-table", daemon=True).start()

    def _run(self) -> None:
        try:
            self.future.set_result(self.build())
        except Exception as err:  # a constrained request fails with it; the rest run
            self.future.set_exception(err)

    def get(self) -> llguidance.LLTokenizer:
        self.start()
        return self.future.result(timeout=TABLE_WAIT_SECONDS)


@dataclass(frozen=True, slots=True)
class Compiled:
    """A grammar's compiled matcher, and for a JSON schema the bound on its numbers."""

    matcher: llguidance.LLMatcher
    bound: llguidance.LLMatcher | None

    def state(self, vocab_size: int) -> GrammarState:
        bound = None if self.bound is None else self.bound.deep_copy()
        return GrammarState(self.matcher.deep_copy(), vocab_size, bound)


class GrammarCache:
    """Compiled grammars by (kind, spec): a compiled matcher per grammar, copied per request;
    the number bounds' matchers by their bounds (nearly always one: the defaults)."""

    def __init__(self, table: TokenTable, size: int = GRAMMAR_CACHE_SIZE) -> None:
        self.table = table
        self.size = size
        self.compiled: OrderedDict[tuple[int, str], Compiled] = OrderedDict()
        self.bounds: dict[DigitBounds, llguidance.LLMatcher] = {}
        self.lock = threading.Lock()

    def matcher(self, grammar: common_pb2.Grammar) -> llguidance.LLMatcher:
        """A fresh matcher (no token consumed). Raises ValueError on a grammar that fails."""
        return self.compiled_of(grammar).matcher.deep_copy()

    def state(self, grammar: common_pb2.Grammar, vocab_size: int) -> GrammarState:
        """A request's fresh state: its matcher, and its number bound for a JSON schema."""
        return self.compiled_of(grammar).state(vocab_size)

    def compiled_of(self, grammar: common_pb2.Grammar) -> Compiled:
        key = (grammar.kind, grammar.spec)
        with self.lock:
            compiled = self.compiled.get(key)
            if compiled is not None:
                self.compiled.move_to_end(key)
                return compiled
        compiled = Compiled(self.compile(grammar_text(grammar)), self.bound(grammar))
        with self.lock:
            self.compiled[key] = compiled
            while len(self.compiled) > self.size:
                self.compiled.popitem(last=False)
        return compiled

    def compile(self, text: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.table.get(), text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    def bound(self, grammar: common_pb2.Grammar) -> llguidance.LLMatcher | None:
        """The number bound of a JSON schema (its text compiled already), None for the rest."""
        if grammar.kind != common_pb2.Grammar.JSON_SCHEMA:
            return None
        bounds = digit_bounds(json.loads(grammar.spec))
        with self.lock:
            matcher = self.bounds.get(bounds)
        if matcher is None:
            matcher = self.compile(llguidance.LLMatcher.grammar_from_regex(bounds.regex()))
            with self.lock:
                self.bounds[bounds] = matcher
        return matcher


class GrammarState:
    """One request's matcher, its number bound (None: none, or stepped aside), and how many of
    its generated tokens they have consumed."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        bound: llguidance.LLMatcher | None = None,
    ) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bound = bound
        self.consumed = 0

    def sync(self, tokens: Sequence[int], generated: int) -> None:
        """Catch up with the request's generated tokens: the last `generated` of `tokens`
        (prompt + output), of which `consumed` are consumed. After a recompute (preemption,
        failover, resubmission) the matcher starts from nothing and consumes them all. The
        bound steps aside at the token where it stepped aside before (one it refuses)."""
        missing = generated - self.consumed
        if missing > 0:
            new = list(tokens[len(tokens) - missing :])
            self.matcher.consume_tokens(new)
            if self.bound is not None and not self.bound.consume_tokens(new):
                self.bound = None
            self.consumed = generated
        self.check()

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)
        if self.bound is not None and not self.bound.consume_token(token):
            self.bound = None
        self.consumed += 1

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next (only EOS once it is complete)."""
        return allowed_rows([self], self.vocab_size)[0]

    def check(self) -> None:
        if self.matcher.is_error():
            raise ValueError(f"structured output failed: {self.matcher.get_error()}")


@dataclass(frozen=True, slots=True)
class RowMasks:
    """A step's grammar masks: `allowed[k]` is what row `rows[k]`'s grammar allows next."""

    rows: list[int]  # the constrained rows of the step's batch
    allowed: torch.Tensor  # [len(rows), vocab] bool


def row_masks(states: Sequence[GrammarState | None], vocab_size: int) -> RowMasks | None:
    """The masks of a batch's rows (None: unconstrained), one bitmask for them all."""
    rows = [row for row, state in enumerate(states) if state is not None]
    if not rows:
        return None
    return RowMasks(rows, allowed_rows([states[row] for row in rows], vocab_size))


def allowed_rows(states: Sequence[GrammarState], vocab_size: int) -> torch.Tensor:
    """[rows, vocab] bool: each state's next tokens, from one bitmask [rows, words] that
    llguidance fills in place (the number bounds' rows after the states'), unpacked in one op
    (numpy's, a byte per token viewed as bool)."""
    for state in states:
        state.check()
    words = (vocab_size + 31) // 32
    bounded = [row for row, state in enumerate(states) if state.bound is not None]
    matchers = [state.matcher for state in states] + [states[row].bound for row in bounded]
    bitmask = torch.zeros((len(matchers), words), dtype=torch.int32)  # [matchers, words]
    fill_masks(matchers, bitmask)
    words_of = bitmask.numpy()  # the same memory
    if bounded:
        within_bounds(states, bounded, words_of)
    packed = words_of[: len(states)].view(np.uint8)  # [rows, words * 4], each little-endian
    bits = np.unpackbits(packed, axis=-1, count=vocab_size, bitorder="little")  # [rows, vocab]
    return torch.from_numpy(bits).view(torch.bool)  # 0 or 1 bytes: a view, no copy


def fill_masks(matchers: Sequence[llguidance.LLMatcher], bitmask: torch.Tensor) -> None:
    """Row k of `bitmask` [matchers, words]: what matcher k allows (several in parallel)."""
    size = bitmask.shape[1] * 4
    if len(matchers) == 1:
        matchers[0].unsafe_compute_mask_ptr(bitmask.data_ptr(), size)
    elif matchers:
        if not _executor:
            _executor.append(llguidance.LLExecutor())
        rows = [(matcher, row) for row, matcher in enumerate(matchers)]
        _executor[0].unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), size, len(matchers))


def within_bounds(states: Sequence[GrammarState], bounded: list[int], bitmask: np.ndarray) -> None:
    """The rows `bounded` of `bitmask` ANDed with their bounds' masks (the rows after the
    states'). Where nothing is left, the schema needs a digit the bound refuses: the schema's
    mask alone, and that state's bound steps aside. In numpy, on one thread: torch's pool
    would wait here for the cores llguidance's executor threads still spin on."""
    schema = bitmask[bounded]  # [bounded, words]
    both = schema & bitmask[len(states) :]
    kept = both.any(axis=1)  # [bounded]
    bitmask[bounded] = np.where(kept[:, None], both, schema)
    for row, keep in zip(bounded, kept.tolist(), strict=True):
        if not keep:
            states[row].bound = None


def spec_of(kind: str, value: object) -> common_pb2.Grammar:
    """A Grammar message (for tests and tools): kind json_schema, regex, choice or lark."""
    spec = value if isinstance(value, str) else json.dumps(value)
    return common_pb2.Grammar(kind=common_pb2.Grammar.Kind.Value(kind.upper()), spec=spec)
