"""What a replay's prompts are made of: a length-only trace gives every request its own content
(a prefix cache finds ~nothing to reuse, in the simulation and through real text), a hash trace
keeps the reuse its hashes say, a shared prefix only when asked; every report names the source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.tokenizer import load_default_tokenizer
from llmserve.bench import hash_trace as ht
from llmserve.bench.cost_model import CostModel
from llmserve.bench.errors import BenchError
from llmserve.bench.policy import Policy
from llmserve.bench.simulate import SimSettings, Simulation
from llmserve.bench.stats import summarize
from llmserve.bench.tokens import TokenSource
from llmserve.bench.trace import DEFAULT_TRACE, TraceScale, load_trace
from llmserve.bench.workload import DistinctPrompts, Workload, fixed, from_trace
from llmserve.bench.workload_args import build_workload
from llmserve.cli import build_parser
from llmserve.cli import main as llmserve

COST = CostModel(fixed=0.005, per_token=1e-5, per_sampled=1e-6, per_kv_read=1e-9)
ROOMY = SimSettings(workers=1, kv_capacity=200_000, token_budget=2048, max_running=64)
CACHE_ON = Policy("continuous", "paged", prefix_caching=True)


@pytest.fixture(scope="module")
def trace_csv(tmp_path_factory) -> Path:
    """The real trace's first 120 requests (a length-only CSV)."""
    path = tmp_path_factory.mktemp("trace") / "azure.csv"
    path.write_text("".join(DEFAULT_TRACE.read_text().splitlines(keepends=True)[:121]))
    return path


def simulated(workload: Workload) -> dict:
    s = summarize(Simulation(ROOMY, CACHE_ON, COST).run(workload, progress=False))
    assert s["ok"] == len(workload.requests)
    return s["prefix"]


def sim_args(trace: Path, *flags: str):
    """`bench sim` on `trace`, lengths x 0.25, outputs of at most 16 tokens."""
    scaled = ["--trace", str(trace), "--length-scale", "0.25", "--max-output-tokens", "16"]
    return build_parser().parse_args(["bench", "sim", *scaled, *flags])


def test_a_length_only_trace_replayed_with_caching_on_hits_almost_nothing(trace_csv) -> None:
    workload = build_workload(sim_args(trace_csv, "--workload", "trace"))
    prefix = simulated(workload)
    assert prefix["hit_rate"] < 0.01
    assert prefix["prefill_computed"] >= 0.99 * workload.prompt_tokens


def test_every_request_of_a_trace_has_its_own_prompt_the_same_on_every_run(trace_csv) -> None:
    scale, rows = TraceScale(max_requests=40), load_trace(trace_csv)
    a, b = from_trace(scale, rows), from_trace(scale, rows)
    ids = [a.content.prompt_ids(spec, []) for spec in a.requests]
    assert ids == [b.content.prompt_ids(spec, []) for spec in b.requests]
    assert [len(p) for p in ids] == [spec.prompt_tokens for spec in a.requests]
    assert len({tuple(p[:16]) for p in ids}) == len(ids)  # no two share even a first block
    other = from_trace(scale, rows, content=DistinctPrompts(TokenSource(seed=1)))
    assert other.content.prompt_ids(other.requests[0], []) != ids[0]


def test_a_shared_prefix_is_off_by_default_and_reused_only_when_asked(trace_csv) -> None:
    plain = build_workload(sim_args(trace_csv))
    assert "shared prefix" not in plain.prompts
    shared = build_workload(sim_args(trace_csv, "--shared-prefix-tokens", "64"))
    assert shared.prompts.startswith("a shared prefix of 64 tokens")
    first, second = (shared.content.prompt_ids(s, []) for s in shared.requests[:2])
    assert first[:64] == second[:64] and first[64:80] != second[64:80]
    hit_rate = simulated(shared)["hit_rate"]
    # at most the 64 tokens of every request after the first (whole 16-token blocks)
    assert 0.05 < hit_rate <= 64 * (len(shared.requests) - 1) / shared.prompt_tokens
    with pytest.raises(BenchError, match="--workload trace"):
        build_workload(sim_args(trace_csv, "--workload", "fixed", "--shared-prefix-tokens", "8"))


def test_the_hash_trace_keeps_the_hits_its_repeated_hashes_give() -> None:
    rows = ht.load_hash_trace(ht.SAMPLE_TRACE)[:30]
    assert ht.repeated_share(rows)["repeated_blocks"] > 0
    workload = ht.hash_trace_workload(rows, ht.HashPrompts(TokenSource(), 64))
    assert workload.prompts.startswith("from the trace's hash_ids (block size 64 tokens")
    assert simulated(workload)["hit_rate"] > 0.2


def test_served_trace_prompts_are_distinct_texts_of_exactly_their_lengths(trace_csv) -> None:
    args = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--workload",
            "trace",
            "--trace",
            str(trace_csv),
            "--requests",
            "6",
            "--length-scale",
            "0.25",
        ]
    )
    workload = build_workload(args, served=True)
    tokenizer = load_default_tokenizer()  # the gateway's
    encoded = [tokenizer.encode(workload.content.served_input(s, [])) for s in workload.requests]
    assert [len(ids) for ids in encoded] == [s.prompt_tokens for s in workload.requests]
    assert len({tuple(ids[:16]) for ids in encoded}) == len(encoded)


def test_every_report_names_what_its_prompts_are_made_of(trace_csv) -> None:
    sources = {
        "trace": from_trace(TraceScale(max_requests=3), load_trace(trace_csv)),
        "hash": ht.hash_trace_workload(
            ht.load_hash_trace(ht.SAMPLE_TRACE)[:3], ht.HashPrompts(TokenSource(), 32)
        ),
        "fixed": fixed(2, 8, 4, concurrency=1),
    }
    named = {k: w.describe()["prompts"] for k, w in sources.items()}  # a report's "workload"
    assert named["trace"].startswith("distinct per request (length-only trace")
    assert named["hash"].startswith("from the trace's hash_ids (block size 32 tokens")
    assert named["fixed"].startswith("one repeated word")


def test_bench_sim_prints_and_writes_the_prompt_source(trace_csv, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        llmserve(
            ["bench", "sim", "--trace", str(trace_csv), "--requests", "20",
             "--length-scale", "0.25", "--policies", "continuous+paged", "--prefix-caching", "on",
             "--sim-workers", "1",
             "--out", str(tmp_path), "--name", "p", "--no-progress"]
        )  # fmt: skip
    assert done.value.code == 0
    printed = capsys.readouterr().out
    assert "prompts: distinct per request (length-only trace" in printed
    report = json.loads((tmp_path / "p-load1.json").read_text())
    assert report["workload"]["prompts"].startswith("distinct per request")
    assert report["runs"][0]["prefix"]["hit_rate"] < 0.01
