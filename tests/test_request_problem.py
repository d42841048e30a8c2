"""Every refusal of a request carries a message and the field at fault, the same way."""

import grpc
import pytest

from gateway.generation_errors import GenerationError
from gateway.http_errors import ApiError
from gateway.tools import ToolsProblem
from gateway.validation import InvalidRequest
from llmcommon.errors import RequestProblem
from llmcommon.sampling import InvalidSampling


@pytest.mark.parametrize("kind", [InvalidSampling, InvalidRequest, ToolsProblem])
def test_a_value_refusal_is_a_value_error_with_its_message_and_field(kind):
    err = kind("top_p must be in (0, 1]", "top_p")
    assert isinstance(err, RequestProblem) and isinstance(err, ValueError)
    assert (str(err), err.message, err.param) == ("top_p must be in (0, 1]",) * 2 + ("top_p",)


def test_a_request_without_a_field_at_fault_names_none():
    assert InvalidRequest("messages must not be empty").param is None


@pytest.mark.parametrize("kind", [GenerationError, ApiError])
def test_a_refusal_with_a_status_code_keeps_its_message_and_field(kind):
    err = kind(grpc.StatusCode.INVALID_ARGUMENT, "too long", "max_tokens")
    assert isinstance(err, RequestProblem) and not isinstance(err, ValueError)
    assert (err.code, str(err), err.message, err.param) == (
        grpc.StatusCode.INVALID_ARGUMENT, "too long", "too long", "max_tokens",
    )  # fmt: skip
