"""Provider batch mode — an OpenAI-surface batch sent to the provider's own batch API.

    .venv/bin/python -m bench.provider_batch      (or: BENCH_ONLY=provider make bench)

Starts, on loopback only: the fake provider (bench/fake_upstream.py, its own process: devkit.upstream with
devkit.batches' OpenAI Files + Batches and Anthropic Message Batches), the relay web server as production
runs it (relay.webserver's argv) on a fresh database `relay_bench_provider` and Redis db 8
(BENCH_REDIS_DB_PROVIDER), and the background processes as compose declares them (relay.processes: the item
worker, the control worker, beat). The catalog is the batch benchmark's (bench/catalog.py), plus two models on
the same host, upstream model and pricing: `gpt-4o-provider` (batch_mode provider) and gpt-4o itself (relay).
The relay's poll cadence is the default (RELAY_PROVIDER_POLL_SECONDS 12, at most 5 polls a minute).

1. warm-up: BENCH_PROVIDER_WARMUP (2,000) records in provider mode with a job of 5 s at the fake: every
   process loads the provider code before the figures, and a small batch's CPU and memory to compare with.
2. the batch: BENCH_PROVIDER_ITEMS (50,000) records (`{custom_id, method, url, body}`, ~650 B each) for
   gpt-4o-provider: `POST /v1/files` then `POST /v1/batches`; the fake runs the job for
   BENCH_PROVIDER_JOB_SECONDS (120). Timed and measured by phase, from the relay's rows (read every 0.5 s):
   submit + send (upload, create, validation: the records delegated to a provider job; the job's input
   built and uploaded, the upstream batch created), polling (the job running at the provider; a client
   reads the batch's request_counts every 10 s), results (its results written to the items with their
   usage events, the batch finalized). Per phase: CPU per record of each process group from /proc (web,
   control worker, item worker, beat, the PostgreSQL backends of the database; Redis, the fake and this
   client apart), peak RSS of the web workers and the control worker's processes, and the RSS every second
   of the process that grew most during the results; a timeline from the relay's own timestamps.
   Upstream requests: from the fake's own log of batch-API requests (GET /_bench/batches): polls of the
   job, and the most requests about it in any 60 s (the issue's bound: 5).
   Then the output file is fetched (`GET /v1/files/{id}/content`) and its lines counted.
3. cost: the batch's usage events (`cost_nano_usd`: what the operator pays; `billed_cost_nano_usd`: what it
   bills). Relay mode, the same 50,000 records: computed exactly from the same events' token counts
   at the list price (usage.pricing.cost_nano_usd; billed by the same rule, the list price less the batch
   discount), and measured on a sample of BENCH_PROVIDER_RELAY_SAMPLE (2,000) records run by the relay's
   item worker (fake at 0 ms) for gpt-4o, scaled per record.

Knobs: BENCH_PROVIDER_ITEMS (50000), BENCH_PROVIDER_JOB_SECONDS (120), BENCH_PROVIDER_WARMUP (2000; 0 skips),
BENCH_PROVIDER_RELAY_SAMPLE (2000; 0 skips), BENCH_ITEM_BYTES (650), BENCH_REDIS_DB_PROVIDER (8),
BENCH_KEEP_DB=1 (keep relay_bench_provider), BENCH_PYSPY=<dir> (py-spy profiles of the control worker's
processes during submit + send and results; BENCH_PYSPY_GIL=1: only the thread holding the GIL).
Prints figures; asserts nothing about timings.

This module runs the batches in order and prints the report; the measurement pieces (the input file, the
phases, the upstream requests, the cost) are in bench/provider_batch_parts.py.
"""

import os
import time

import requests

from bench import catalog, harness, measure
from bench.harness import env_int, log
from bench.measure import CpuWatch
from bench.provider_batch_parts import (
    PROVIDER_MODEL,
    costs,
    db,
    fetch_output,
    pg_backends,
    run_batch,
    upstream_requests,
)

RELAY_MODEL = catalog.MODEL
POLL_BUDGET = 5  # at most 5 upstream requests about one job in any minute (RELAY_PROVIDER_POLL_SECONDS=12)
RELAY_GROUPS = ("web", "control worker", "item worker", "beat", "postgres")


# --- the run -------------------------------------------------------------------------------------------


def run() -> dict:
    n = env_int("BENCH_PROVIDER_ITEMS", 50_000)
    job_seconds = float(os.environ.get("BENCH_PROVIDER_JOB_SECONDS") or 120)
    warmup_n = env_int("BENCH_PROVIDER_WARMUP", 2_000)
    sample_n = env_int("BENCH_PROVIDER_RELAY_SAMPLE", 2_000)
    item_bytes = env_int("BENCH_ITEM_BYTES", 650)
    started = time.monotonic()
    r: dict = {"n": n}
    with harness.Stack(db_name=harness.db_name("_provider"), redis_db=env_int("BENCH_REDIS_DB_PROVIDER", 8)) as stack:
        stack.keep_db = os.environ.get("BENCH_KEEP_DB") == "1"
        log(f"fresh database {stack.db_name}, Redis db {stack.redis_db}; migrating")
        stack.fresh()
        upstream = stack.start_upstream(0)
        key = catalog.seed_catalog(upstream.url)
        catalog.add_batch_binding(PROVIDER_MODEL, "provider")
        web = stack.start_web(production=True)
        from django.conf import settings

        r["poll_s"] = (settings.RELAY_PROVIDER_POLL_SECONDS, settings.RELAY_PROVIDER_POLL_MAX_SECONDS)
        worker = stack.start_worker()
        procs = {p.name: p for p in stack.procs}
        control, beat = procs["control-bench"], procs["beat-bench"]
        log(f"fake provider {upstream.url}, relay {web.url}; worker, control worker and beat started")
        for _ in range(20):  # every module loaded in both gunicorn workers before the baselines
            requests.get(f"{web.url}/v1/batches?limit=1", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        groups = {
            "web": lambda: measure.process_tree(web.proc.popen.pid),
            "control worker": lambda: measure.process_tree(control.popen.pid),
            "item worker": lambda: measure.process_tree(worker.popen.pid),
            "beat": lambda: measure.process_tree(beat.popen.pid),
            "postgres": lambda: pg_backends(stack.db_name),
            "redis (whole server)": lambda: harness.redis_server_pids(stack.redis_url),
            "fake provider": lambda: [upstream.proc.popen.pid],
            "this client": lambda: [os.getpid()],
        }
        mem_pids = {"web": web.worker_pids, "control worker": lambda: measure.process_tree(control.popen.pid)}

        if warmup_n:
            log(f"1. warm-up: {warmup_n} records in provider mode, a 5 s job at the fake")
            r["warmup"] = run_batch(
                web, key, upstream, stack.tmp, warmup_n, item_bytes, PROVIDER_MODEL, 5.0, groups, mem_pids
            )
        log(f"2. {n} records for {PROVIDER_MODEL} (provider mode), a {job_seconds:g} s job at the fake")
        r["main"] = main = run_batch(
            web, key, upstream, stack.tmp, n, item_bytes, PROVIDER_MODEL, job_seconds, groups, mem_pids
        )
        r["upstream"] = upstream_requests(upstream, main)
        log("output file of that batch: GET /v1/files/{id}/content")
        r["output"] = fetch_output(web, key, main["public_id"], groups)
        r["cost"] = db(costs, main["pk"])
        if sample_n:
            log(f"3. relay-mode sample: {sample_n} records for {RELAY_MODEL} run by the item worker, fake at 0 ms")
            r["sample"] = run_batch(
                web, key, upstream, stack.tmp, sample_n, item_bytes, RELAY_MODEL, 0, groups, mem_pids
            )
            r["sample_cost"] = db(costs, r["sample"]["pk"])
    r["wall_s"] = time.monotonic() - started
    print_report(r)
    return r


# --- the report -----------------------------------------------------------------------------------------


def _usd(nanos: float) -> str:
    return f"{nanos / 1e9:,.4f}"


def _relay_ms(cpu: CpuWatch, n: int) -> float:
    return sum(cpu.used[g] for g in RELAY_GROUPS) * 1000 / n


def _cpu_table(r: dict) -> str:
    n = r["n"]
    names = list(r["total"].groups)
    rows = []
    for row in [*r["phases"], {"phase": "all", "seconds": sum(p["seconds"] for p in r["phases"]), "cpu": r["total"]}]:
        per = row["cpu"].per_unit_ms(n)
        rows.append(
            [
                row["phase"],
                f"{row['seconds']:.1f}",
                *[f"{per[g] * 1000:.1f}" for g in names],
                f"{_relay_ms(row['cpu'], n) * 1000:.1f}",
            ]
        )
    return measure.table(["phase", "s", *[f"{g} µs" for g in names], "relay µs/record"], rows)


def _mem_lines(r: dict) -> list[str]:
    out = []
    for label in r["phases"][0]["mem"]:
        pids = set().union(*(row["mem"][label].keys() for row in r["phases"]))
        first = {p: next(row["mem"][label][p][0] for row in r["phases"] if p in row["mem"][label]) for p in pids}
        peak = {p: max(row["mem"][label][p][1] for row in r["phases"] if p in row["mem"][label]) for p in pids}
        top = max(pids, key=lambda p: peak[p])
        grew = max(pids, key=lambda p: peak[p] - first[p])
        per_phase = ", ".join(
            f"{row['phase']} {max(v[1] for v in row['mem'][label].values()) / 1024:.1f}" for row in r["phases"]
        )
        out.append(
            f"  {label} ({len(pids)} processes): highest peak {peak[top] / 1024:.1f} MiB (pid {top}, "
            f"{first[top] / 1024:.1f} before the batch); most growth +{(peak[grew] - first[grew]) / 1024:.1f} MiB "
            f"(pid {grew}: {first[grew] / 1024:.1f} → {peak[grew] / 1024:.1f}); peak by phase (MiB): {per_phase}"
        )
        last = r["phases"][-1]  # the results: the process that grew most in it, over the phase's time
        mover = max(last["mem"][label], key=lambda p: last["mem"][label][p][1] - last["mem"][label][p][0])
        points = [row[mover] for row in last["series"] if mover in row]
        if len(points) >= 5:
            at = [points[round(q * (len(points) - 1))] / 1024 for q in (0, 0.25, 0.5, 0.75, 1)]
            out.append(
                f"    during '{last['phase']}' ({last['seconds']:.0f} s), RSS of pid {mover} at 0/25/50/75/100% of it: "
                + " / ".join(f"{v:.1f}" for v in at)
                + " MiB"
            )
    return out


def print_report(r: dict) -> None:
    print()
    print(f"== Provider batch mode — {measure.machine()}, {time.strftime('%Y-%m-%d %H:%M')}")
    m = r["main"]
    poll, poll_max = r["poll_s"]
    print(
        f"{m['n']:,} records ({m['bytes'] / measure.MiB:.1f} MiB JSONL) for {PROVIDER_MODEL} (batch_mode provider), "
        f"OpenAI surface; the fake's job takes {m['job_seconds']:g} s; relay polls every {poll:g} s backing off to "
        f"{poll_max:g} s (defaults)"
    )
    print(
        f"upload {m['upload_s']:.2f} s, create {m['create_s']:.2f} s; upload → completed "
        f"{m['t_end'] - m['t_start']:.0f} s; items {m['states']}; events by executed_by {m['executed_by']}; jobs "
        f"{[(j['status'], j['records']) for j in m['jobs']]}"
    )
    print("timeline from the batch's creation (s): " + ", ".join(f"{name} {t:.1f}" for name, t in m["timeline"]))
    print(f"request_counts.completed seen by a client every 10 s while the job ran: {m.get('counts_seen')}")
    print("CPU per record by phase and process (µs); relay = web + control worker + item worker + beat + postgres:")
    print(_cpu_table(m))
    t = m["total"]
    work = sum(_relay_ms(row["cpu"], m["n"]) for row in m["phases"] if row["phase"] != "polling")
    line = f"relay CPU per record, whole run: {_relay_ms(t, m['n']):.3f} ms (target ≤ 0.3 ms); "
    line += f"without the polling phase {work:.3f} ms"
    idle = next((row for row in m["phases"] if row["phase"] == "polling"), None)
    if idle:
        per_s = sum(idle["cpu"].used[g] for g in RELAY_GROUPS) / idle["seconds"] * 1000
        line += f" (while the job ran the relay used {per_s:.0f} ms of CPU a second: Celery's and beat's own ticks)"
    print(line)
    print(
        f"the whole machine was {t.machine_busy:.2f} of {os.cpu_count()} cores busy (steal {t.machine_steal:.2f}) "
        f"over {t.elapsed:.0f} s; load at the end {measure.load()}"
    )
    print("peak RSS (VmHWM reset per phase + VmRSS polled every 10 ms):")
    for line in _mem_lines(m):
        print(line)
    w = r.get("warmup")
    if w:
        print(
            f"warm-up batch of {w['n']:,} records (5 s job), for comparison: relay CPU "
            f"{_relay_ms(w['total'], w['n']):.3f} ms per record, {w['t_end'] - w['t_start']:.0f} s"
        )
        for line in _mem_lines(w):
            print(line)
    u = r["upstream"]
    print(f"upstream batch-API requests during the batch: {u['all']} ({u['ops']})")
    for j in u["jobs"]:
        print(
            f"  job {j['upstream_id']}: {j['polls']} polls (the relay counted {j['relay_polls']}) over "
            f"{j['poll_span_s']:.0f} s, at {j['poll_offsets_s']} s after its create; "
            f"{j['per_minute']:.2f} polls per minute of polling; most in any 60 s: {j['max_polls_60s']} polls, "
            f"{j['max_requests_60s']} requests about the job (bound {POLL_BUDGET})"
        )
    o = r["output"]
    print(
        f"output file: {o['lines']:,} lines, {o['bytes'] / measure.MiB:.1f} MiB in {o['seconds']:.2f} s "
        f"(web {o['cpu'].per_unit_ms(max(1, o['lines']))['web'] * 1000:.1f} µs per line); "
        f"request_counts {o['request_counts']}"
    )
    c = r["cost"]
    n = m["n"]
    rows = [
        [
            "provider (measured: its usage events)",
            f"{n:,}",
            _usd(c["cost"]),
            _usd(c["billed"]),
            _usd(c["billed"] - c["cost"]),
        ],
        [
            "relay (computed: the same tokens at list price)",
            f"{n:,}",
            _usd(c["list"]),
            _usd(c["list_billed"]),
            _usd(c["list_billed"] - c["list"]),
        ],
    ]
    s, sc = r.get("sample"), r.get("sample_cost")
    if s and sc:
        k = n / s["n"]
        rows.append(
            [
                f"relay (measured on {s['n']:,} run by the relay, x{k:g})",
                f"{n:,}",
                _usd(sc["cost"] * k),
                _usd(sc["billed"] * k),
                _usd((sc["billed"] - sc["cost"]) * k),
            ]
        )
    print(
        f"cost to the operator (cost_nano_usd) and billed (billed_cost_nano_usd), USD; pricing "
        f"{c['rates'][0] / 1e9:g} / {c['rates'][1] / 1e9:g} USD per million input / output tokens, batch rates "
        f"half of them, batch discount "
        f"{c['discount_percent']}%; {c['events']:,} events, {c['input']:,} input and {c['output']:,} output tokens:"
    )
    print(measure.table(["mode", "records", "operator cost", "billed", "margin"], rows))
    if s and sc:
        print(
            f"  relay sample: {sc['events']:,} events, executed_by {s['executed_by']}, items {s['states']}; "
            f"{s['n']:,} records in {s['t_end'] - s['t_start']:.1f} s, relay CPU "
            f"{_relay_ms(s['total'], s['n']):.3f} ms per record (submit, run, finalize)"
        )
    print(f"benchmark wall time {r['wall_s']:.0f} s")
    print()


if __name__ == "__main__":
    run()
