"""The cost model: features of a batch, the non-negative fit, and monotonicity."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmserve.bench.cost_model import DEFAULT_COST_MODEL, BatchShape, CostModel, fit

items = st.lists(
    st.tuples(st.integers(0, 4000), st.integers(1, 512), st.booleans()), min_size=1, max_size=64
)


def test_features_of_a_mixed_batch() -> None:
    # two decodes at positions 9 and 19, and a prompt chunk of 4 tokens from position 8
    shape = BatchShape.of([(9, 1, True), (19, 1, True), (8, 4, False)])
    assert shape == BatchShape(
        tokens=6, sampled=2, kv_read=10 + 20 + 12, attention=10 + 20 + (4 * 8 + 10)
    )


def test_fit_recovers_known_coefficients() -> None:
    truth = CostModel(
        fixed=0.02, per_token=0.001, per_sampled=0.0003, per_kv_read=2e-6, per_attention=1e-8
    )
    shapes = [BatchShape.of([(c, 1, True)] * b) for b in (1, 4, 16, 64) for c in (16, 512, 2048)]
    shapes += [BatchShape.of([(s, n, True)]) for n in (32, 256, 1024) for s in (0, 1000)]
    model = fit(shapes, [truth.seconds(s) for s in shapes])
    for got, want in zip(model.coefficients(), truth.coefficients(), strict=True):
        assert abs(got - want) <= 1e-6 * max(1.0, want * 1e6)
    assert model.meta["fit"]["r2"] > 0.999


def test_fit_never_returns_negative_coefficients() -> None:
    shapes = [BatchShape.of([(0, n, True)]) for n in (1, 10, 100, 1000)]
    seconds = [0.5, 0.4, 0.3, 0.2]  # faster with more tokens: nonsense, clipped to >= 0
    assert all(c >= 0 for c in fit(shapes, seconds).coefficients())


@given(items, st.integers(1, 256))
def test_the_committed_model_is_monotone_in_tokens(batch, extra) -> None:
    model = CostModel.load(DEFAULT_COST_MODEL)
    more = [(start, n + extra, sample) for start, n, sample in batch]
    assert model.seconds(BatchShape.of(more)) >= model.seconds(BatchShape.of(batch))
    longer = batch + [(0, extra, False)]
    assert model.seconds(BatchShape.of(longer)) >= model.seconds(BatchShape.of(batch))


def test_the_committed_model_says_where_it_was_measured() -> None:
    model = CostModel.load(DEFAULT_COST_MODEL)
    assert model.meta["command"].startswith("llmserve bench calibrate")
    assert model.meta["machine"]["cpus"] >= 1 and model.fixed > 0 and model.per_token > 0
    shape = BatchShape(tokens=5, sampled=5, kv_read=50)
    assert model.scaled(10).seconds(shape) == pytest.approx(model.seconds(shape) / 10)


def test_a_calibration_is_named_for_what_it_timed_and_none_keeps_the_simulators_file() -> None:
    from llmserve.bench.calibrate import default_output

    assert default_output("smollm2", "bf16", "none") == DEFAULT_COST_MODEL
    assert default_output("smollm2", "bf16", "auto").name == "smollm2-bf16-auto-cpu.json"
    assert default_output("tiny", "fp32", "none").name == "tiny-fp32-cpu.json"
    assert default_output("/models/My-Model.Q4_1.gguf", "bf16", "int4").name == (
        "My-Model.Q4_1-bf16-int4-cpu.json"
    )


def test_calibrate_times_the_worker_as_quantized_and_says_so(tmp_path, capsys) -> None:
    """The tiny model as int4 (its values quantized at load): the file records the mode and
    the command that reproduces it; the fit is usable (monotone: every coefficient >= 0)."""
    from llmserve.cli import main as llmserve

    out = tmp_path / "tiny.json"
    with pytest.raises(SystemExit) as done:
        llmserve(["bench", "calibrate", "--model", "tiny", "--quantization", "int4", "--quick",
                  "--repeats", "1", "--threads", "1", "--output", str(out)])  # fmt: skip
    assert done.value.code == 0
    model = CostModel.load(out)
    assert model.meta["quantization"] == "int4"
    assert "--quantization int4" in model.meta["command"]
    assert all(c >= 0 for c in model.coefficients()) and model.fixed + model.per_token > 0
    assert "--quantization int4" in capsys.readouterr().out
