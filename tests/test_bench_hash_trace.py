"""Traces with per-block content hashes: parsing, prompts that follow the hashes, the trace's
own reuse, the synthetic sample, and the simulated prefill saved against that reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmserve.bench import hash_trace as ht
from llmserve.bench.cost_model import CostModel
from llmserve.bench.policy import Policy
from llmserve.bench.simulate import SimSettings, Simulation
from llmserve.bench.stats import summarize
from llmserve.bench.tokens import SIM_VOCAB, TokenSource


def row(ts: float, n: int, ids: list[int], m: int = 4) -> ht.HashRow:
    return ht.HashRow(ts, n, m, tuple(ids))


def line(**kw) -> str:
    obj = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]} | kw
    return json.dumps(obj)


def test_equal_ids_give_equal_tokens_and_lengths_are_exact() -> None:
    prompts = ht.HashPrompts(TokenSource(seed=1))
    a = prompts.ids(row(0, 1100, [7, 8, 9]))
    b = prompts.ids(row(0, 600, [7, 8]))
    c = prompts.ids(row(0, 512, [5]))
    assert (len(a), len(b), len(c)) == (1100, 600, 512)
    assert a[:600] == b  # same ids: same content, the last block cut
    assert c != a[:512]  # another id: other content
    assert a[512:1024] != a[:512]
    assert all(t in SIM_VOCAB for t in a)
    assert ht.HashPrompts(TokenSource(seed=1)).ids(row(0, 1100, [7, 8, 9])) == a  # every run


def test_smaller_blocks_scale_every_length_keeping_the_blocks() -> None:
    prompts = ht.HashPrompts(TokenSource(), block_tokens=64)
    r = row(0, 2 * 512 + 256, [1, 2, 3])
    assert prompts.length(r) == 2 * 64 + 32
    short = prompts.ids(row(0, 100, [1]))  # 100 / 512 of a block: 13 tokens
    assert len(short) == 13 and prompts.ids(r)[:13] == short


def test_the_trace_own_reuse_counts_blocks_seen_before() -> None:
    rows = [row(0, 1024, [1, 2]), row(1, 1300, [1, 2, 3]), row(2, 100, [4]), row(3, 700, [1, 5])]
    reuse = ht.repeated_share(rows)
    assert (reuse["blocks"], reuse["repeated_blocks"]) == (8, 3)
    assert reuse["repeated_block_share"] == 3 / 8
    assert reuse["repeated_tokens"] == 3 * 512
    assert reuse["tokens"] == 1024 + 1300 + 100 + 700


def test_a_block_seen_before_only_cut_short_saves_only_its_cut_length() -> None:
    """Block 3 first comes as a 276-token last block, then whole: 276 tokens repeat, not 512;
    then cut to 100 again: 100 (its longest earlier occurrence holds them)."""
    rows = [row(0, 1300, [1, 2, 3]), row(1, 1536, [1, 2, 3]), row(2, 1124, [1, 2, 3])]
    reuse = ht.repeated_share(rows)
    assert reuse["repeated_blocks"] == 6
    assert reuse["repeated_tokens"] == (512 + 512 + 276) + (512 + 512 + 100)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{oops", "not JSON (Expecting property name"),
        ("[1, 2]", "want a JSON object"),
        (line(hash_ids=[1]), "input_length 600 spans 2 blocks of 512 tokens but hash_ids has 1"),
        (line(input_length=0), "input_length must be an integer >= 1, got 0"),
        (line(output_length=True), "output_length must be an integer >= 1"),
        (line(timestamp=-5), "timestamp must be a finite number of milliseconds >= 0"),
        (line(hash_ids="abc"), "hash_ids must be a list of integers"),
        (json.dumps({"timestamp": 0, "input_length": 3}), "missing output_length, hash_ids"),
    ],
)
def test_a_bad_line_names_its_file_line_and_fault(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(text + "\n")
    with pytest.raises(ht.TraceError, match="t.jsonl:1: .*") as err:
        ht.load_hash_trace(path)
    assert message in str(err.value)


def test_a_missing_or_empty_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(ht.TraceError, match="no such file"):
        ht.load_hash_trace(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ht.TraceError, match="no requests"):
        ht.load_hash_trace(tmp_path / "empty.jsonl")


def test_the_sample_ids_form_a_tree_and_the_shipped_file_is_its_default() -> None:
    rows = ht.sample_trace(ht.SampleShape())
    parent: dict[int, int | None] = {}
    for r in rows:
        for before, hid in zip([None, *r["hash_ids"]], r["hash_ids"], strict=False):
            assert parent.setdefault(hid, before) == before  # an id always follows one parent
        ht.parse_line(json.dumps(r))  # consistent lengths
    shipped = [json.loads(x) for x in ht.SAMPLE_TRACE.read_text().splitlines()]
    assert shipped == rows
    assert 0.3 < ht.repeated_share(ht.load_hash_trace(ht.SAMPLE_TRACE))["repeated_block_share"]


def test_the_workload_replays_the_timestamps_and_states_the_reuse() -> None:
    rows = [row(1000, 600, [1, 2], m=9), row(3500, 100, [1], m=4)]
    w = ht.hash_trace_workload(rows, ht.HashPrompts(TokenSource(), 64), time_scale=2.0)
    assert [r.arrival_s for r in w.requests] == [0.0, 5.0]
    assert [r.prompt_tokens for r in w.requests] == [64 + 11, 13]
    assert w.params["trace_reuse"]["repeated_blocks"] == 1
    clipped = ht.hash_trace_workload(rows, ht.HashPrompts(TokenSource()), max_output_tokens=5)
    assert [r.output_tokens for r in clipped.requests] == [5, 4]


def test_simulated_prefill_saved_reaches_the_trace_reuse_when_the_cache_has_room() -> None:
    rows = ht.load_hash_trace(ht.SAMPLE_TRACE)[:60]
    cost = CostModel(fixed=0.005, per_token=1e-5, per_sampled=1e-6, per_kv_read=1e-9)
    settings = SimSettings(workers=1, kv_capacity=200_000, token_budget=2048, max_running=64)
    computed = {}
    prompts = ht.HashPrompts(TokenSource(), 64)
    for on in (True, False):
        workload = ht.hash_trace_workload(rows, prompts)
        result = Simulation(settings, Policy("continuous", "paged", on), cost).run(
            workload, progress=False
        )
        s = summarize(result)
        assert s["ok"] == 60
        computed[on] = s["prefix"]["prefill_computed"]
    assert computed[False] == sum(prompts.length(r) for r in rows)
    saved = 1 - computed[True] / computed[False]
    # the trace's repeated tokens at this scale (the sample repeats whole blocks only)
    reuse = ht.repeated_share(rows)
    share = reuse["repeated_blocks"] * 64 / computed[False]
    # nothing is evicted: all that repeats is served, except where a request comes while the
    # one it shares blocks with is still computing them
    assert 0.8 * share < saved <= share
