"""The batching core: one `schedule()` per model execution of a worker, as in the seed's Figure 2.

1. clean up finished requests (free their KV)                       -> `_reap`
2. prepare the running requests' next work (grow KV; preempt if paged KV runs out)
3. admit waiting requests in FCFS order while budget, running limit and KV allow
4. the caller executes the step and hands the sampled tokens back to `complete`

Every worker has its own step loop over the one shared FCFS queue. A step may be planned while
the worker's previous step still runs (overlap): a request then decodes the token the worker
sampled in that step, which the core learns one step late (`Sequence.num_inflight`).

Prefix caching (paged only): a request admitted to a worker starts from the longest run of full
blocks of its tokens that the worker's pool already holds (`KvManager.hit`), shared by
reference, and computes only the rest. A block is cached when a chunk completes it (readable from
the next step on) and, for generated tokens, when its request leaves. `reserve` keeps it off:
reserving the maximum length per request is the contiguous allocation of servers before paging,
which cannot share, and it is the baseline the seed's figures compare against.

The core is a folder: `state.py` holds what every concern shares; `membership.py` (workers in
and out, live settings), `admission.py` (the queue's head: placement or a stall reason),
`planning.py` (the running requests' next work), `drafts.py` (speculative decoding: drafts
into a step, their results out, docs/speculative.md), `runs.py` (what a step sampled; decode runs)
and `failures.py` (a worker's failed work and the KV it wrote) each hold one concern;
`scheduler.py` puts them together. The waiting queue is `request_queue.py`'s type.
"""

from scheduler_svc.core.runs import RUN_LIMIT_S
from scheduler_svc.core.scheduler import Scheduler

__all__ = ["RUN_LIMIT_S", "Scheduler"]
