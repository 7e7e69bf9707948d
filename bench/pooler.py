"""PgBouncer's cost: CPU per item of a native batch drained direct to PostgreSQL and through
PgBouncer in transaction mode, in alternating runs (docs/pooler.md, "Cost"; goal: pooled within 10%).

    .venv/bin/python -m bench.pooler

Each run, direct or pooled, is a process of its own (Django's settings and the Celery app are read once
per process) on a fresh database, migrated (over DATABASE_DIRECT_URL for the pooled runs): the fake
provider at 0 ms, one item worker (8 slots) with its control worker and beat, started from
relay.processes as compose does; the `dir` payload store. A warm-up batch first (first-use costs:
imports, catalog, connections, PgBouncer's server pool), then the measured native batch. CPU over the
measured batch only, per group of processes, read from /proc and divided by its items:
- relay: the item worker, the control worker and beat (their whole process trees);
- pg: the client backends of the bench's database (pg_stat_activity, sampled every second, as
  bench/scale_drain.py counts them), but not the driver's: this process submits and polls over a
  direct connection named `relay-bench-driver` in both modes, so neither the submission's COPY nor the
  polling is counted. Autovacuum workers are counted apart (they come when they come) and left out of
  the total;
- pgbouncer: the PgBouncer process, a throwaway of this bench's own (scripts/pgbouncer.sh in its own
  directory), so nobody else's traffic is counted;
- upstream: the fake provider.

Knobs: BENCH_POOLER_ITEMS [2000] items of the measured batch, BENCH_POOLER_WARMUP [200] items of the
warm-up batch, BENCH_POOLER_RUNS [3] direct/pooled pairs, BENCH_REDIS_DB_POOLER_DIRECT [9] and
BENCH_REDIS_DB_POOLER_POOLED [10], BENCH_POOLER_PGBOUNCER_DIR [/tmp/relay-bench-pooler-pgbouncer];
databases relay_bench_pooler_direct and relay_bench_pooler_pooled (BENCH_DB_PREFIX replaces relay_bench).
Prints a table per pair, then every run, the medians per column, the pooled/direct ratio of the median
totals and of each pair; the load average at the start and at the end; the commit and a digest of the
uncommitted changes, at the start and at the end (each run imports the code afresh: an edit made during
the bench is measured by the runs after it, and the report says so).
"""

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

from bench import harness
from bench.measure import CpuWatch, load, machine, pg_backends, process_tree, table
from bench.scale_drain import ROOT, PooledStack, pgbouncer

ITEMS = harness.env_int("BENCH_POOLER_ITEMS", 2000)
WARMUP = harness.env_int("BENCH_POOLER_WARMUP", 200)
RUNS = harness.env_int("BENCH_POOLER_RUNS", 3)
REDIS_DB = {
    "direct": harness.env_int("BENCH_REDIS_DB_POOLER_DIRECT", 9),
    "pooled": harness.env_int("BENCH_REDIS_DB_POOLER_POOLED", 10),
}
PGBOUNCER_DIR = os.environ.get("BENCH_POOLER_PGBOUNCER_DIR") or "/tmp/relay-bench-pooler-pgbouncer"
DRIVER = "relay-bench-driver"
GROUPS = ("relay", "pg", "pgbouncer", "upstream")  # the total's columns, in order
RESULT = "RESULT "


# --- one run, in a process of its own --------------------------------------------------------------


def _driver_env(stack: harness.Stack, pooled: bool) -> None:
    """This process (migrate, seed, submit, poll) talks to PostgreSQL directly under a name of its own, in
    both modes, so that pg_backends can leave its backend out; the relay's processes get stack.app_env()."""
    url = f"{stack.database_url}?application_name={DRIVER}"
    os.environ["DATABASE_URL"] = url
    os.environ.pop("DATABASE_POOLER", None)
    if pooled:
        os.environ["DATABASE_DIRECT_URL"] = url  # PooledStack.fresh migrates over the `direct` alias
    else:
        os.environ.pop("DATABASE_DIRECT_URL", None)


def _one(mode: str, pooler: tuple[int, int] | None) -> dict:
    pooled = mode == "pooled"
    name, redis_db = harness.db_name(f"_pooler_{mode}"), REDIS_DB[mode]
    stack = PooledStack(db_name=name, redis_db=redis_db) if pooled else harness.Stack(db_name=name, redis_db=redis_db)
    if pooled:
        stack.pooler_port = pooler[0]
    with stack:
        _driver_env(stack, pooled)
        stack.fresh()
        from batches.models import Item
        from bench import scale
        from bench.batch_drain import wait_completed
        from bench.catalog import seed_catalog
        from core import auth

        upstream = stack.start_upstream(0.0)
        principal = auth.principal_for_key(seed_catalog(upstream.url))
        worker = stack.start_worker("pooler", beat=True)
        rest = [p for p in stack.procs if p.name.startswith(("control-", "beat-"))]
        relay_procs = [worker, *rest]

        harness.log(f"{mode}: warm-up batch of {WARMUP} items")
        wait_completed(scale._submit(principal, WARMUP).pk, timeout=600)
        time.sleep(2)  # the warm-up's tail (the control worker's wake-ups) out of the window
        upstream.reset_stats()
        groups = {
            "relay": lambda: [q for p in relay_procs for q in process_tree(p.popen.pid)],
            "pg": lambda: pg_backends(name, backend_type="client backend", but_app=DRIVER),
            "pgbouncer": lambda: [pooler[1]] if pooled else [],
            "upstream": lambda: process_tree(upstream.proc.popen.pid),
            "autovacuum": lambda: pg_backends(name, backend_type="autovacuum worker"),
        }
        harness.log(f"{mode}: measured batch of {ITEMS} items")
        with CpuWatch(groups) as cpu:
            batch = scale._submit(principal, ITEMS)
            wait_completed(batch.pk, timeout=3600)
        harness.log(f"{mode}: {cpu.describe(ITEMS, 'item')}")
        per = cpu.per_unit_ms(ITEMS)
        failed = Item.objects.filter(batch_id=batch.pk).exclude(state="completed")
        not_completed = failed.count()
        if not_completed:  # a broken drain is no cost figure: say why (the relay's own error of one item)
            one = failed.values("state", "error_code", "error").first()
            harness.log(f"{mode}: {not_completed} items not completed, e.g. {one}")
        return {
            "mode": mode,
            "items": ITEMS,
            "wall_s": cpu.elapsed,
            "ms": {g: per[g] for g in GROUPS},
            "total": sum(per[g] for g in GROUPS),
            "autovacuum": per["autovacuum"],
            "busy": cpu.machine_busy,
            "upstream_calls": upstream.stats()["requests"],
            "not_completed": not_completed,
        }


# --- the alternating runs ----------------------------------------------------------------------------


def _child(mode: str, pooler: tuple[int, int]) -> dict:
    """Run one measurement in a child process, passing its log through; its result is its last line."""
    argv = [sys.executable, "-m", "bench.pooler", "run", mode, str(pooler[0]), str(pooler[1])]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True, preexec_fn=harness._die_with_parent)
    result = None
    try:
        for line in proc.stdout:
            if line.startswith(RESULT):
                result = json.loads(line[len(RESULT) :])
            else:
                print(line, end="", flush=True)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
    if proc.returncode != 0 or result is None:
        raise SystemExit(f"the {mode} run failed (exit {proc.returncode}); its output is above")
    return result


def _row(label: str, r: dict) -> list:
    ms = r["ms"]
    return [
        label,
        f"{r['wall_s']:.1f}",
        f"{r['items'] / r['wall_s']:.0f}",
        f"{ms['relay']:.2f}",
        f"{ms['pg']:.2f}",
        f"{ms['pgbouncer']:.2f}" if r["mode"] == "pooled" else "-",
        f"{ms['upstream']:.2f}",
        f"{r['total']:.2f}",
        f"{r['autovacuum']:.2f}",
        f"{r['busy']:.2f}",
        f"{r['upstream_calls']}",
        f"{r['not_completed']}",
    ]


HEADERS = [
    "run",
    "wall s",
    "items/s",
    "relay ms/item",
    "pg ms/item",
    "pgbouncer ms/item",
    "upstream ms/item",
    "total ms/item",
    "autovacuum (not in total)",
    "machine busy cores",
    "upstream calls",
    "not completed",
]


def _medians(runs: list[dict]) -> dict:
    totals = [r["total"] for r in runs]
    return {
        "ms": {g: statistics.median(r["ms"][g] for r in runs) for g in GROUPS},
        "total": statistics.median(totals),
        "range": (min(totals), max(totals)),
    }


def _tree() -> str:
    """The code measured: HEAD and a digest of the uncommitted changes to tracked files (not the docs). Each run imports
    the code afresh, so an edit during the bench makes its runs measure different code: compared at the end."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    code = ["--", ".", ":(exclude)*.md"]
    diff = subprocess.run(["git", "diff", "HEAD", *code], cwd=ROOT, capture_output=True)
    files = subprocess.run(["git", "diff", "HEAD", "--name-only", *code], cwd=ROOT, capture_output=True, text=True)
    changed = files.stdout.split()
    if not changed:
        return f"commit {head.stdout.strip()}, no uncommitted changes"
    digest = hashlib.sha1(diff.stdout).hexdigest()[:10]
    return f"commit {head.stdout.strip()} + uncommitted changes to {len(changed)} files (diff {digest})"


def main() -> None:
    harness._install_signal_handlers()
    start_load, start_tree = load(), _tree()
    harness.log(f"start: {start_load}; {start_tree}")
    pooler = pgbouncer(PGBOUNCER_DIR)
    harness.log(f"PgBouncer (transaction mode) on port {pooler[0]}, pid {pooler[1]}, in {PGBOUNCER_DIR}")
    runs: list[dict] = []
    try:
        for i in range(1, RUNS + 1):
            pair = [_child(mode, pooler) for mode in ("direct", "pooled")]
            runs += pair
            print(f"\npair {i} of {RUNS}  ({load()})")
            print(table(HEADERS, [_row(f"{r['mode']} {i}", r) for r in pair]) + "\n", flush=True)
    finally:
        env = {**os.environ, "PGBOUNCER_DIR": PGBOUNCER_DIR}
        subprocess.run(["bash", "scripts/pgbouncer.sh", "stop"], cwd=ROOT, env=env, capture_output=True)
    _report(runs, start_load, start_tree)


def _report(runs: list[dict], start_load: str, start_tree: str) -> None:
    print()
    print(f"machine: {machine()}")
    end_tree = _tree()
    print(
        f"code: {start_tree}" if end_tree == start_tree else f"code CHANGED during the runs: {start_tree} -> {end_tree}"
    )
    print(f"at the start: {start_load}")
    print(f"at the end:   {load()}")
    print(
        f"{ITEMS:,}-item native batch (after a {WARMUP}-item warm-up), fake provider at 0 ms, one item worker "
        "(8 slots) with its control worker and beat, dir payload store; direct vs through PgBouncer "
        f"(transaction mode), {RUNS} alternating pairs"
    )
    print(table(HEADERS, [_row(f"{r['mode']} {1 + n // 2}", r) for n, r in enumerate(runs)]))
    print()
    med = {mode: _medians([r for r in runs if r["mode"] == mode]) for mode in ("direct", "pooled")}
    rows = []
    for mode, label in (("direct", "direct"), ("pooled", "through PgBouncer")):
        m = med[mode]
        rows.append(
            [
                label,
                f"{m['ms']['relay']:.2f}",
                f"{m['ms']['pg']:.2f}",
                f"{m['ms']['pgbouncer']:.2f}" if mode == "pooled" else "-",
                f"{m['ms']['upstream']:.2f}",
                f"{m['total']:.2f} ({m['range'][0]:.2f}-{m['range'][1]:.2f})",
            ]
        )
    print("medians, CPU ms per item:")
    print(table(["", "relay processes", "PostgreSQL backends", "PgBouncer", "fake upstream", "total (min-max)"], rows))
    broken = [f"{r['mode']} {1 + n // 2}" for n, r in enumerate(runs) if r["not_completed"]]
    if broken:
        print(f"WARNING: items not completed in {', '.join(broken)}: those figures measure failures, not the drain")
    ratio = med["pooled"]["total"] / med["direct"]["total"]
    pairs = [p["total"] / d["total"] for d, p in zip(runs[0::2], runs[1::2], strict=True)]
    print(
        f"\npooled / direct, median totals: {ratio:.3f} ({(ratio - 1) * 100:+.1f}%; goal ≤ +10%); per pair: "
        + ", ".join(f"{x:.3f}" for x in pairs)
        + f" (median {statistics.median(pairs):.3f})"
    )


def _run_child(mode: str, port: str, pid: str) -> None:
    result = _one(mode, (int(port), int(pid)))
    print(RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        _run_child(*sys.argv[2:5])
    else:
        main()
