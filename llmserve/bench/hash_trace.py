"""Traces that carry per-block content hashes (Mooncake's format): parse, share of repeated
blocks, prompts whose content follows the hashes, and a synthetic sample generator.

One JSON object a line: `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids":
[ids of consecutive 512-token blocks]}`. Equal ids mean equal content, so a prompt is the
concatenation of one fixed token sequence per id, the last block cut to `input_length`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmserve.bench.errors import TraceError
from llmserve.bench.tokens import TextOf, TokenSource
from llmserve.bench.workload import RequestSpec, Workload, timing

HASH_BLOCK = 512  # tokens per hash id in the format
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE_TRACE = REPO_ROOT / "data" / "traces" / "hash_sample.jsonl"


@dataclass(frozen=True, slots=True)
class HashRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_line(text: str, where: str = "line") -> HashRow:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise TraceError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: want a JSON object, got {type(obj).__name__}")
    missing = [k for k in FIELDS if k not in obj]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    ts, n, m, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
    if not _number(ts) or not math.isfinite(ts) or ts < 0:
        raise TraceError(
            f"{where}: timestamp must be a finite number of milliseconds >= 0, got {ts!r}"
        )
    for name, v in (("input_length", n), ("output_length", m)):
        if not _int(v) or v < 1:
            raise TraceError(f"{where}: {name} must be an integer >= 1, got {v!r}")
    if not isinstance(ids, list) or not all(_int(i) for i in ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers")
    blocks = math.ceil(n / HASH_BLOCK)
    if len(ids) != blocks:
        raise TraceError(
            f"{where}: input_length {n} spans {blocks} blocks of {HASH_BLOCK} tokens but "
            f"hash_ids has {len(ids)}"
        )
    return HashRow(float(ts), n, m, tuple(ids))


def load_hash_trace(path: Path) -> list[HashRow]:
    """Every non-empty line, in timestamp order; a bad line raises TraceError naming it."""
    if not path.is_file():
        raise TraceError(f"{path}: no such file (make one with `llmserve bench hash-sample`)")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        gzip = " (gzip: decompress it first)" if data[:2] == b"\x1f\x8b" else ""
        raise TraceError(f"{path}: not UTF-8 text (byte {err.start}){gzip}") from None
    rows = []
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip():
            rows.append(parse_line(line, f"{path}:{number}"))
    if not rows:
        raise TraceError(f"{path}: no requests in the file")
    return sorted(rows, key=lambda r: r.timestamp_ms)


def slice_rows(rows: list[HashRow], start_s: float = 0.0, duration_s: float = 0.0) -> list[HashRow]:
    """The rows that arrive `start_s` <= t < `start_s` + `duration_s` (0: to the end), t in
    seconds after the first row (as a length-only trace is sliced)."""
    if not rows:
        return []
    end = start_s + duration_s if duration_s else math.inf
    t0 = rows[0].timestamp_ms
    return [r for r in rows if start_s <= (r.timestamp_ms - t0) / 1000 < end]


def repeated_share(rows: list[HashRow]) -> dict[str, float | int]:
    """The trace's own reuse: blocks whose id appeared before (in this order) over all blocks,
    and the same in tokens: a repeated block counts the tokens it shares with its longest
    earlier occurrence (a block seen before only as a cut last block of 100 tokens saves 100,
    not 512). The tokens share is what a cache with unlimited room and 512-token blocks would
    save of the prefill."""
    seen: dict[int, int] = {}  # hash id -> the most tokens of it computed so far
    blocks = repeated = tokens = repeated_tokens = 0
    for row in rows:
        for k, hid in enumerate(row.hash_ids):
            size = min(HASH_BLOCK, row.input_length - k * HASH_BLOCK)
            blocks, tokens = blocks + 1, tokens + size
            if hid in seen:
                repeated, repeated_tokens = repeated + 1, repeated_tokens + min(size, seen[hid])
            seen[hid] = max(size, seen.get(hid, 0))
    return {
        "blocks": blocks,
        "repeated_blocks": repeated,
        "repeated_block_share": repeated / blocks if blocks else 0.0,
        "tokens": tokens,
        "repeated_tokens": repeated_tokens,
        "repeated_token_share": repeated_tokens / tokens if tokens else 0.0,
    }


class HashPrompts:
    """Prompt token ids of trace rows: each hash id -> `block_tokens` ids from `source`;
    equal ids give equal tokens. `block_tokens` below 512 scales every length by
    block_tokens / 512 (a CPU cannot prefill Mooncake's lengths), keeping the block structure."""

    def __init__(self, source: TokenSource, block_tokens: int = HASH_BLOCK) -> None:
        if not 1 <= block_tokens <= HASH_BLOCK:
            raise ValueError(f"block_tokens must be in 1..{HASH_BLOCK}")
        self.source = source
        self.block_tokens = block_tokens
        self._blocks: dict[int, list[int]] = {}

    def length(self, row: HashRow) -> int:
        """The prompt's length at this scale: whole blocks, the last one cut in proportion."""
        last = row.input_length - (len(row.hash_ids) - 1) * HASH_BLOCK
        cut = max(1, math.ceil(last * self.block_tokens / HASH_BLOCK))
        return (len(row.hash_ids) - 1) * self.block_tokens + cut

    def block(self, hash_id: int) -> list[int]:
        if hash_id not in self._blocks:
            self._blocks[hash_id] = self.source.ids("hash", hash_id, n=self.block_tokens)
        return self._blocks[hash_id]

    def ids(self, row: HashRow) -> list[int]:
        out: list[int] = []
        for hid in row.hash_ids:
            out += self.block(hid)
        return out[: self.length(row)]


class HashContent:
    """The trace's rows as prompts: token ids (simulation) or their text (real processes)."""

    def __init__(self, rows: list[HashRow], prompts: HashPrompts, text: TextOf | None) -> None:
        self.rows = rows
        self.prompts = prompts
        self.text = text  # word-token ids -> text; None: the simulation only

    @property
    def label(self) -> str:
        return (
            f"from the trace's hash_ids (block size {self.prompts.block_tokens} tokens: equal "
            "ids, equal content)"
        )

    def prompt_ids(self, spec: RequestSpec, history: list[int]) -> list[int]:
        return self.prompts.ids(self.rows[spec.index])

    def served_input(self, spec: RequestSpec, history: list[tuple[str, str]]) -> str:
        if self.text is None:
            raise RuntimeError("hash-trace prompts for real processes need a text vocabulary")
        return self.text(self.prompt_ids(spec, []))


def reuse_text(rows: list[HashRow]) -> str:
    """repeated_share() in words."""
    reuse = repeated_share(rows)
    return (
        f"{reuse['blocks']} blocks, {reuse['repeated_block_share']:.1%} repeated "
        f"({reuse['repeated_token_share']:.1%} of prompt tokens)"
    )


def hash_trace_workload(
    rows: list[HashRow],
    prompts: HashPrompts,
    text: TextOf | None = None,
    time_scale: float = 1.0,
    max_requests: int = 0,
    concurrency: int = 0,
    max_output_tokens: int = 0,
) -> Workload:
    """The trace's requests at its own timestamps x `time_scale` (or `concurrency` clients);
    outputs clipped to `max_output_tokens` (0 = as the trace says)."""
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    rows = rows[:max_requests] if max_requests else rows
    t0 = rows[0].timestamp_ms
    specs = [
        RequestSpec(
            i,
            prompts.length(r),
            min(r.output_length, max_output_tokens or r.output_length),
            None if concurrency else (r.timestamp_ms - t0) / 1000 * time_scale,
        )
        for i, r in enumerate(rows)
    ]
    params = {
        "kind": "hash-id trace",
        "block_tokens": prompts.block_tokens,
        "length_scale": prompts.block_tokens / HASH_BLOCK,
        **timing(time_scale, concurrency),
        "max_output_tokens": max_output_tokens,
        "trace_reuse": repeated_share(rows),
    }
    return Workload(
        f"hash-trace-{len(rows)}", specs, concurrency, params, HashContent(rows, prompts, text)
    )


@dataclass(frozen=True, slots=True)
class SampleShape:
    """A synthetic trace in Mooncake's shape: a few long shared prefixes (documents, system
    prompts), conversations that come back with their whole history plus a new turn, and
    one-off requests. Ids form a tree (an id always follows the same parent), as Mooncake's
    chained hashes do."""

    requests: int = 200
    rate: float = 2.0  # requests per second (Poisson)
    prefixes: int = 4  # shared prefixes
    prefix_blocks: int = 4  # blocks in each
    shared_share: float = 0.6  # of new requests, those that start with a shared prefix
    followup_share: float = 0.4  # of requests, those that continue an earlier one
    new_blocks: tuple[int, int] = (1, 4)  # blocks of new content per request (min, max)
    output: tuple[int, int] = (16, 256)
    seed: int = 0


def sample_trace(shape: SampleShape) -> list[dict[str, Any]]:
    rng = random.Random(shape.seed)
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        next_id += k
        return list(range(next_id - k, next_id))

    prefixes = [fresh(shape.prefix_blocks) for _ in range(shape.prefixes)]
    sent: list[list[int]] = []
    rows, t = [], 0.0
    for _ in range(shape.requests):
        if sent and rng.random() < shape.followup_share:
            # a conversation's next turn: its history first (the full blocks of an earlier
            # request; its cut last block is new content here, under a new id)
            base = rng.choice(sent)[:-1]
        elif prefixes and rng.random() < shape.shared_share:
            base = rng.choice(prefixes)
        else:
            base = []
        ids = base + fresh(rng.randint(*shape.new_blocks))
        cut = rng.randint(1, HASH_BLOCK)
        rows.append(
            {
                "timestamp": round(t * 1000),
                "input_length": (len(ids) - 1) * HASH_BLOCK + cut,
                "output_length": rng.randint(*shape.output),
                "hash_ids": ids,
            }
        )
        sent.append(ids)
        t += rng.expovariate(shape.rate)
    return rows


def write_trace(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
