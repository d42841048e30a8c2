"""Mutation testing, module by module: `make mutation` (docs/mutation.md).

For each group of modules below, mutmut runs in a copy of the tree (build/mutation/GROUP), never
in the work tree: it mutates only the group's modules and runs only the group's fast tests (and,
of those, only the tests that call the mutated function). The report of every group, with the
diff of each mutant that survived, goes to results/mutation/.

    python scripts/mutation.py                 # every group (not the quick ones: `part_of`)
    python scripts/mutation.py core sampling   # some groups
    python scripts/mutation.py prefix          # the prefix cache's part of core
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "mutation"
OUT = ROOT / "results" / "mutation"
PACKAGES = ("gateway", "llmcommon", "llmserve", "scheduler_svc", "worker_svc")
DATA = ("docs", "data")  # read by tests (the metrics tables: tests/test_metrics_docs.py; the
# committed cost model: tests/test_bench_cost_model.py)
KILLED = {"killed", "timeout", "caught by type check", "segfault"}
GOAL = 90.0
SCHEDULER_CRASHED = 70
# one thread per test process: mutants run side by side on a small machine, and torch's thread
# pool (sampling) is ten times slower when its threads wait for a busy core
THREADS = {"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}


@dataclass(frozen=True, slots=True)
class Group:
    modules: tuple[str, ...]  # what mutmut mutates
    tests: tuple[str, ...]  # the fast tests that pin those modules down
    functions: tuple[str, ...] = ()  # only these mutants (mutmut name globs); () = all
    part_of: str = ""  # a quick run over part of that group: only when named


# the core's modules, one concern each (scheduler_svc/core/__init__.py only re-exports)
CORE = tuple(
    f"scheduler_svc/core/{name}.py"
    for name in "state membership admission planning runs failures scheduler".split()
)
CORE_TESTS = (
    "tests/test_core_behaviour.py",
    "tests/test_core_rules.py",
    "tests/test_blocks.py",
    "tests/test_placement.py",
    "tests/test_overlap.py",
    "tests/test_seed_figures.py",
    "tests/test_invariants.py",
    "tests/test_step_checks.py",
    "tests/test_bench_core_cost.py",
    "tests/test_prefix_core.py",
    "tests/test_prefix_rules.py",
    "tests/test_kv.py",
    "tests/test_core_outputs.py",
    "tests/test_time_budget.py",
    "tests/test_step_model.py",
    "tests/test_step_cost.py",
    "tests/test_bench_cost_model.py",
    # what pins reconfigure / KvManager.trim / BlockPool.shrink (live settings) and the
    # distrust of a failed chunk's KV (KvManager.distrust, Scheduler._distrust)
    "tests/test_live_settings_core.py",
    "tests/test_prefix_distrust.py",
    # what the core's other tests left unpinned (survivors of the core group's run at a5ac471)
    "tests/test_core_pins.py",
    "tests/test_kv_pins.py",
    "tests/test_blocks_pins.py",
    # decode runs (--decode-steps) and the step-time window (--step-time-window)
    "tests/test_decode_steps.py",
    "tests/test_decode_runs_auto.py",
    "tests/test_time_window.py",
    "tests/test_request_queue.py",
    # the queue's orderings (priority, fair, deadline) and what the core asks of them
    "tests/test_queue_orderings.py",
    "tests/test_core_tenants.py",
    "tests/test_order_view.py",
    # what those left unpinned (survivors of the queues group's first run)
    "tests/test_queue_pins.py",
    "tests/test_worker_return.py",
    # the room a head's victims leave (shared blocks, its cache hit, the decodes' growth)
    "tests/test_preemption_room.py",
    # the queues group's survivors after the room's counting grew (taken(), the orderings)
    "tests/test_victims_pins.py",
)
QUEUES = tuple(
    f"scheduler_svc/queues/{name}.py" for name in "base fcfs priority fair deadline".split()
)
GROUPS = {
    "core": Group(
        (
            *CORE,
            "scheduler_svc/request_queue.py",
            *QUEUES,
            "scheduler_svc/order_view.py",
            "scheduler_svc/kv.py",
            "scheduler_svc/kv_records.py",
            "scheduler_svc/blocks.py",
            "llmcommon/block_keys.py",
            "scheduler_svc/worker_state.py",
            "scheduler_svc/time_budget.py",
            "scheduler_svc/step_model.py",
            "scheduler_svc/step_cost.py",
        ),
        CORE_TESTS,
    ),
    # the prefix cache alone: a quick run after changing it
    "prefix": Group(
        (
            "scheduler_svc/blocks.py",
            "llmcommon/block_keys.py",
            "scheduler_svc/kv.py",
            "scheduler_svc/kv_records.py",
            *CORE,
            "scheduler_svc/worker_state.py",
        ),
        CORE_TESTS,
        part_of="core",
        functions=(
            "scheduler_svc.blocks.*",
            "llmcommon.block_keys.*",
            "scheduler_svc.kv.*",
            "scheduler_svc.kv_records.*",
            *(
                f"scheduler_svc.core.*.xǁ*ǁ{name}__mutmut_*"
                for name in (
                    "_distrust _failed_work _place _why_not _start _reap _preempt _admit "
                    "_chunk _plan_chunk _make_room schedule_workers"
                ).split()
            ),
            "scheduler_svc.worker_state.xǁWorkerStateǁreset_pool__mutmut_*",
            "scheduler_svc.worker_state.xǁWorkerStateǁreport__mutmut_*",
        ),
    ),
    # decode runs and the step-time window alone: a quick run after changing them
    "runs": Group(
        (*CORE, "scheduler_svc/worker_state.py", "scheduler_svc/run_rule.py"),
        CORE_TESTS,
        part_of="core",
        functions=(
            *(
                f"scheduler_svc.core.*.xǁ*ǁ{name}__mutmut_*"
                for name in "_lengthen _complete_run complete schedule_workers".split()
            ),
            "scheduler_svc.run_rule.*__mutmut_*",  # --decode-runs auto's rule and its inputs
            "scheduler_svc.core.scheduler.x__stepwise__mutmut_*",
            "scheduler_svc.worker_state.xǁWorkerStateǁtime_limit__mutmut_*",
        ),
    ),
    # workers failing and coming back: what waits for them, what fails, what is refused
    "membership": Group(
        (*CORE, "scheduler_svc/worker_state.py"),
        CORE_TESTS,
        part_of="core",
        functions=tuple(
            f"scheduler_svc.core.*.xǁ*ǁ{name}__mutmut_*"
            for name in (
                "_returning returning_workers fail_unplaceable _no_worker_message _place "
                "_check_can_ever_run fail_worker restore_worker remove_worker drain_worker"
            ).split()
        ),
    ),
    # the queue's orderings alone, with what the core asks of them
    "queues": Group(
        (*CORE, "scheduler_svc/request_queue.py", *QUEUES, "scheduler_svc/order_view.py"),
        CORE_TESTS,
        part_of="core",
        functions=(
            "scheduler_svc.queues.*",
            "scheduler_svc.request_queue.*",
            "scheduler_svc.order_view.*",
            *(
                f"scheduler_svc.core.*.xǁ*ǁ{name}__mutmut_*"
                for name in (
                    "_displace _victims _charge _reorder tenant_counts _admit _held_for_head"
                ).split()
            ),
        ),
    ),
    # the worker's side of a decode run: a step executed several times
    "session": Group(
        ("worker_svc/session.py",),
        (
            "tests/test_decode_steps.py",
            "tests/test_worker_session_run.py",
            "tests/test_worker_step_time.py",
            "tests/test_structured_worker.py",
            "tests/test_step_checks.py",
            "tests/test_prefix_worker.py",
        ),
        functions=tuple(
            f"worker_svc.session.xǁSessionǁ{name}__mutmut_*"
            for name in "run executed again advance".split()
        ),
    ),
    # speculative decoding: the proposers, the length rule, the replay of what speculation would
    # give, a draft in the core's step, and the worker's verification of it
    "speculation": Group(
        (
            "scheduler_svc/core/drafts.py",
            *(
                f"scheduler_svc/speculation/{name}.py"
                for name in "acceptance length ngram potential proposer suffix".split()
            ),
            "worker_svc/verify.py",
        ),
        (
            "tests/test_speculation_proposers.py",
            "tests/test_speculative_core.py",
            "tests/test_speculative_length.py",
            "tests/test_speculative_loop.py",
            "tests/test_speculative_random.py",
            "tests/test_spec_potential.py",
            "tests/test_spec_ceiling.py",
            "tests/test_verify.py",
            # what those left unpinned (survivors of the group's first run)
            "tests/test_speculation_pins.py",
        ),
    ),
    "sampling": Group(
        ("worker_svc/sampling.py",),
        (
            "tests/test_sampling.py",
            "tests/test_sampling_processors.py",
            "tests/test_sampling_narrow.py",
            "tests/test_sampling_pins.py",
        ),
    ),  # the settings it reads, with their checks: "validation"
    "text": Group(
        ("gateway/stops.py", "gateway/detokenizer.py"),
        ("tests/test_stops.py", "tests/test_detokenizer.py"),
    ),
    # the request's checks: the gateway's, and SamplingParams' (every hop's) with its wire form
    "validation": Group(
        (
            "gateway/validation.py",
            "llmcommon/sampling.py",
            "llmcommon/sampling_wire.py",
        ),
        ("tests/test_validation.py", "tests/test_sampling_params.py", "tests/test_ranges.py"),
    ),
    # who may send a request and as which tenant: the keys, their file, a request's tenancy and
    # the queue limits per tenant
    "auth": Group(
        (
            "gateway/auth.py",
            "llmcommon/auth.py",
            "gateway/api_keys.py",
            "gateway/request_tenancy.py",
            "gateway/queue_limits.py",
        ),
        ("tests/test_auth.py", "tests/test_api_keys.py"),
    ),
    # the label mapping: finish reasons and status codes (gateway), the families built from the
    # core's snapshot (scheduler), with their help text (docs/observability.md quotes it)
    "metrics": Group(
        ("gateway/metrics.py", "scheduler_svc/metrics.py"),
        ("tests/test_metrics.py", "tests/test_metrics_docs.py"),
        functions=(
            "gateway.metrics.x_on_finish__mutmut_*",
            "gateway.metrics.x__code__mutmut_*",
            "gateway.metrics.x__failure_code__mutmut_*",
            "gateway.metrics.xǁStatusCodeInterceptorǁ*",
            "scheduler_svc.metrics.x__queue__mutmut_*",
            "scheduler_svc.metrics.x__counters__mutmut_*",
            "scheduler_svc.metrics.x__workers__mutmut_*",
            "scheduler_svc.metrics.x__gauge__mutmut_*",
            "scheduler_svc.metrics.x__total__mutmut_*",
            "scheduler_svc.metrics.x__prefix_cache__mutmut_*",
            "scheduler_svc.metrics.x_families__mutmut_*",
        ),
    ),
}


def copy_tree(dest: Path) -> None:
    """The packages (generated stubs and built kernels included), the tests, the files tests
    read and the config."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in (*PACKAGES, "tests", *DATA):
        shutil.copytree(ROOT / name, dest / name, ignore=skip)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def group_config(group: Group) -> str:
    """pyproject.toml's [tool.mutmut] with this group's modules and tests."""
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    settings = base | {
        "only_mutate": list(group.modules),
        "pytest_add_cli_args_test_selection": list(group.tests),
        "also_copy": list(DATA),  # into mutants/, where the tests run
    }
    lines = ["[tool.mutmut]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"


def write_config(dest: Path, group: Group) -> None:
    """Replace the copy's [tool.mutmut] table (mutmut reads only pyproject.toml's)."""
    path = dest / "pyproject.toml"
    text = path.read_text()
    start = text.index("[tool.mutmut]")
    end = text.find("\n[", start + 1)
    rest = "" if end == -1 else text[end + 1 :]
    path.write_text(text[:start] + rest + "\n" + group_config(group))


def run_group(name: str, group: Group, children: int) -> dict:
    dest = WORK / name
    copy_tree(dest)
    write_config(dest, group)
    log = OUT / f"{name}.log"
    mutmut = Path(sys.executable).with_name("mutmut")
    started = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run(
            [str(mutmut), "run", "--max-children", str(children), *group.functions],
            cwd=dest,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=os.environ | THREADS,
        )
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"mutmut failed for {name} (exit {done.returncode}): see {log}")
    return summarize(name, dest, group, seconds)


def status_of(exit_code: int | None) -> str:
    """mutmut's status of a test run's exit code; 70 is the scheduler service's own exit when a
    step loop breaks (SchedulerService.died): a test that runs the service caught the mutant."""
    from mutmut.stats import status_by_exit_code

    return "killed" if exit_code == SCHEDULER_CRASHED else status_by_exit_code[exit_code]


def summarize(name: str, dest: Path, group: Group, seconds: float) -> dict:
    modules = {}
    for module in group.modules:
        meta = json.loads((dest / "mutants" / f"{module}.meta").read_text())
        status = {
            key: status_of(code)
            for key, code in meta["exit_code_by_key"].items()
            if not group.functions or any(fnmatch(key, f) for f in group.functions)
        }
        killed = sum(s in KILLED for s in status.values())
        tested = sum(s != "skipped" for s in status.values())
        modules[module] = {
            "mutants": tested,
            "killed": killed,
            "score": round(100.0 * killed / tested, 1) if tested else 100.0,
            "not_killed": {
                key: {"status": s, "diff": diff(dest, module, key)}
                for key, s in sorted(status.items())
                if s not in KILLED and s != "skipped"
            },
        }
    return {"group": name, "seconds": round(seconds), "tests": group.tests, "modules": modules}


def diff(dest: Path, module: str, key: str) -> str:
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    with contextlib.chdir(dest):  # mutmut reads its files relative to the tree it ran in
        return get_diff_for_mutant(key, path=module)


def report(results: list[dict]) -> str:
    lines = [
        "# Mutation report",
        "",
        "| group | module | mutants | killed | score | not killed | group's run time |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for module, m in r["modules"].items():
            lines.append(
                f"| {r['group']} | {module} | {m['mutants']} | {m['killed']} | {m['score']}% "
                f"| {len(m['not_killed'])} | {r['seconds']} s |"
            )
    for r in results:
        for module, m in r["modules"].items():
            if not m["not_killed"]:
                continue
            lines += ["", f"## {module} ({r['group']})", ""]
            for key, survivor in m["not_killed"].items():
                lines += [f"### {key} ({survivor['status']})", "", "```diff", survivor["diff"]]
                lines += ["```", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = ", ".join(f"{name} (part of {g.part_of})" for name, g in GROUPS.items() if g.part_of)
    parser.add_argument(
        "groups", nargs="*", help=f"of {', '.join(GROUPS)} (default: all but {parts})"
    )
    parser.add_argument("--children", type=int, default=2, help="mutants tested at once")
    args = parser.parse_args()
    unknown = set(args.groups) - GROUPS.keys()
    if unknown:
        parser.error(f"unknown group {', '.join(sorted(unknown))}: choose from {', '.join(GROUPS)}")
    OUT.mkdir(parents=True, exist_ok=True)
    for name in args.groups or [name for name, group in GROUPS.items() if not group.part_of]:
        print(f"mutation: {name} ...", flush=True)
        result = run_group(name, GROUPS[name], args.children)
        (OUT / f"{name}.json").write_text(json.dumps(result, indent=1))
        for module, m in result["modules"].items():
            print(f"  {module}: {m['killed']}/{m['mutants']} killed ({m['score']}%)", flush=True)
        print(f"  {result['seconds']} s", flush=True)
    # the report covers every group's last run, this one's and earlier ones
    files = [OUT / f"{name}.json" for name in GROUPS]
    results = [json.loads(f.read_text()) for f in files if f.exists()]
    (OUT / "report.md").write_text(report(results))
    print(f"report: {OUT / 'report.md'}")
    low = [m for r in results for m, v in r["modules"].items() if v["score"] < GOAL]
    if low:
        raise SystemExit(f"below {GOAL}% killed: {', '.join(low)}")


if __name__ == "__main__":
    main()
