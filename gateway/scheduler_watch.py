"""The gateway's own bound on a hung scheduler.

A scheduler that dies closes its connection: new requests are refused at once and the ones the
gateway holds are resubmitted, within --resubmit-timeout (gateway/core.py). A hung one (stopped,
deadlocked) keeps its connection open and answers nothing, so requests without a deadline would
wait as long as it hangs. The gateway asks its health every WATCH_PERIOD_S: once no check has
been answered for --scheduler-timeout, the gateway reports NOT_SERVING and refuses new requests;
once none has for --resubmit-timeout, the requests it holds end with UNAVAILABLE, as they would
had it died. An answer, or a closed connection (dead: the resubmission's bound holds), ends it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

WATCH_PERIOD_S = 1.0  # the scheduler's health is asked this often
CHECK_TIMEOUT_S = 2.0  # ... and must answer within this


class Verdict(Enum):
    ANSWERS = "answers"
    HUNG = "hung"  # report NOT_SERVING, refuse new requests
    GIVEN_UP = "given up"  # and end the requests held


@dataclass(slots=True)
class SilenceBound:
    """Pure: from the health checks' outcomes, what the gateway should think of its scheduler."""

    hung_after: float
    give_up_after: float
    clock: Callable[[], float] = time.monotonic
    silent_since: float | None = None
    verdict: Verdict = field(default=Verdict.ANSWERS)

    def observe(self, silent: bool, asked: float | None = None) -> Verdict:
        """`silent`: the check timed out on an open connection (anything else resets).
        `asked`: when that check was sent (by `clock`): the silence began then at the latest,
        not when its timeout ran out (default: now)."""
        now = self.clock()
        if not silent:
            self.silent_since, self.verdict = None, Verdict.ANSWERS
            return self.verdict
        start = now if asked is None else asked
        self.silent_since = self.silent_since if self.silent_since is not None else start
        silence = now - self.silent_since
        if silence >= self.give_up_after:
            self.verdict = Verdict.GIVEN_UP
        elif silence >= self.hung_after:
            self.verdict = Verdict.HUNG
        return self.verdict

    def problem(self) -> str:
        silence = 0.0 if self.silent_since is None else self.clock() - self.silent_since
        return f"the scheduler has not answered for {silence:.0f} s (hung?); retry"
