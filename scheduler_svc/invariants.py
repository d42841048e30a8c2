"""Consistency checks of the batching core, for tests and for `LLMSERVE_CHECK_INVARIANTS=1`.

After every step, per worker: free + written + reserved-but-unwritten = capacity; every block is
free, evictable (cached, held by nobody) or held, and its reference count is the number of running
requests' tables that list it; no request writes into a block another holds; every running
request holds the KV its planned tokens need and has a handle of its own; a request prefilling
there runs there; a waiting request holds none and has no draft in flight; a block of a running
request's table is cached only if every token it holds is known (the prefix cache never keeps a
draft's unverified positions).

Of each planned step (`check_step`): it stays within the token budget; every work item belongs to
a request running on that worker under the item's handle, at most once, and the blocks its
positions need are the first blocks of that request's own table (a draft's: its input and every
draft position); a request whose draft is in flight is in no other work; a step with drafts runs
once; every grant extends the table of a request running there.
"""

from __future__ import annotations

import sys
from collections import Counter

from scheduler_svc.blocks import BlockPool, blocks_for
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
        name, pool, bs = ws.spec.name, ws.kv.pool, ws.spec.block_size
        kv = ws.report()
        _require(
            kv.free + kv.written + kv.reserved_unwritten == kv.capacity,
            f"{name}: free {kv.free} + written {kv.written} + reserved {kv.reserved_unwritten} "
            f"!= capacity {kv.capacity}",
        )
        _require(kv.reserved_unwritten >= 0, f"{name}: written {kv.written} beyond allocated")
        _check_pool(name, pool)
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
                ws.kv.held(s) == held * bs,
                f"{s.request_id}: holds {held} blocks on {name}, counted as {ws.kv.held(s)} "
                f"positions",
            )
            _require(
                held >= blocks_for(s.num_computed, bs),
                f"{s.request_id}: needs {s.num_computed} positions on {name} but holds {held} "
                f"blocks",
            )
            table = pool.table(s.request_id)
            shared = [b for b in table[s.num_computed // bs :] if pool.refs[b] > 1]
            _require(
                not shared,
                f"{s.request_id}: writes into block {shared[:1]} on {name}, which others hold",
            )
            unknown = [b for b in table[s.num_tokens // bs :] if b in pool.key_of]
            _require(
                not unknown,
                f"{s.request_id}: block {unknown[:1]} on {name} is cached but holds positions "
                f"past its {s.num_tokens} known tokens",
            )
            _require(
                0 <= s.num_inflight <= 2 * core.longest_run and s.num_computed <= s.num_planned,
                f"{s.request_id}: {s.num_planned} tokens known, {s.num_tokens} + {s.num_inflight} "
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
            and s.num_planned == s.num_tokens
            and s.handle == NO_HANDLE
            and not s.drafting,
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


def _check_pool(name: str, pool: BlockPool) -> None:
    """Every block is free, evictable or held; each block's reference count is the number of
    tables that list it; the cache's two maps agree; evictable blocks are cached and unheld."""
    refs = Counter(block for table in pool.tables.values() for block in table)
    for rid, table in pool.tables.items():
        _require(len(set(table)) == len(table), f"{name}: {rid} lists a block twice")
        outside = [b for b in table if not 0 <= b < pool.num_blocks]
        _require(not outside, f"{name}: {rid} holds block {outside[:1]}")
    wrong = [b for b in range(pool.num_blocks) if pool.refs[b] != refs.get(b, 0)]
    _require(
        not wrong,
        f"{name}: block {wrong[:1]} counts {pool.refs[wrong[0]] if wrong else 0} references, "
        f"{refs.get(wrong[0], 0) if wrong else 0} tables list it",
    )
    free, evictable = list(pool.free), list(pool.evictable)
    _require(len(set(free)) == len(free), f"{name}: a block is free twice")
    _require(not set(free) & refs.keys(), f"{name}: a block is both free and held")
    _require(not set(evictable) & refs.keys(), f"{name}: a block is both evictable and held")
    _require(not set(free) & set(evictable), f"{name}: a block is both free and evictable")
    _require(
        len(free) + len(evictable) + len(refs) == pool.num_blocks,
        f"{name}: {len(free)} free + {len(evictable)} evictable + {len(refs)} held "
        f"!= {pool.num_blocks} blocks",
    )
    _require(not set(free) & pool.key_of.keys(), f"{name}: a free block is still cached")
    _require(set(evictable) <= pool.key_of.keys(), f"{name}: an evictable block is not cached")
    _require(
        {k: b for b, k in pool.key_of.items()} == pool.cached,
        f"{name}: the cache's block->key and key->block maps disagree",
    )


def check_step(core: Scheduler, step: Step) -> None:
    """Raise InvariantError if `step`, just planned, hands a worker work that is not its own.
    Cheap: a dict of the worker's running requests, then O(1) per item and grant."""
    ws = core.workers[step.worker]
    name, pool, bs = ws.spec.name, ws.kv.pool, ws.spec.block_size
    by_handle = {s.handle: s for s in ws.running if s.status is SeqStatus.RUNNING}
    items = [(w.seq, w.handle, w.start + w.num_tokens) for w in step.chunks]
    decodes = zip(step.decodes, step.decode_handles, strict=True)
    items += [(s, h, s.num_computed) for s, h in decodes]  # a decode writes its last position
    items += [(d.seq, d.handle, d.start + 1 + len(d.token_ids)) for d in step.drafts]
    _require(not step.drafts or step.repeat <= 1, f"{name}: a step with drafts runs {step.repeat}")
    drafted = {d.handle for d in step.drafts}
    for seq, handle, _ in items:
        _require(
            not seq.drafting or handle in drafted,
            f"{seq.request_id}: planned on {name} while its draft is in flight",
        )
    for d in step.drafts:
        _require(
            bool(d.token_ids) and d.start == d.seq.num_computed - 1 and d.seq.drafting,
            f"{d.seq.request_id}: a draft of {len(d.token_ids)} at {d.start} on {name}, "
            f"{d.seq.num_computed} positions computed",
        )
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
    added = {seq.handle for seq in step.added}
    starts = {w.handle: w.start for w in step.chunks}
    for handle, blocks in step.shares:
        seq = by_handle.get(handle)
        _require(handle in added and seq is not None, f"{name}: shares with handle {handle}")
        table = pool.tables.get(seq.request_id, [])
        _require(
            table[: len(blocks)] == blocks and starts.get(handle) == len(blocks) * bs,
            f"{seq.request_id}: shares {blocks} on {name}, but its table is {table} and its "
            f"chunk starts at {starts.get(handle)}",
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
