"""One model setting for the whole stack: which model a gateway tokenizes for, and when the
workers' model disagrees with it (gateway.served_model, pure)."""

from __future__ import annotations

import pytest

from gateway.served_model import ServedModel, first_mismatch, mismatch, model_name, resolve

SMOL = "SmolLM2-135M-Instruct"


def test_a_model_is_named_as_its_workers_name_it() -> None:
    assert model_name("smollm2") == SMOL
    assert model_name("tiny") == "tiny"
    assert model_name("/models/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf") == "Qwen2.5-0.5B-Instruct"


def test_without_a_model_the_gateway_takes_the_workers_packaged_one() -> None:
    assert resolve("", SMOL) == "smollm2"
    assert resolve("", "sim") == "sim"
    assert resolve("/m/other.gguf", SMOL) == "/m/other.gguf"  # given: checked, not replaced


def test_without_a_model_a_model_of_the_workers_own_is_refused_saying_what_to_give() -> None:
    with pytest.raises(SystemExit, match="start the gateway with --model"):
        resolve("", "Qwen2.5-0.5B-Instruct")


def test_the_workers_serving_another_model_name_is_a_mismatch() -> None:
    problem = mismatch(SMOL, 49152, ServedModel("tiny", 49152, (2,)))
    assert problem is not None and "the workers serve 'tiny'" in problem


def test_a_tokenizer_larger_than_the_models_vocabulary_is_a_mismatch() -> None:
    problem = mismatch(SMOL, 49152, ServedModel(SMOL, 400, (2,)))
    assert problem is not None and "49152 tokens but the workers' model" in problem


def test_a_model_padded_beyond_the_tokenizer_agrees() -> None:
    assert mismatch("qwen", 151665, ServedModel("qwen", 151936, (151645,))) is None
    assert mismatch("qwen", 151665, ServedModel("qwen", 151665, (151645,))) is None


def test_an_end_of_sequence_id_outside_the_tokenizer_is_a_mismatch() -> None:
    problem = mismatch("m", 400, ServedModel("m", 512, (2, 450)))
    assert problem is not None and "[450]" in problem


def test_an_unknown_vocabulary_is_checked_by_name_alone() -> None:
    assert mismatch(SMOL, 49152, ServedModel(SMOL)) is None


def test_the_first_worker_that_disagrees_is_reported() -> None:
    served = [ServedModel(SMOL, 49152, (2,)), ServedModel("tiny", 49152, (2,))]
    assert "'tiny'" in (first_mismatch(SMOL, 49152, served) or "")
    assert first_mismatch(SMOL, 49152, served[:1]) is None
