"""`n`: several choices sampled from one prompt, the same for gRPC and HTTP. Each choice is a
request of its own to the scheduler (seeded ones get seed, seed + 1, ...: reproducible and
distinct); their events are merged as they come, each with its choice's index."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import replace

from gateway.core import Delta, Finish, GenerateInput

MAX_CHOICES = 16
U64_MAX = 2**64 - 1


def choices_problem(n: int | None) -> str | None:
    """Why `n` (None = not given: one choice) cannot be served, or None."""
    if n is not None and not 1 <= n <= MAX_CHOICES:
        return f"n is {n}; it must be in [1, {MAX_CHOICES}]"
    return None


def choice_inputs(job: GenerateInput, n: int | None) -> list[GenerateInput]:
    """One request per choice; seeded ones get seed, seed + 1, ...: reproducible, distinct."""
    if (n or 1) == 1:
        return [job]
    seed = job.sampling.seed
    if seed is None:
        return [job] * n
    return [
        replace(job, sampling=replace(job.sampling, seed=(seed + i) % (U64_MAX + 1)))
        for i in range(n)
    ]


async def merged(
    streams: list[AsyncGenerator[Delta | Finish, None]],
    closed: Callable[[], None] = lambda: None,
) -> AsyncGenerator[tuple[int, Delta | Finish], None]:
    """(choice index, event) of several streams as they come; a failure of one is raised (and
    closing this closes them all). `closed` runs once they have all ended (the choices' unused
    queue places go back)."""
    if len(streams) == 1:  # the usual case: no task, no queue
        try:
            async with aclosing(streams[0]) as events:
                async for item in events:
                    yield 0, item
        finally:
            closed()
        return
    queue: asyncio.Queue[tuple[int, Delta | Finish | Exception]] = asyncio.Queue()

    async def pump(index: int, events: AsyncGenerator[Delta | Finish, None]) -> None:
        try:
            async with aclosing(events):
                async for item in events:
                    queue.put_nowait((index, item))
        except Exception as err:  # GenerationError and the like: the merged stream raises it
            queue.put_nowait((index, err))

    tasks = [asyncio.ensure_future(pump(i, events)) for i, events in enumerate(streams)]
    try:
        finished = 0
        while finished < len(tasks):
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            finished += isinstance(item, Finish)
            yield index, item
    finally:
        for task in tasks:
            task.cancel()  # a no-op once it is done
        await asyncio.wait(tasks)  # their cleanup (the scheduler's calls cancelled) runs now
        closed()
