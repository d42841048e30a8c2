"""Consistency checks of the batching core, for tests and for `LLMSERVE_CHECK_INVARIANTS=1`.

After every step, per worker: free + written + reserved-but-unwritten = capacity; every block is
either free or owned by exactly one running request; every running request holds the KV its
planned tokens need and has a handle of its own; a request prefilling there runs there; a waiting
request holds none.

Of each planned step (`check_step`): it stays within the token budget; every work item belongs to
a request running on that worker under the item's handle, at most once, and the blocks its
positions need are the first blocks of that request's own table; every grant extends the table
of a request running there.
"""

from __future__ import annotations

import sys

from scheduler_svc.blocks import blocks_for
from scheduler_svc.core import Scheduler
from scheduler_svc.sequence import NO_HANDLE, SeqStatus
from scheduler_svc.step import Step

ENV_VAR = "LLMSERVE_CHECK_INVARIANTS"


class InvariantError(AssertionError):
    """The core's bookkeeping is inconsistent: a bug, never a client's fault."""


def check_invariants(core: Scheduler) -> None:
    """Raise InvariantError naming the first broken invariant."""
    running_ids: set[str] = set()
    for index, ws in enumerate(core.workers):
        name, pool, bs = ws.spec.name, ws.pool, ws.spec.block_size
        kv = ws.kv()
        _require(
            kv.free + kv.written + kv.reserved_unwritten == kv.capacity,
            f"{name}: free {kv.free} + written {kv.written} + reserved {kv.reserved_unwritten} "
            f"!= capacity {kv.capacity}",
        )
        _require(kv.reserved_unwritten >= 0, f"{name}: written {kv.written} beyond allocated")
        owners: dict[int, str] = {}
        for rid, table in pool.tables.items():
            for block in table:
                _require(
                    block not in owners,
                    f"{name}: block {block} owned by {owners.get(block)} and {rid}",
                )
                _require(0 <= block < pool.num_blocks, f"{name}: {rid} owns block {block}")
                owners[block] = rid
        free = list(pool.free)
        _require(len(set(free)) == len(free), f"{name}: a block is free twice")
        _require(not set(free) & owners.keys(), f"{name}: a block is both free and owned")
        _require(
            len(free) + len(owners) == pool.num_blocks,
            f"{name}: {len(free)} free + {len(owners)} owned != {pool.num_blocks} blocks",
        )
        ids = {s.request_id for s in ws.running}
        _require(len(ids) == len(ws.running), f"{name}: a request runs twice")
        _require(ws.prefilling <= set(ws.running), f"{name}: prefilling, but not running")
        _require(not ids & running_ids, f"{name}: a request runs on two workers")
        running_ids |= ids
        _require(ws.healthy or not ws.running, f"{name}: unhealthy but still running requests")
        _require(
            pool.tables.keys() <= ids, f"{name}: KV held by {sorted(pool.tables.keys() - ids)}"
        )
        for s in ws.running:
            _require(s.worker == index, f"{s.request_id}: on {name} but says worker {s.worker}")
            _require(s.status is not SeqStatus.WAITING, f"{s.request_id}: running and waiting")
            held = pool.allocated(s.request_id)
            _require(
                held >= blocks_for(s.num_computed, bs) and s.held == held * bs,
                f"{s.request_id}: needs {s.num_computed} positions on {name} but holds {held} "
                f"blocks (it counts {s.held} positions)",
            )
            _require(
                0 <= s.num_inflight <= 2 and s.num_computed <= s.known,
                f"{s.request_id}: {s.known} tokens known, {s.num_tokens} + {s.num_inflight} "
                f"in flight, {s.num_computed} computed",
            )
        live = [s.handle for s in ws.running if s.status is SeqStatus.RUNNING]
        _require(len(set(live)) == len(live), f"{name}: two running requests share a handle")
    waiting_ids = [s.request_id for s in core.waiting]
    _require(len(set(waiting_ids)) == len(waiting_ids), "a request waits twice")
    for s in core.waiting:
        _require(
            s.status is SeqStatus.WAITING
            and s.worker is None
            and s.num_computed == 0
            and s.known == s.num_tokens
            and s.handle == NO_HANDLE,
            f"{s.request_id}: waiting with status {s.status}, worker {s.worker}, "
            f"{s.num_computed} positions written",
        )
        _require(s.request_id not in running_ids, f"{s.request_id}: waiting and running")
        _require(core.seqs.get(s.request_id) is s, f"{s.request_id}: waiting but unknown")
    pending = sum(s.num_pending for s in core.waiting)
    _require(
        core.waiting_tokens == pending,
        f"waiting_tokens is {core.waiting_tokens} but the queue holds {pending}",
    )


def check_step(core: Scheduler, step: Step) -> None:
    """Raise InvariantError if `step`, just planned, hands a worker work that is not its own.
    Cheap: a dict of the worker's running requests, then O(1) per item and grant."""
    ws = core.workers[step.worker]
    name, pool, bs = ws.spec.name, ws.pool, ws.spec.block_size
    by_handle = {s.handle: s for s in ws.running if s.status is SeqStatus.RUNNING}
    items = [(w.seq, w.handle, w.start + w.num_tokens) for w in step.chunks]
    decodes = zip(step.decodes, step.decode_handles, strict=True)
    items += [(s, h, s.num_computed) for s, h in decodes]  # a decode writes its last position
    limit = sys.maxsize if core.static else core.config.token_budget
    _require(
        step.num_tokens <= limit, f"{name}: a step of {step.num_tokens} tokens, budget {limit}"
    )
    seen: set[int] = set()
    for seq, handle, end in items:
        rid = seq.request_id
        _require(
            by_handle.get(handle) is seq,
            f"{rid}: planned on {name} under handle {handle}, but it does not run there under it",
        )
        _require(handle not in seen, f"{rid}: planned twice in one step on {name}")
        seen.add(handle)
        table = pool.tables.get(rid, [])
        _require(
            blocks_for(end, bs) <= len(table),
            f"{rid}: writes up to position {end - 1} on {name}, but its table holds "
            f"{len(table)} blocks of {bs}",
        )
    for handle, new in step.grants:
        seq = by_handle.get(handle)
        _require(seq is not None, f"{name}: blocks granted to handle {handle}, not running")
        table = pool.tables.get(seq.request_id, [])
        _require(
            not new or table[len(table) - len(new) :] == new,
            f"{seq.request_id}: blocks {new} granted on {name} do not end its table {table}",
        )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvariantError(message)
