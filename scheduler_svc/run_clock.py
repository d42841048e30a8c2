"""The scheduler's own clock: seconds in which its event loop was running.

A step's answer is "late" only by time the scheduler itself ran. When the whole process is
stopped (SIGSTOP, a VM paused) or its event loop is blocked, the workers' answers wait unread
in the sockets; by the wall clock every one of them looks late once the scheduler runs again,
and every worker would be failed at once for the scheduler's own stall. A tick every TICK_S
marks the loop as running; a gap between ticks longer than STALL_AFTER_S is a stall, and its
excess over STALL_AFTER_S does not count. The stall in progress counts too, so a reading taken
before the first tick after a stall already leaves it out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

TICK_S = 0.1  # the loop marks itself running this often
STALL_AFTER_S = 0.5  # a longer gap between marks: the loop did not run (beyond this much)


class RunClock:
    def __init__(
        self, wall: Callable[[], float] = time.monotonic, stall_after: float = STALL_AFTER_S
    ) -> None:
        self.wall = wall
        self.stall_after = stall_after
        self.last_mark = wall()
        self.stalled = 0.0  # seconds of the stalls before the last mark
        self.stalls = 0  # how many (for logs and tests)

    def _stall_since_mark(self, now: float) -> float:
        return max(0.0, now - self.last_mark - self.stall_after)

    def mark(self) -> None:
        """The loop runs now (the ticker calls this every TICK_S)."""
        now = self.wall()
        stall = self._stall_since_mark(now)
        if stall > 0:
            self.stalled += stall
            self.stalls += 1
        self.last_mark = now

    def now(self) -> float:
        """Running seconds: wall seconds less every stall, the one in progress included.
        Never goes back."""
        wall = self.wall()
        return wall - self.stalled - self._stall_since_mark(wall)

    def stalled_seconds(self) -> float:
        return self.stalled + self._stall_since_mark(self.wall())

    async def tick(self, period: float = TICK_S) -> None:
        """Mark the loop running every `period` seconds, for ever (a task of the service)."""
        while True:
            self.mark()
            await asyncio.sleep(period)
