"""What a worker checks in a step before running it: the scheduler is a caller like any other.
A new request's sampling settings are converted and checked once where it is placed
(`Session.add`: SamplingParams' checks, llmcommon/sampling.py, and its token ids within the
vocabulary).

Each check returns what is wrong (a message) or None; a request with something wrong fails
alone, the rest of its step runs."""

from __future__ import annotations

from worker_svc.work import WorkItem

MAX_REPEAT = 32  # executions of one step's decodes at most (the scheduler's --decode-steps)


def repeat_problem(repeat: int, chunks: int, drafts: int = 0) -> str | None:
    """A step may run its decodes several times only if it holds nothing else to compute."""
    if repeat > MAX_REPEAT:
        return f"a step of {repeat} executions (at most {MAX_REPEAT})"
    if repeat > 1 and chunks:
        return f"a step of {repeat} executions carries prompt chunks; only decodes may repeat"
    if repeat > 1 and drafts:
        return f"a step of {repeat} executions carries drafts; a step with drafts runs once"
    return None


def blocks_problem(blocks: list[int], holders: dict[int, set[int]], num_blocks: int) -> str | None:
    """Granted blocks must be in the pool, distinct and free (held by no request here)."""
    outside = [b for b in blocks if b >= num_blocks]
    if outside:
        return f"block {outside[0]} is outside the pool of {num_blocks} blocks"
    taken = [b for b in blocks if b in holders]
    if taken:
        return f"block {taken[0]} belongs to another request"
    if len(set(blocks)) != len(blocks):
        return "a block is granted twice"
    return None


def shared_problem(blocks: list[int], num_blocks: int) -> str | None:
    """Shared blocks (written before, only read) must be in the pool and distinct; other
    requests may hold them."""
    outside = [b for b in blocks if b >= num_blocks]
    if outside:
        return f"shared block {outside[0]} is outside the pool of {num_blocks} blocks"
    if len(set(blocks)) != len(blocks):
        return "a block is shared twice"
    return None


def cached_problem(item: WorkItem, block_size: int) -> str | None:
    """The shared blocks hold exactly the cached prefix: whole blocks, no more, no less."""
    shared = len(item.block_table) * block_size
    if shared != item.cached:
        return (
            f"its cached prefix has {item.cached} tokens, but its {len(item.block_table)} "
            f"shared blocks hold {shared} positions (block size {block_size})"
        )
    return None


def write_problem(
    handle: int, item: WorkItem, end: int, holders: dict[int, set[int]], block_size: int
) -> str | None:
    """A request writes positions start..end-1 only into blocks that it alone holds, so that no
    caller can overwrite KV that other requests read."""
    table = item.block_table
    for index in range(item.start_position // block_size, -(-end // block_size)):
        held_by = holders.get(table[index])
        if held_by is None or (len(held_by) == 1 and handle in held_by):
            continue  # the usual case, checked without building a set per decode
        others = held_by - {handle}
        if others:
            return (
                f"writing position {max(item.start_position, index * block_size)} into block "
                f"{table[index]}, which request(s) {sorted(others)} also hold: a request writes "
                f"only into blocks it alone holds"
            )
    return None


def tokens_problem(token_ids: list[int], vocab_size: int) -> str | None:
    if not token_ids:
        return "no tokens to process"
    worst = max(token_ids)
    if worst >= vocab_size:
        return f"token id {worst} is outside the vocabulary of {vocab_size}"
    return None


def room_problem(item: WorkItem, end: int, block_size: int, max_context: int) -> str | None:
    """Positions up to `end` must lie within the context and the request's own blocks."""
    if end > max_context:
        return f"position {end - 1} is beyond the context of {max_context}"
    if len(item.block_table) * block_size < end:
        return f"its blocks do not reach position {end - 1}"
    return None
