"""The core under the orderings other than FCFS: a higher priority preempts a lower running
request and nothing is lost; fair share keeps two backlogged tenants' service within VTC's bound
and splits it by weight; a tenant beside another's burst gets in; the ordering is counted as the
reason the oldest request waits; the policy changes live; the invariants hold throughout."""

from __future__ import annotations

import random
from collections import Counter

from llmcommon.tenancy import Tenancy
from scheduler_svc.config import CoreConfig, QueuePolicy, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.live_settings import apply
from scheduler_svc.reasons import StallReason
from scheduler_svc.sequence import Finish
from tests.sim import check_invariants, seq, step

SPEC = WorkerSpec("w0", num_blocks=64, block_size=4, max_context=128)


def core_of(policy: str, spec: WorkerSpec = SPEC, **config) -> Scheduler:
    return Scheduler(CoreConfig(queue_policy=QueuePolicy(policy), **config), [spec])


def run_until_done(core: Scheduler, limit: int = 2000) -> dict[str, list[int]]:
    """Step until nothing is left; every request's output as it finished."""
    outputs: dict[str, list[int]] = {}
    seqs = dict(core.seqs)
    for _ in range(limit):
        if not core.seqs:
            break
        step(core)
        check_invariants(core)
        seqs.update(core.seqs)
    assert not core.seqs, "bounded: everything finished"
    for rid, s in seqs.items():
        assert s.finish in (Finish.LENGTH, Finish.STOP), (rid, s.finish, s.error)
        outputs[rid] = s.output_ids
    return outputs


def test_a_higher_priority_request_preempts_the_lowest_running_one_and_none_is_lost():
    core = core_of("priority", max_running=2)
    core.add(seq("low1", 6, 12, tenancy=Tenancy(priority=5)))
    core.add(seq("low2", 6, 12, tenancy=Tenancy(priority=3)))
    step(core)
    step(core)
    core.add(seq("urgent", 6, 4, tenancy=Tenancy(priority=0)))
    steps = step(core)
    admitted = [e.request_id for s in steps for e in s.admissions]
    assert admitted == ["urgent"]
    assert core.seqs["low1"].preemptions == 1 and core.seqs["low2"].preemptions == 0
    assert core.preemptions == 1
    outputs = run_until_done(core)
    assert {rid: len(out) for rid, out in outputs.items()} == {"low1": 12, "low2": 12, "urgent": 4}
    # the preempted one's output is what it would have been unpreempted (recomputed, not redone)
    alone = core_of("fcfs")
    alone.add(seq("low1", 6, 12))
    assert run_until_done(alone)["low1"] == outputs["low1"]


def test_fcfs_never_preempts_for_the_head():
    core = core_of("fcfs", max_running=2)
    core.add(seq("a", 6, 12, tenancy=Tenancy(priority=5)))
    core.add(seq("b", 6, 12, tenancy=Tenancy(priority=5)))
    step(core)
    core.add(seq("c", 6, 4, tenancy=Tenancy(priority=-9)))
    step(core)
    assert core.preemptions == 0 and core.seqs["c"].admitted_at is None
    assert core.stalls[StallReason.MAX_RUNNING] >= 1


def test_a_priority_head_preempts_what_makes_room_and_nothing_where_nothing_would():
    spec = WorkerSpec("w0", num_blocks=6, block_size=4, max_context=128)  # 24 positions
    core = core_of("priority", spec)
    core.add(seq("low", 6, 4, tenancy=Tenancy(priority=9)))
    core.add(seq("mid", 6, 4, tenancy=Tenancy(priority=8)))
    step(core)
    core.add(seq("top", 20, 2, tenancy=Tenancy(priority=0)))
    steps = step(core)  # top needs 20 of the 24 positions: both lower ones must go, and do
    assert [e.request_id for s in steps for e in s.admissions] == ["top"]
    assert core.seqs["low"].preemptions == core.seqs["mid"].preemptions == 1
    run_until_done(core)

    core = core_of("priority", spec)
    core.add(seq("peer", 12, 8, tenancy=Tenancy(priority=0)))
    core.add(seq("low", 4, 8, tenancy=Tenancy(priority=9)))
    step(core)
    core.add(seq("top", 16, 2, tenancy=Tenancy(priority=0)))
    step(core)  # freeing low would leave it short (peer, its equal, holds the rest): no one goes
    assert core.preemptions == 0 and core.seqs["top"].admitted_at is None
    assert run_until_done(core)["top"]


def test_under_kv_pressure_a_running_high_priority_request_is_kept_and_the_low_one_goes():
    spec = WorkerSpec("w0", num_blocks=8, block_size=4, max_context=128)  # 32 positions
    core = core_of("priority", spec)  # paged, the default
    core.add(seq("high", 4, 14, tenancy=Tenancy(priority=0)))
    core.add(seq("low", 4, 14, tenancy=Tenancy(priority=1)))
    core.add(seq("high2", 4, 14, tenancy=Tenancy(priority=0)))
    for _ in range(12):
        step(core)
        check_invariants(core)
    assert core.seqs["low"].preemptions >= 1
    assert core.seqs["high"].preemptions == 0 and core.seqs["high2"].preemptions == 0
    outputs = run_until_done(core)
    assert all(len(out) == 14 for out in outputs.values())


def test_the_ordering_is_counted_as_what_holds_the_oldest_request_back():
    core = core_of("priority", max_running=1)
    core.add(seq("run", 4, 20, tenancy=Tenancy(priority=0)))
    step(core)
    core.add(seq("old", 4, 4, tenancy=Tenancy(priority=5)))
    core.add(seq("new", 4, 4, tenancy=Tenancy(priority=1)))
    step(core)
    assert core.stalls[StallReason.PRIORITY] >= 1
    assert core.snapshot().stalls.get("priority", 0) >= 1
    fcfs = core_of("fcfs", max_running=1)
    fcfs.add(seq("run", 4, 20))
    fcfs.add(seq("old", 4, 4))
    step(fcfs)
    step(fcfs)
    assert not any(fcfs.stalls[r] for r in (StallReason.PRIORITY, StallReason.FAIR_SHARE))


def backlog(core: Scheduler, tenant: str, n: int, weight: float = 1.0, prompt=8, out=8):
    for i in range(n):
        core.add(seq(f"{tenant}{i}", prompt, out, tenancy=Tenancy(tenant=tenant, weight=weight)))


def served_per_step(core: Scheduler, steps: int) -> list[Counter]:
    """The weighted service (prompt 1, sampled 2) each tenant got in each step."""
    out = []
    for _ in range(steps):
        got: Counter = Counter()
        for s in step(core):
            for w in s.chunks:
                got[w.seq.tenancy.tenant] += w.num_tokens
            for d in s.decodes:
                got[d.tenancy.tenant] += 2 * s.repeat
        check_invariants(core)
        out.append(got)
    return out


def test_two_backlogged_tenants_of_equal_weight_stay_within_the_vtc_bound_at_every_step():
    core = core_of("fair", max_running=4, token_budget=16)
    backlog(core, "a", 60, prompt=12, out=6)
    backlog(core, "b", 60, prompt=4, out=10)
    total = Counter()
    # VTC's bound for backlogged clients: 2 * max(w_p * L_in + w_q * L_out, w_q * M)
    bound = 2 * max(12 + 2 * 10, 2 * 16)
    for got in served_per_step(core, 150):
        total.update(got)
        assert abs(total["a"] - total["b"]) <= bound, total
    assert min(total["a"], total["b"]) > 200  # both were served throughout


def test_weights_two_to_one_give_two_to_one_service():
    core = core_of("fair", max_running=4, token_budget=16)
    backlog(core, "a", 200, weight=2.0)
    backlog(core, "b", 200, weight=1.0)
    total = Counter()
    for got in served_per_step(core, 400):
        total.update(got)
    assert abs(total["a"] / total["b"] - 2.0) <= 0.1, total


def test_a_tenant_beside_anothers_burst_is_admitted_at_once_under_fair():
    core = core_of("fair", max_running=4)
    backlog(core, "batch", 12, prompt=8, out=40)
    for _ in range(5):
        step(core)
    core.add(seq("chat", 4, 4, tenancy=Tenancy(tenant="chat")))
    # lifted to the burst's counter it ties with it (the older head first); the burst's next
    # step of service puts it ahead, and it preempts the burst's newest for a running place
    steps = step(core) + step(core)
    assert "chat" in [e.request_id for s in steps for e in s.admissions]
    assert core.stalls[StallReason.MAX_RUNNING] and core.preemptions == 1
    outputs = run_until_done(core)
    assert len(outputs["chat"]) == 4 and all(len(outputs[f"batch{i}"]) == 40 for i in range(12))


def test_a_tenant_arriving_beside_a_burst_that_never_waited_banks_no_service():
    """`a`'s requests were all admitted at once, so `a` stopped waiting at counter 0 and ran
    on. `b` arriving later is lifted to `a`'s counter *now* (the paper's rule): from then on the
    two share the service about equally. Lifted to `a`'s counter as it stopped waiting, `b` had
    banked all of `a`'s service since and took 0.76 of the next 100 steps' service (0.95 when
    it came 40 steps later)."""
    spec = WorkerSpec("w0", num_blocks=4096, block_size=4, max_context=1024)
    core = core_of("fair", spec, max_running=8, token_budget=64, decode_steps=1)
    for i in range(8):
        core.add(seq(f"a{i}", 8, 150, ignore_eos=True, tenancy=Tenancy(tenant="a")))
    for _ in range(100):
        step(core)
    assert core.waiting.counters["a"] > 1000 and not core.waiting  # nobody waits
    for i in range(40):
        core.add(seq(f"b{i}", 8, 60, ignore_eos=True, tenancy=Tenancy(tenant="b")))
    assert core.waiting.counters["b"] == core.waiting.counters["a"]
    total: Counter = Counter()
    for n in range(100):
        if n % 4 == 0:  # a keeps sending
            core.add(seq(f"a{8 + n}", 8, 60, ignore_eos=True, tenancy=Tenancy(tenant="a")))
        for got in served_per_step(core, 1):
            total.update(got)
    assert 0.4 <= total["b"] / (total["a"] + total["b"]) <= 0.6, total


def test_under_fcfs_the_same_chat_waits_behind_the_burst():
    core = core_of("fcfs", max_running=4)
    backlog(core, "batch", 12, prompt=8, out=40)
    for _ in range(5):
        step(core)
    core.add(seq("chat", 4, 4, tenancy=Tenancy(tenant="chat")))
    for _ in range(20):
        step(core)
    assert core.seqs["chat"].admitted_at is None


def test_the_policy_changes_live_and_the_invariants_hold_under_random_tenants():
    rng = random.Random(7)
    spec = WorkerSpec("w0", num_blocks=40, block_size=4, max_context=96)
    core = core_of("fcfs", spec, max_running=6, token_budget=24)
    expected: dict[str, int] = {}
    added = {}
    policies = list(QueuePolicy)
    for i in range(300):
        if i < 200 and rng.random() < 0.4:
            rid = f"r{i}"
            out = rng.randint(1, 20)
            tenancy = Tenancy(
                tenant=rng.choice("abcd"),
                weight=rng.choice([0.5, 1.0, 3.0]),
                priority=rng.randint(-2, 2),
                ttft_s=rng.choice([0.0, 0.001, 1e6]),
            )
            added[rid] = seq(rid, rng.randint(1, 30), out, tenancy=tenancy)
            core.add(added[rid])
            expected[rid] = out
        if rng.random() < 0.05:
            policy = rng.choice(policies)
            core.reconfigure(apply(core.config, {"queue_policy": policy.value}))
            assert core.waiting.policy is policy
        if rng.random() < 0.02 and core.seqs:
            victim = rng.choice(sorted(core.seqs))
            core.abort(victim)
            expected.pop(victim, None)
        step(core)
        check_invariants(core)
    run_until_done(core, limit=5000)
    assert {rid: len(added[rid].output_ids) for rid in expected} == expected
    assert all(added[rid].finish is Finish.LENGTH for rid in expected)
    assert core.setting_changes["queue_policy"] >= 1


def test_a_running_prompt_leaves_the_budget_to_a_head_that_outranks_it():
    for policy, admitted in (("priority", True), ("fcfs", False)):
        core = core_of(policy, token_budget=16)
        core.add(seq("long", 100, 4, tenancy=Tenancy(priority=5)))
        step(core)
        core.add(seq("short", 8, 4, tenancy=Tenancy(priority=0)))
        steps = step(core)
        ran = {w.seq.request_id: w.num_tokens for s in steps for w in s.chunks}
        if admitted:  # its 8 tokens first, the long prompt takes what they leave
            assert ran == {"short": 8, "long": 8}
        else:  # the running prompt first, the budget is gone
            assert ran == {"long": 16} and core.seqs["short"].admitted_at is None
        run_until_done(core)
