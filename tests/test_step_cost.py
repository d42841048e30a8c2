"""The shared step-cost model: the features of a batch, the coefficients' check, the prediction,
a faster machine's model, the calibration file, and the shape of a planned step."""

from __future__ import annotations

import json

import pytest

from scheduler_svc.sequence import Sequence
from scheduler_svc.step import Step, Work
from scheduler_svc.step_cost import SMALL_ROWS, BatchShape, CostModel, step_shape

MODEL = CostModel(
    fixed=0.01, per_token=0.002, per_sampled=0.003, per_kv_read=4e-6, per_attention=5e-9
)


def test_the_features_of_a_mixed_batch() -> None:
    # a decode at position 9 and a prompt chunk of 4 tokens from position 8 (not sampling)
    shape = BatchShape.of([(9, 1, True), (8, 4, False), (0, 3, True)])
    assert shape == BatchShape(tokens=8, sampled=2, kv_read=10 + 12 + 3, attention=10 + 42 + 6)
    assert all(
        type(v) is int for v in (shape.tokens, shape.sampled, shape.kv_read, shape.attention)
    )


def test_one_item_is_its_share_of_the_batch() -> None:
    # 5 tokens from position 7: they read 12 positions; pairs 5 * 7 + (1 + 2 + ... + 5)
    assert BatchShape.item(7, 5, False) == BatchShape(5, 0, 12, 35 + 15)
    assert BatchShape.item(0, 1, True) == BatchShape(1, 1, 1, 1)
    assert type(BatchShape.item(7, 5, False).attention) is int
    items = [(7, 5, False), (0, 1, True), (100, 3, True)]
    total = BatchShape()
    for item in items:
        total += BatchShape.item(*item)
    assert total == BatchShape.of(items)


def test_shapes_add_feature_by_feature() -> None:
    assert BatchShape(1, 2, 3, 4) + BatchShape(10, 20, 30, 40) == BatchShape(11, 22, 33, 44)
    assert BatchShape(1, 2, 3, 4).vector() == [1.0, 1.0, 2.0, 3.0, 4.0, 1.0]
    assert BatchShape(30, 2, 3, 4).vector()[-1] == SMALL_ROWS  # the first rows only


def test_the_first_rows_cost_their_own_and_the_model_stays_monotone(tmp_path) -> None:
    """per_small_token: each of a step's first SMALL_ROWS tokens costs more; past them a token
    costs per_token alone (concave, never decreasing)."""
    model = CostModel(0.01, 0.001, per_small_token=0.002)
    times = [model.predict(BatchShape(n, 1, n, n)) for n in range(1, 40)]
    assert all(b > a for a, b in zip(times, times[1:], strict=False))
    assert times[1] - times[0] == pytest.approx(0.003)  # below SMALL_ROWS
    assert times[SMALL_ROWS + 1] - times[SMALL_ROWS] == pytest.approx(0.001)  # above
    old = tmp_path / "old.json"  # a calibration file from before the feature
    old.write_text(json.dumps({"fixed": 0.01, "per_token": 0.001, "meta": {}}))
    assert CostModel.load(old).per_small_token == 0.0


def test_a_negative_coefficient_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"must be >= 0: per_token, per_kv_read$"):
        CostModel(per_token=-1.0, per_kv_read=-1e-6)
    CostModel(fixed=0.0, meta={"any": -1})  # meta is not a coefficient


def test_the_prediction_is_linear_and_an_empty_step_takes_no_time() -> None:
    shape = BatchShape(tokens=10, sampled=2, kv_read=1000, attention=20000)
    assert MODEL.predict(shape) == pytest.approx(0.01 + 0.02 + 0.006 + 0.004 + 0.0001)
    assert MODEL.predict(BatchShape()) == 0.0
    assert MODEL.seconds(shape) == MODEL.predict(shape)


def test_a_faster_machine_divides_every_coefficient_and_says_so() -> None:
    faster = CostModel(0.01, 0.002, meta={"source": "test"}).scaled(4.0)
    assert faster.coefficients() == pytest.approx([0.0025, 0.0005, 0.0, 0.0, 0.0, 0.0])
    assert faster.meta == {"source": "test", "speedup": 4.0}


def test_a_calibration_file_round_trips_one_key_a_line(tmp_path) -> None:
    path = tmp_path / "calibrations" / "new" / "model.json"  # folders made as needed
    model = CostModel(0.01, 0.002, 0.0, 4e-6, 5e-9, meta={"machine": {"cpus": 2}})
    model.save(path)
    loaded = CostModel.load(path)
    assert loaded == model and loaded.meta == model.meta
    text = path.read_text()
    assert text.endswith("}\n") and json.loads(text)["per_kv_read"] == 4e-6
    assert ' "fixed": 0.01,' in text.splitlines()  # indented by one, like the committed ones


def test_a_planned_step_is_shaped_from_its_chunks_and_decodes() -> None:
    chunked = Sequence("A", list(range(3, 23)), 4)
    decoding = Sequence("B", [3, 4, 5], 4)
    decoding.num_computed = 10  # it decodes its 10th token: at position 9
    planned = Step(worker=0, budget=8, decodes=[decoding])
    planned.chunks.append(Work(chunked, 1, start=8, num_tokens=4, sample=False))
    assert step_shape(planned) == BatchShape.of([(8, 4, False), (9, 1, True)])
    assert step_shape(planned) == BatchShape(tokens=5, sampled=1, kv_read=22, attention=42 + 10)
