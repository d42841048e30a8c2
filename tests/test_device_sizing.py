"""The GPU worker's logic that runs the same on the CPU: device names, KV sizing from memory,
decode buckets and the static buffers of CUDA graphs."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from worker_svc import device as device_module
from worker_svc.cuda_graphs import (
    GraphShape,
    StaticStepInputs,
    StepBatch,
    StepGraphs,
    bucket_for,
    decode_batch,
    shape_for,
)
from worker_svc.device import MemoryProbe, resolve_device
from worker_svc.kv_sizing import MemoryPlan

GIB = 2**30


def test_auto_is_the_cpu_here_and_a_missing_gpu_is_an_error_not_a_fallback() -> None:
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("CPU") == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="CUDA device"):
            resolve_device(name)
    with pytest.raises(ValueError, match="use auto, cpu"):
        resolve_device("tpu")


def test_the_pool_takes_the_fraction_left_after_weights_and_the_peak_forward() -> None:
    """80 GiB at 0.9 = 72 GiB; 1 GiB used by others, 16 GiB of weights and a 3 GiB peak leave
    52 GiB: at 128 KiB a position (an 8B model in bf16), 425,984 positions in blocks of 16."""
    plan = MemoryPlan(
        total=80 * GIB, used_before=GIB, weights=16 * GIB, activation_peak=3 * GIB, fraction=0.9
    )
    assert plan.kv_bytes == 52 * GIB
    positions = plan.positions(bytes_per_position=128 * 1024, block_size=16)
    assert positions == 52 * GIB // (128 * 1024) == 425_984 and positions % 16 == 0
    assert plan.positions(bytes_per_position=100_000, block_size=16) % 16 == 0


def test_sizing_rounds_down_to_whole_blocks_and_refuses_when_nothing_fits() -> None:
    plan = MemoryPlan(total=1000, used_before=0, weights=0, activation_peak=0, fraction=1.0)
    assert plan.positions(bytes_per_position=10, block_size=16) == 96  # 6 blocks of 160 bytes
    tight = MemoryPlan(total=GIB, used_before=0, weights=GIB, activation_peak=1, fraction=0.9)
    with pytest.raises(ValueError, match="no room for a KV pool.*--kv-capacity"):
        tight.positions(bytes_per_position=1024, block_size=16)


def probe_in_a_fresh_process(setup: str = "") -> int:
    """The peak a CPU probe reports for a 64 MiB tensor, in a fresh process as at a worker's
    start. (Not in this one: a process that has run a test suite keeps freed memory resident and
    hands it out again, so a new allocation need not raise its resident size at all.)"""
    code = (
        "import time, torch\n"
        "from worker_svc import device\n"
        f"{setup}"
        "with device.MemoryProbe(torch.device('cpu')) as probe:\n"
        "    block = torch.ones(64 * 2**20, dtype=torch.uint8)\n"
        "    time.sleep(0.05)\n"
        "    del block\n"
        "print(probe.peak)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_the_cpu_memory_probe_sees_a_large_allocation_freed_before_it_ends() -> None:
    assert probe_in_a_fresh_process() >= 48 * 2**20


def test_where_the_peak_cannot_be_reset_the_probe_samples_a_transient_peak() -> None:
    """Sandboxes may refuse /proc/self/clear_refs; then the probe samples the resident size, and
    an allocation freed before the probe ends still counts."""
    assert probe_in_a_fresh_process("device.reset_peak_rss = lambda: False\n") >= 48 * 2**20


def test_an_idle_probe_reports_little(monkeypatch) -> None:
    monkeypatch.setattr(device_module, "reset_peak_rss", lambda: False)
    with MemoryProbe(torch.device("cpu")) as idle:
        time.sleep(0.02)
    assert idle.peak < 16 * 2**20


def test_a_decode_batch_runs_in_the_smallest_bucket_that_holds_it() -> None:
    assert [bucket_for(n) for n in (1, 2, 3, 17, 32, 33, 256)] == [1, 2, 4, 24, 32, 48, 256]
    assert bucket_for(257) is None
    assert bucket_for(5, (4, 8)) == 8


def make_inputs(rows: int = 8, blocks: int = 4) -> StaticStepInputs:
    return StaticStepInputs(
        rows, blocks, scratch_block=9, block_size=16, device=torch.device("cpu"),
        max_chunk_tokens=32, max_chunks=4, max_chunk_logits=8,
    )  # fmt: skip


def test_a_step_runs_as_the_graph_of_its_parts_buckets_and_beyond_them_eagerly() -> None:
    assert shape_for(3, 0, 0) == GraphShape(4, 0, 0, 0)  # decode-only
    assert shape_for(255, 16, 1) == GraphShape(256, 16, 1, 1)
    assert shape_for(0, 17, 3) == GraphShape(0, 32, 4, 4)  # prompts alone
    assert shape_for(2, 18, 3, 18) == GraphShape(2, 32, 4, 32)  # three drafts of 5 + 1
    assert shape_for(257, 16, 1) is None  # too many decodes
    assert shape_for(8, 300, 1) is None  # too many chunk tokens
    assert shape_for(8, 256, 65) is None  # too many chunks
    assert shape_for(0, 256, 64, 257) is None  # too many logit rows


def test_static_inputs_hold_the_batch_and_pad_the_rest_onto_the_scratch_block() -> None:
    inputs = make_inputs()
    batch = decode_batch(
        token_ids=torch.tensor([5, 6, 7]),
        positions=torch.tensor([10, 20, 30]),
        slots=torch.tensor([42, 43, 44]),
        block_tables=torch.tensor([[1, 2], [3, 4], [5, 0]], dtype=torch.int32),
        context_lens=torch.tensor([11, 21, 17], dtype=torch.int32),
    )
    inputs.fill(GraphShape(4, 0, 0, 0), batch)
    assert inputs.token_ids[:4].tolist() == [5, 6, 7, 0]
    assert inputs.slots[:4].tolist() == [42, 43, 44, 9 * 16]  # the pad writes the scratch slot
    assert inputs.block_tables[:4].tolist() == [
        [1, 2, 0, 0],
        [3, 4, 0, 0],
        [5, 0, 0, 0],
        [9, 0, 0, 0],
    ]
    assert inputs.context_lens[:4].tolist() == [11, 21, 17, 1]
    one = decode_batch(*(t[:1] for t in (batch.token_ids, batch.positions, batch.slots)),
                       batch.block_tables[:1], batch.context_lens[:1])  # fmt: skip
    inputs.fill(GraphShape(2, 0, 0, 0), one)  # a smaller batch: stale rows reset
    assert inputs.token_ids[:2].tolist() == [5, 0] and inputs.slots[1] == 9 * 16
    with pytest.raises(ValueError, match="do not fit"):
        inputs.fill(GraphShape(2, 0, 0, 0), batch)


def mixed_batch() -> StepBatch:
    """Two decodes, then chunks of 3 tokens (a fresh prompt) and 2 (a prompt's second chunk)."""
    return StepBatch(
        token_ids=torch.tensor([5, 6, 70, 71, 72, 80, 81]),
        positions=torch.tensor([10, 20, 0, 1, 2, 16, 17]),
        slots=torch.tensor([42, 43, 96, 97, 98, 128, 129]),
        block_tables=torch.tensor([[1], [2]], dtype=torch.int32),
        context_lens=torch.tensor([11, 21], dtype=torch.int32),
        chunk_tables=torch.tensor([[6, 0], [7, 8]], dtype=torch.int32),
        chunk_lengths=torch.tensor([3, 2], dtype=torch.int32),
        chunk_starts=torch.tensor([0, 16], dtype=torch.int32),
        chunk_logits=torch.tensor([1, 1]),
    )


def test_a_mixed_step_lays_out_decodes_then_chunk_tokens_each_part_padded() -> None:
    inputs = make_inputs()
    shape = GraphShape(4, 16, 4, 4)
    inputs.fill(shape, mixed_batch())
    assert inputs.token_ids[:8].tolist() == [5, 6, 0, 0, 70, 71, 72, 80]  # decodes padded to 4
    assert inputs.slots[9:20].tolist() == [9 * 16] * 11  # padded chunk tokens: the scratch slot
    assert inputs.chunk_offsets.tolist() == [4, 7, 0, 0]  # after the 4 decode rows
    assert inputs.chunk_lengths.tolist() == [3, 2, 0, 0]  # padded chunks have no tokens
    assert inputs.chunk_starts[:2].tolist() == [0, 16]
    assert inputs.chunk_tables[:3].tolist() == [[6, 0, 0, 0], [7, 8, 0, 0], [0, 0, 0, 0]]
    assert inputs.logit_rows[:8].tolist() == [0, 1, 2, 3, 6, 8, 0, 0]  # each chunk's last
    b = mixed_batch()
    one = StepBatch(
        b.token_ids[:5],
        b.positions[:5],
        b.slots[:5],
        b.block_tables,
        b.context_lens,
        b.chunk_tables[:1],
        b.chunk_lengths[:1],
        b.chunk_starts[:1],
        b.chunk_logits[:1],
    )
    inputs.fill(shape, one)  # fewer chunks in the same shape: the stale one has no tokens now
    assert inputs.chunk_lengths.tolist() == [3, 0, 0, 0]
    assert inputs.logit_rows[4:8].tolist() == [6, 0, 0, 0]
    assert inputs.slots[7:9].tolist() == [9 * 16] * 2
    inputs.fill(GraphShape(2, 0, 0, 0), decode_batch(  # then a decode step: the chunks are gone
        torch.tensor([1]), torch.tensor([3]), torch.tensor([19]),
        torch.tensor([[1]], dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
    ))  # fmt: skip
    assert inputs.token_ids[:2].tolist() == [1, 0] and inputs.block_tables[1, 0] == 9


def test_graphs_are_made_once_per_shape_and_return_only_the_batch_rows() -> None:
    calls = []

    def step(inputs: StaticStepInputs, shape: GraphShape) -> torch.Tensor:
        calls.append(shape)
        rows = inputs.logit_rows[: shape.logit_rows]
        return inputs.token_ids[rows].float().unsqueeze(1) * 2  # "logits" [rows, 1]

    graphs = StepGraphs(make_inputs(), step, torch.device("cpu"), buckets=(2, 4, 8))

    def batch(ids: list[int]) -> StepBatch:
        n = len(ids)
        return decode_batch(
            torch.tensor(ids), torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
            torch.zeros(n, 1, dtype=torch.int32), torch.ones(n, dtype=torch.int32),
        )  # fmt: skip

    assert graphs.run(batch([1, 2, 3])).tolist() == [[2.0], [4.0], [6.0]]
    assert graphs.run(batch([4, 5, 6, 7])).tolist() == [[8.0], [10.0], [12.0], [14.0]]
    assert graphs.run(batch([9])).tolist() == [[18.0]]
    assert graphs.run(mixed_batch()).tolist() == [[10.0], [12.0], [144.0], [162.0]]
    drafts = mixed_batch()
    drafts.chunk_logits = torch.tensor([3, 2])  # both chunks drafts: every position scored
    assert graphs.run(drafts).tolist() == [[10.0], [12.0], [140.0], [142.0], [144.0], [160.0],
                                           [162.0]]  # fmt: skip
    assert graphs.captures == 4 and calls == [
        GraphShape(4, 0, 0, 0), GraphShape(4, 0, 0, 0), GraphShape(2, 0, 0, 0),
        GraphShape(2, 16, 2, 2), GraphShape(2, 16, 2, 8),
    ]  # fmt: skip
    assert graphs.run(batch(list(range(9)))) is None  # beyond the largest: eager


def test_a_worker_without_kv_capacity_sizes_its_pool_from_the_memory_limit() -> None:
    from worker_svc.__main__ import make_runner
    from worker_svc.memory_profile import weights_bytes
    from worker_svc.settings import WorkerSettings

    limit = 64 * 2**20
    settings = WorkerSettings(model="tiny", dtype="fp32", cpu_memory_gib=limit / GIB)
    runner = make_runner(settings)
    pool = runner.pool
    assert pool.num_blocks >= 1 and pool.block_size == settings.block_size
    spent = pool.pool_bytes + weights_bytes(runner.model.weights)
    assert 0.5 * 0.9 * limit < spent <= 0.9 * limit  # the fraction, less the peak forward
    with pytest.raises(ValueError, match="no room for a KV pool"):
        make_runner(WorkerSettings(model="tiny", dtype="fp32", cpu_memory_gib=1 / 1024))


def test_a_mixed_steps_chunk_rows_follow_the_padded_decodes_and_rows_pick_in_one_order() -> None:
    def step(inputs: StaticStepInputs, shape: GraphShape) -> torch.Tensor:
        return inputs.token_ids[inputs.logit_rows[: shape.logit_rows]].float().unsqueeze(1)

    graphs = StepGraphs(make_inputs(), step, torch.device("cpu"), buckets=(2, 4, 8))
    b = mixed_batch()  # two decodes; here three, padded to bucket 4
    three = StepBatch(
        torch.cat([torch.tensor([4]), b.token_ids]), torch.cat([torch.tensor([5]), b.positions]),
        torch.cat([torch.tensor([41]), b.slots]), torch.cat([b.block_tables, b.block_tables[:1]]),
        torch.cat([b.context_lens, b.context_lens[:1]]), b.chunk_tables, b.chunk_lengths,
        b.chunk_starts, b.chunk_logits,
    )  # fmt: skip
    assert graphs.run(three).squeeze(1).tolist() == [4.0, 5.0, 6.0, 72.0, 81.0]
    assert graphs.run(three, [4, 0, 3]).squeeze(1).tolist() == [81.0, 4.0, 72.0]
