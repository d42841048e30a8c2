"""A message that does not parse, sent to any service as a buggy peer would, is answered
INVALID_ARGUMENT saying so: not UNKNOWN with a traceback in the server's log (gRPC's own answer
to an undecodable request), and a stream is not ended OK as if the peer had closed it. A session
cut that way cancels its requests (their KV freed); the stack serves on. A name sent too long to
echo in an error (a request id, an address) is refused saying its length; a long value another
refusal names is cut short in its middle (gRPC's metadata limit would have turned the answer into
RESOURCE_EXHAUSTED).

Real processes (the simulated model): a worker alone, for its step stream; a stack, for the
scheduler's and the gateway's calls."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmcommon.admin_auth import admin_metadata
from llmcommon.errors import MAX_DETAILS_CHARS
from llmcommon.server import CHANNEL_OPTIONS
from llmcommon.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
)
from llmserve import client
from tests.stack_checks import wait_for
from tests.stacks import running_stack, tiny_settings
from tests.test_step_stream_owner import one_step, worker  # noqa: F401 - the worker fixture

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]

GARBAGE = b"\xff\xff\xff\xff"  # a field number 0 with a broken varint: no message parses it
ADMIN_KEY = "admin-secret-unreadable"
NOT_READ = "Error parsing message"  # protobuf's words, in the answer (the gateway adds a hint)


def raw_stream(target: str, method: str, messages: list[bytes], pause_s: float = 0.2):
    """The answers of a stream-stream call sent `messages` as they are (raw bytes), a pause
    between them, and the call's final code and details."""

    def send():
        for message in messages:
            yield message
            time.sleep(pause_s)
        time.sleep(5)  # the stream stays open: only the server can end it in time

    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        call = channel.stream_stream(method)(send(), timeout=30)
        answers = []
        try:
            answers.extend(call)
        except grpc.RpcError as err:
            return answers, err.code(), err.details()
        return answers, call.code(), call.details()


def raw_call(target: str, method: str, streaming: bool) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        make = channel.unary_stream if streaming else channel.unary_unary
        try:
            answer = make(method)(GARBAGE, timeout=10)
            if streaming:
                list(answer)
        except grpc.RpcError as err:
            return err.code(), err.details()
    return grpc.StatusCode.OK, ""


def test_an_undecodable_step_ends_the_worker_stream_in_error_after_the_steps_before_it(
    worker,  # noqa: F811
) -> None:
    good = worker_pb2.Step(step=1).SerializeToString()
    answers, code, details = raw_stream(worker, "/llmserve.v1.Worker/Steps", [good, GARBAGE])
    assert [worker_pb2.StepResult.FromString(a).step for a in answers] == [1]
    assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert NOT_READ in details and "llmserve.v1.Step" in details
    assert one_step(worker).step == 7  # the worker takes a new stream: the old one is over


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    where = tmp_path_factory.mktemp("unreadable")
    (where / "admin.key").write_text(ADMIN_KEY + "\n")
    settings = tiny_settings(
        model="sim", sim_step_ms=20.0, kv_capacity=4096, admin_key_file=str(where / "admin.key")
    )
    with running_stack(settings, where) as s:
        yield s


@pytest.mark.parametrize(
    ("where", "method", "streaming"),
    [
        ("scheduler", "/llmserve.v1.Scheduler/Submit", True),
        ("scheduler", "/llmserve.v1.Scheduler/Cancel", False),
        ("scheduler", "/llmserve.v1.Scheduler/Status", False),
        ("scheduler", "/llmserve.v1.Scheduler/Register", False),
        ("gateway", "/llmserve.v1.Gateway/Generate", True),
        ("gateway", "/llmserve.v1.Gateway/GenerateUnary", False),
        ("gateway", "/llmserve.v1.Gateway/Status", False),
        ("gateway", "/grpc.health.v1.Health/Check", False),
        ("gateway", "/grpc.health.v1.Health/Watch", True),
        ("scheduler", "/grpc.health.v1.Health/Watch", True),
    ],
)
def test_an_undecodable_request_is_invalid_argument_without_a_traceback(
    stack, where, method, streaming
) -> None:
    code, details = raw_call(getattr(stack.settings, where), method, streaming)
    assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert NOT_READ in details
    assert "Traceback" not in stack.log(where).read_text()


def test_an_undecodable_session_message_ends_the_session_and_cancels_its_requests(stack) -> None:
    submit = scheduler_pb2.SessionRequest(
        submit=scheduler_pb2.SubmitRequest(
            request_id="cut-session-1",
            prompt_token_ids=[5, 6, 7],
            sampling=common_pb2.SamplingParams(max_tokens=1000, ignore_eos=True),
        )
    )
    answers, code, details = raw_stream(
        stack.settings.scheduler,
        "/llmserve.v1.Scheduler/Session",
        [submit.SerializeToString(), GARBAGE],
        pause_s=1.0,  # the request is accepted (and running) before the garbage comes
    )
    events = [e for a in answers for e in scheduler_pb2.SessionEvents.FromString(a).events]
    assert any(e.request_id == "cut-session-1" and e.accepted for e in events), events
    assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert NOT_READ in details and "SessionRequest" in details
    wait_for(lambda: client.status(stack.settings.scheduler).running == 0, 30, "KV freed")
    reply = client.status(stack.settings.scheduler)
    assert reply.waiting == 0
    assert all(w.running == 0 and w.free == w.capacity for w in reply.workers), reply.workers
    assert "its requests are cancelled" in stack.log("scheduler").read_text()
    with client.Client(stack.settings.gateway, timeout=60) as c:  # the stack serves on
        assert c.generate("hello", max_tokens=4, ignore_eos=True).usage["completion_tokens"] == 4


# An error names what was sent; a name of 100 kB had made the answer's details exceed gRPC's
# metadata limit, and the client saw RESOURCE_EXHAUSTED ("received metadata size exceeds hard
# limit") instead of the status meant. Such names are refused at the door, saying their length.
LONG = "x" * 100_000


def test_a_register_of_a_100_kb_address_is_refused_saying_its_length(stack) -> None:
    with grpc.insecure_channel(stack.settings.scheduler, options=CHANNEL_OPTIONS) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(scheduler_pb2.RegisterRequest(address=LONG), timeout=10)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "the address has 100000 characters; at most 256"


def test_a_submission_of_a_100_kb_request_id_is_refused_saying_its_length(stack) -> None:
    submit = scheduler_pb2.SubmitRequest(
        request_id=LONG,
        prompt_token_ids=[5, 6, 7],
        sampling=common_pb2.SamplingParams(max_tokens=2),
    )
    with grpc.insecure_channel(stack.settings.scheduler, options=CHANNEL_OPTIONS) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Submit(submit, timeout=10))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == "request_id has 100000 characters; at most 256"
        events = stub.Session(iter([scheduler_pb2.SessionRequest(submit=submit)]), timeout=10)
        (answer,) = [e for message in events for e in message.events]
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and not answer.accepted
    assert answer.details == "request_id has 100000 characters; at most 256"


def cut_short(details: str) -> bool:
    return len(details) <= MAX_DETAILS_CHARS and "characters cut" in details


@pytest.mark.parametrize("field", ["slo_class", "role"])
def test_a_100_kb_field_the_gateway_names_in_its_refusal_is_cut_short(stack, field) -> None:
    if field == "role":
        chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role=LONG, content="hi")])
        request = gateway_pb2.GenerateRequest(chat=chat)
    else:
        request = gateway_pb2.GenerateRequest(prompt="hi", slo_class=LONG)
    with grpc.insecure_channel(stack.settings.gateway, options=CHANNEL_OPTIONS) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=10))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert cut_short(refused.value.details()), refused.value.details()[:300]


@pytest.mark.parametrize("where", ["gateway", "scheduler"])
def test_a_100_kb_setting_name_or_health_service_is_refused_cut_short(stack, where) -> None:
    change = scheduler_pb2.Setting(name=LONG, value="1")
    with grpc.insecure_channel(getattr(stack.settings, where), options=CHANNEL_OPTIONS) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            scheduler_pb2_grpc.AdminStub(channel).SetSettings(
                scheduler_pb2.SetSettingsRequest(changes=[change]),
                metadata=admin_metadata(ADMIN_KEY),
                timeout=10,
            )
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert cut_short(refused.value.details()), refused.value.details()[:300]
        with pytest.raises(grpc.RpcError) as unknown:
            health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=LONG), timeout=10
            )
    assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
    assert cut_short(unknown.value.details()), unknown.value.details()[:300]
