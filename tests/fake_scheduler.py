"""A scheduler stand-in for a real gateway process: a real gRPC server on loopback, in threads of
the test process, that keeps every SubmitRequest it gets. While `hold` is set it accepts the
requests and admits none (they stay queued, as the gateway's queue limits count them) until
`release()`; otherwise each is admitted, gets TOKENS and finishes with LENGTH."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from llmcommon.protocol import ACCEPTED_KEY
from llmcommon.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

TOKENS = [28, 29, 30]  # any ids of the packaged vocabulary
MAX_CONTEXT = 2048
news = scheduler_pb2.RequestEvent


def served(rid: str) -> scheduler_pb2.SessionEvents:
    """A request's whole life at once: admitted, its tokens, its finish."""
    events = [
        scheduler_pb2.TokenEvent(admitted=True),
        scheduler_pb2.TokenEvent(token_ids=TOKENS),
        scheduler_pb2.TokenEvent(finish_reason=common_pb2.FINISH_REASON_LENGTH),
    ]
    return scheduler_pb2.SessionEvents(events=[news(request_id=rid, event=e) for e in events])


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.submits: list[scheduler_pb2.SubmitRequest] = []
        self.hold = False
        self.held: list[tuple[str, queue.Queue]] = []
        self.lock = threading.Lock()

    def Status(self, request, context):
        return scheduler_pb2.StatusReply(max_context=MAX_CONTEXT, model="tiny")

    def Session(self, request_iterator, context):
        out: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(request_iterator, out), daemon=True).start()
        while (message := out.get()) is not None:
            yield message

    def _read(self, requests, out: queue.Queue) -> None:
        try:
            for message in requests:
                if message.HasField("submit"):
                    self._submitted(message.submit, out)
        except grpc.RpcError:
            pass  # the gateway went away
        out.put(None)

    def _submitted(self, submit: scheduler_pb2.SubmitRequest, out: queue.Queue) -> None:
        rid = submit.request_id
        with self.lock:
            self.submits.append(submit)
            out.put(scheduler_pb2.SessionEvents(events=[news(request_id=rid, accepted=True)]))
            if self.hold:
                self.held.append((rid, out))
            else:
                out.put(served(rid))

    def Submit(self, request, context):
        self.submits.append(request)
        context.send_initial_metadata(((ACCEPTED_KEY, "1"),))
        for event in served(request.request_id).events:
            yield event.event

    def release(self) -> None:
        """Serve every held request, and those that come after."""
        with self.lock:
            self.hold = False
            for rid, out in self.held:
                out.put(served(rid))
            self.held.clear()


class RunningFake:
    """The fake scheduler served from threads; `address` for the gateway's --scheduler."""

    def __init__(self) -> None:
        self.fake = FakeScheduler()
        self.server = grpc.server(ThreadPoolExecutor(16))
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.fake, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> RunningFake:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0)
