"""Steps through the CUDA-graph path (decode-only, and decodes beside prompt chunks): static
buffers, bucket padding onto the scratch block, the Triton kernels over the static tables. Here
the graph is not captured (no GPU) but its step runs eagerly in Triton's interpreter, so what a
graph would replay is checked against the ordinary path: the same logits, and no request's KV
touched by padding."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from tests.model_support import one_torch_thread  # noqa: E402, F401  (autouse fixture)
from worker_svc.cuda_graphs import GraphShape  # noqa: E402
from worker_svc.loader import tiny_model  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402
from worker_svc.work import WorkItem  # noqa: E402

BLOCKS, BS = 24, 4


@pytest.fixture
def runners(monkeypatch) -> tuple[ModelRunner, ModelRunner]:
    monkeypatch.setenv("LLMSERVE_ATTENTION", "triton")
    config, weights = tiny_model(torch.float32)
    plain = ModelRunner(config, weights, BLOCKS, BS, torch.float32)
    graphs = ModelRunner(config, weights, BLOCKS, BS, torch.float32, cuda_graphs=True)
    assert plain.graphs is None and graphs.graphs is not None
    return plain, graphs


def prompts(n: int) -> list[WorkItem]:
    """n requests with prompts of different lengths, each on its own blocks."""
    items = []
    for i in range(n):
        length = 3 + 2 * i  # 3, 5, 7, ... tokens
        table = list(range(4 * i, 4 * i + 4))  # 16 positions each
        items.append(WorkItem(f"r{i}", list(range(10 + i, 10 + i + length)), 0, table))
    return items


def decode(runner: ModelRunner, items: list[WorkItem], steps: int) -> list[torch.Tensor]:
    """Prefill, then `steps` greedy decodes; the logits of each decode step."""
    out = []
    runner.execute(items)  # the prefill samples each request's first token
    for _ in range(steps):
        out.append(runner.compute_logits(items).clone())
        for item, token in zip(items, out[-1].argmax(-1).tolist(), strict=True):
            item.start_position, item.token_ids = item.end_position, [token]
            item.sample_index += 1
    return out


@pytest.mark.parametrize("n", [3, 5])  # padded to buckets 4 and 8
def test_graph_decodes_give_the_ordinary_paths_logits_and_padding_touches_no_request(
    runners, n
) -> None:
    plain, graphs = runners
    expected = decode(plain, prompts(n), steps=3)
    got = decode(graphs, prompts(n), steps=3)
    for a, b in zip(expected, got, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-5), (
            (a - b).abs().max()
        )  # batch shapes differ
    owned = BS * 4 * n  # the requests' slots: identical KV in both pools
    assert torch.allclose(plain.pool.k[:, :owned], graphs.pool.k[:, :owned], atol=1e-5)
    assert graphs.pool.k[:, owned : BLOCKS * BS].abs().sum() == 0  # padding: scratch block only
    assert graphs.graphs.captures == 2  # the prefill's shape, and one decode bucket reused
    assert graphs.pool.num_blocks == BLOCKS + 1 and graphs.num_blocks == BLOCKS  # the scratch


def test_the_scratch_block_is_not_one_a_request_may_own(runners) -> None:
    _, graphs = runners
    with pytest.raises(ValueError, match="outside the pool"):
        graphs.compute_logits([WorkItem("x", [1], 0, [BLOCKS])])


def advance(items: list[WorkItem], logits: torch.Tensor) -> None:
    """Each sampled item takes its argmax as its next (decode) token."""
    sampled = [item for item in items if item.sample]
    for item, token in zip(sampled, logits.argmax(-1).tolist(), strict=True):
        item.start_position, item.token_ids = item.end_position, [token]
        item.sample_index += 1


def mixed_steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Two prompts alone; then their decodes beside a third prompt's first chunk (not sampled),
    then beside its second chunk (over the first's cached K/V); then three decodes."""
    first, second = prompts(2), prompts(3)[2]
    whole = second.token_ids
    out = [runner.compute_logits(first).clone()]
    advance(first, out[-1])
    second.token_ids, second.sample = whole[:4], False
    out.append(runner.compute_logits([*first, second]).clone())
    advance(first, out[-1])
    second.start_position, second.token_ids, second.sample = 4, whole[4:], True
    out.append(runner.compute_logits([first[0], second, first[1]]).clone())  # any item order
    advance([first[0], second, first[1]], out[-1])
    out.append(runner.compute_logits([*first, second]).clone())
    return out


def test_mixed_steps_by_graph_give_the_ordinary_paths_logits(runners) -> None:
    plain, graphs = runners
    expected, got = mixed_steps(plain), mixed_steps(graphs)
    assert [len(x) for x in got] == [2, 2, 3, 3]  # one row per sampled item
    for a, b in zip(expected, got, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-5), (a - b).abs().max()
    owned = BS * 4 * 3
    assert torch.allclose(plain.pool.k[:, :owned], graphs.pool.k[:, :owned], atol=1e-5)
    assert graphs.pool.k[:, owned : BLOCKS * BS].abs().sum() == 0  # padding: scratch block only
    assert set(graphs.graphs.graphs) == {
        GraphShape(0, 16, 2, 2), GraphShape(2, 16, 1, 1), GraphShape(4, 0, 0, 0)
    }  # fmt: skip


def draft_steps(runner: ModelRunner) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Three prompts; then a step of one decode beside two drafts (3 and 2 tokens, one of them
    drafting the greedy tokens, so that some are kept), verified by execute."""
    items = prompts(3)
    runner.execute(items)
    greedy = runner.compute_logits(items).argmax(-1).tolist()
    for item, token in zip(items, greedy, strict=True):
        item.start_position, item.token_ids = item.end_position, [token]
        item.sample_index = 1
    logits = [runner.compute_logits(items).clone()]  # the greedy next tokens, to draft
    after = logits[0].argmax(-1).tolist()
    items[1].token_ids, items[1].drafted = [items[1].token_ids[0], after[1], 7, 9], 3
    items[2].token_ids, items[2].drafted = [items[2].token_ids[0], 5, 6], 2
    logits.append(runner.compute_logits(items).clone())
    runner.execute(items)
    return logits, [[token for token, _ in item.emitted] for item in items[1:]]


def test_drafts_by_graph_give_the_ordinary_paths_logits_and_verdicts(runners) -> None:
    plain, graphs = runners
    (expected, kept), (got, kept_by_graph) = draft_steps(plain), draft_steps(graphs)
    assert got[1].shape[0] == 1 + 4 + 3  # the decode's row, each draft's every position
    for a, b in zip(expected, got, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-5), (a - b).abs().max()
    assert kept_by_graph == kept and len(kept[0]) >= 2  # the greedy draft's first token kept
    assert GraphShape(1, 16, 2, 8) in graphs.graphs.graphs


def test_steps_beyond_the_buckets_run_eagerly(runners) -> None:
    plain, graphs = runners
    graphs.graphs.chunk_buckets = (1, 2)  # three chunks: beyond
    items = prompts(3)
    assert torch.allclose(plain.compute_logits(items), graphs.compute_logits(items), atol=1e-4)
    assert graphs.graphs.captures == 0


def test_mixed_steps_by_graph_over_an_int8_pool_give_the_ordinary_paths_logits(
    monkeypatch,
) -> None:
    """--kv-cache-dtype int8 on the graph path: the same codes and scales stored as by the
    ordinary path, the same logits, padding on the scratch block only."""
    monkeypatch.setenv("LLMSERVE_ATTENTION", "triton")
    config, weights = tiny_model(torch.float32)
    plain = ModelRunner(config, weights, BLOCKS, BS, torch.float32, cache_dtype="int8")
    graphs = ModelRunner(
        config, weights, BLOCKS, BS, torch.float32, cuda_graphs=True, cache_dtype="int8"
    )
    assert graphs.pool.quantized and graphs.graphs is not None
    expected, got = mixed_steps(plain), mixed_steps(graphs)
    for a, b in zip(expected, got, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-5), (a - b).abs().max()
    owned = BS * 4 * 3
    assert torch.equal(plain.pool.k[:, :owned], graphs.pool.k[:, :owned])
    assert torch.allclose(plain.pool.k_scale[:, :owned], graphs.pool.k_scale[:, :owned])
    assert graphs.pool.k[:, owned : BLOCKS * BS].abs().sum() == 0  # padding: scratch block only
    assert graphs.pool.k_scale[:, owned : BLOCKS * BS].abs().sum() == 0
