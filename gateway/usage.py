"""One request's progress through the gateway, for its usage figures and the metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from llmcommon.tenancy import Tenancy
from llmcommon.v1 import common_pb2


@dataclass(slots=True)
class Tally:
    """One request's progress, for usage figures."""

    received: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of those, served by the prefix cache (the scheduler's admission)
    completion_tokens: int = 0
    queue_time: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    preemptions: int = 0
    resubmits: int = 0  # sent again to a restarted scheduler
    tenancy: Tenancy = Tenancy()  # its tenant, priority and SLO class (the metrics' labels)

    def usage(self) -> common_pb2.Usage:
        now = time.monotonic()
        ttft = (self.first_token_at - self.received) if self.first_token_at else 0.0
        return common_pb2.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            queue_time_s=self.queue_time,
            time_to_first_token_s=ttft,
            total_time_s=now - self.received,
            preemptions=self.preemptions,
            cached_tokens=self.cached_tokens,
        )
