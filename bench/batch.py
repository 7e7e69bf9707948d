"""The relay-native batch API under load, in one run.

    .venv/bin/python -m bench.batch          (or: make bench, which runs every benchmark)

Starts, on loopback only: the fake upstream (bench/fake_upstream.py, its own process), the relay web
server as in production (gunicorn relay.wsgi, 2 workers x 8 threads) on a fresh PostgreSQL database
`relay_bench_batch` and Redis db 10 (BENCH_REDIS_DB_BATCH), and later one Celery worker as in production
(`celery -A relay worker -Q batch,default -c 8`, with the sweeper embedded by -B). Payloads go to the
default `dir` store, in a temporary directory.

Figures, in the order they are measured:
 a. submit: time to 202 and peak RSS of the gunicorn worker that served a BENCH_ITEMS-item (50,000)
    native submission of about 31 MiB (`POST /v1/batches` {"shape": "openai", "requests": [...]}),
    written to disk first and streamed from the file by requests.
 c. results: the same batch is completed *directly in the database* (no worker is running yet): each
    item gets the fake upstream's canned chat.completion for its own request, stored through
    batches.storage.write_result (as the worker does), then the items are marked completed and the
    batch completed. Then `GET /v1/batches/{id}/results` is streamed to /dev/null: time to first byte,
    total time, bytes, results counted, peak RSS of the serving gunicorn worker.
    (BENCH_RESULTS_VIA_WORKER=1 instead runs the 50,000 items through the worker at 0 ms upstream
    latency and reports how long that took.) Also: one `GET /v1/batches/{id}` of that batch.
 b. throughput: the worker is started; BENCH_THROUGHPUT_ITEMS (2,000) items with the fake upstream at
    BENCH_LATENCY_MS (100 ms); items/s from the client's 202 to the batch's CompletedAt, and its ratio to
    the 8 slots / 100 ms = 80 items/s ceiling. Then BENCH_CEILING_ITEMS (1,000) at 0 ms latency: the
    worker's own ceiling on this machine. CPU per item (worker, Postgres, web, fake upstream) and how busy
    the whole machine was are printed with each, to show what bounds the figure.
 d. OpenAI-compatible upload (other engineer's endpoints): a BENCH_ITEMS-record JSONL file,
    `POST /v1/files` (multipart, purpose=batch) then `POST /v1/batches` {"input_file_id", "endpoint",
    "completion_window": "24h"}: time and peak RSS. Reports "skipped: /v1/files not available (404)"
    while the endpoint does not exist. Run after the worker is stopped, so that batch never runs.

Knobs (environment): BENCH_ITEMS (50000), BENCH_ITEM_BYTES (650: size of one request),
BENCH_THROUGHPUT_ITEMS (2000), BENCH_LATENCY_MS (100), BENCH_CEILING_ITEMS (1000; 0 skips the 0 ms run),
BENCH_SKIP_OPENAI_UPLOAD=1, BENCH_RESULTS_VIA_WORKER=1, BENCH_KEEP_DB=1 (keep relay_bench_batch),
BENCH_ONLY_IO=1 (parts a, c and d only: no worker is started, b, e and f are skipped; a few minutes),
BENCH_PYSPY=<dir> (record a py-spy profile, raw and speedscope, of the gunicorn workers while a and c
run, and of the item worker's process during b's first drain (wall time; BENCH_PYSPY_IDLE=0: CPU
only; BENCH_PYSPY_GIL=1: only the thread holding the GIL), into <dir>; needs py-spy in the venv and
ptrace rights).
Prints figures; asserts nothing about timings.

This module runs the figures in order and prints the report; the scenarios are in
bench/batch_drain.py (a, b, c, d) and bench/batch_capacity.py (e, f).
"""

import os
import time

import requests

from bench import catalog, harness, measure
from bench.batch_capacity import rate_limited_drain, scale_out
from bench.batch_drain import (
    SLOTS,
    complete_in_db,
    fetch_results,
    fetch_status,
    openai_upload,
    submit,
    throughput,
    wait_completed,
    write_native_body,
)
from bench.harness import env_float, env_int, log
from bench.measure import fmt_mem

# --- the run -----------------------------------------------------------------------------------------


def run() -> dict:
    n = env_int("BENCH_ITEMS", 50_000)
    item_bytes = env_int("BENCH_ITEM_BYTES", 650)
    tp_n = env_int("BENCH_THROUGHPUT_ITEMS", 2_000)
    latency = env_float("BENCH_LATENCY_MS", 100)
    ceiling_n = env_int("BENCH_CEILING_ITEMS", 1_000)
    large_n = env_int("BENCH_DRAIN_LARGE_ITEMS", 50_000)
    scale_n = env_int("BENCH_SCALE_ITEMS", 400)
    scale_latency = env_float("BENCH_SCALE_LATENCY_MS", 1000)
    scale_workers = [int(x) for x in (os.environ.get("BENCH_SCALE_WORKERS") or "1,2,3").split(",") if x.strip()]
    rl_n = env_int("BENCH_RL_ITEMS", 200)
    rl_rps = env_float("BENCH_RL_KEY_RPS", 5)
    rl_headers = os.environ.get("BENCH_RL_LIMIT_HEADERS", "1") != "0"
    via_worker = os.environ.get("BENCH_RESULTS_VIA_WORKER") == "1"
    only_io = os.environ.get("BENCH_ONLY_IO") == "1"
    started = time.monotonic()
    r: dict = {"n": n, "via_worker": via_worker}
    with harness.Stack(db_name=harness.db_name("_batch"), redis_db=env_int("BENCH_REDIS_DB_BATCH", 10)) as stack:
        stack.keep_db = os.environ.get("BENCH_KEEP_DB") == "1"
        log(f"fresh database {stack.db_name}, Redis db {stack.redis_db}; migrating")
        stack.fresh()
        upstream = stack.start_upstream(0)
        key = catalog.seed_catalog(upstream.url)
        web = stack.start_web()
        log(f"fake upstream {upstream.url}, relay {web.url} (gunicorn {' '.join(harness.GUNICORN_ARGS)})")
        procs = {"web": web.proc}
        cpu_groups = {
            "web (gunicorn)": lambda: measure.process_tree(web.proc.popen.pid),
            "worker (celery)": lambda: measure.process_tree(procs["worker"].popen.pid) if "worker" in procs else [],
            "postgres": lambda: measure.pg_backends(stack.db_name),
            "redis (whole server)": lambda: harness.redis_server_pids(stack.redis_url),
            "fake upstream": lambda: [upstream.proc.popen.pid],
            "this client": lambda: [os.getpid()],
        }
        for _ in range(20):  # load every module in both gunicorn workers before the baselines
            requests.get(f"{web.url}/v1/batches/0", headers={"Authorization": f"Bearer {key}"}, timeout=30)

        # a. submission
        body_path = stack.tmp / "native-batch.json"
        r["body_bytes"] = write_native_body(body_path, n, item_bytes)
        log(f"a. POST /v1/batches: {n} items, {r['body_bytes'] / measure.MiB:.1f} MiB, streamed from disk")
        with harness.profiled(web, "submit"):
            r["submit"] = submit(web, key, body_path, cpu_groups)
        body_path.unlink()
        batch_id = r["submit"]["id"]

        # c. results of that batch
        worker = None
        if via_worker:
            log(f"c. running the {n} items through the worker at 0 ms upstream latency")
            worker = procs["worker"] = stack.start_worker()
            t0 = time.time()
            wait_completed(batch_id, timeout=6 * 3600)
            r["prep"] = {"how": "worker", "seconds": time.time() - t0, "items": n}
        else:
            log(f"c. completing the {n} items in the database (storage.write_result + state update)")
            r["prep"] = {"how": "db", **complete_in_db(batch_id)}
        log("c. GET /v1/batches/{id}/results, streamed to /dev/null")
        with harness.profiled(web, "results"):
            r["results"] = fetch_results(web, key, batch_id, cpu_groups)
        with harness.profiled(web, "status"):
            st = fetch_status(web, key, batch_id)
        r["status_view"] = {k: v for k, v in st.items() if k != "body"}

        if only_io:
            log("BENCH_ONLY_IO=1: skipping b, e and f (no worker)")
            if worker is not None:
                worker.stop()
                procs.pop("worker")
        else:
            # b. throughput
            if worker is None:
                log("b. starting the Celery worker (-c 8, -B)")
                worker = procs["worker"] = stack.start_worker()
            log(f"b. throughput: {tp_n} items at {latency:g} ms upstream latency")
            # Profiled with BENCH_PYSPY: the item worker's pool processes, wall time (--idle; CPU only
            # with BENCH_PYSPY_IDLE=0).
            idle = os.environ.get("BENCH_PYSPY_IDLE", "1") != "0"
            with harness.profiled(
                web, "drain", pids=[worker.popen.pid, *measure.children_of(worker.popen.pid)], idle=idle
            ):
                r["tp"] = throughput(web, key, upstream, stack.tmp, tp_n, latency, item_bytes, cpu_groups)
            r["tp_results"] = fetch_results(web, key, r["tp"]["id"], cpu_groups)
            if ceiling_n > 0:
                log(f"b. worker ceiling: {ceiling_n} items at 0 ms upstream latency")
                r["tp0"] = throughput(web, key, upstream, stack.tmp, ceiling_n, 0, item_bytes, cpu_groups)
            if large_n > 0:
                log(f"b. drain of a large batch: {large_n} items at {latency:g} ms upstream latency")
                r["tp_large"] = throughput(web, key, upstream, stack.tmp, large_n, latency, item_bytes, cpu_groups)
            if rl_n > 0:
                log(f"f. rate-limited provider: {rl_n} items, 2 keys x {rl_rps:g} req/s (429 + Retry-After beyond)")
                r["rl"] = rate_limited_drain(web, key, upstream, stack.tmp, rl_n, latency, rl_rps, rl_headers)
            worker.stop()
            procs.pop("worker")

            # e. scale-out at a latency where CPU is not the limit
            r["scale"] = []
            for w in scale_workers:
                log(f"e. scale-out: {w} worker(s) x {SLOTS} slots, {scale_n} items at {scale_latency:g} ms")
                r["scale"].append(scale_out(stack, web, key, upstream, scale_n, scale_latency, w, item_bytes, procs))

        # d. OpenAI-compatible upload (no worker running: that batch is never executed)
        if os.environ.get("BENCH_SKIP_OPENAI_UPLOAD") == "1":
            r["openai"] = {"skipped": "skipped: BENCH_SKIP_OPENAI_UPLOAD=1"}
        else:
            log(f"d. OpenAI-compatible: {n}-record JSONL, POST /v1/files then POST /v1/batches")
            r["openai"] = openai_upload(web, key, stack.tmp, n, item_bytes)
    r["wall_s"] = time.monotonic() - started
    print_report(r)
    return r


def print_report(r: dict) -> None:
    n = r["n"]
    print()
    print(f"== Batch API (issues 4, 11) — {measure.machine()}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"load at the end: {measure.load()}")
    s = r["submit"]
    print(f"a. submit {n:,} items ({r['body_bytes'] / measure.MiB:.1f} MiB) -> 202 in {s['seconds']:.2f} s")
    print(f"   web memory: {fmt_mem(s['mem'])}; other worker at rest")
    print(f"   {s['cpu']}")
    print(f"   {_web_cpu(s, n, 'item')}")
    p = r["prep"]
    if p["how"] == "worker":
        how = f"run through the worker at 0 ms upstream latency in {p['seconds']:.1f} s"
        how += f" ({p['items'] / p['seconds']:.0f} items/s)"
    else:
        how = f"completed directly in the DB via storage.write_result in {p['seconds']:.1f} s (not a worker figure)"
    print(f"c. results: the {n:,}-item batch was {how}")
    res = r["results"]
    mib = res["bytes"] / measure.MiB
    print(
        f"   GET /v1/batches/{{id}}/results: {res['results']:,} results, {mib:.1f} MiB in {res['seconds']:.2f} s "
        f"(first byte {res['ttfb'] * 1000:.0f} ms, {mib / res['seconds']:.1f} MiB/s)"
        + ("" if res["well_formed"] else " — NOT WELL FORMED")
    )
    print(f"   web memory: {fmt_mem(res['mem'])}")
    print(f"   {res['cpu']}")
    print(f"   {_web_cpu(res, res['results'], 'result')}")
    sv = r["status_view"]
    print(
        f"   (also GET /v1/batches/{{id}} of that batch: {sv['bytes'] / measure.MiB:.1f} MiB in {sv['seconds']:.2f} s, "
        f"web memory +{sv['mem']['growth_mib']:.1f} MiB)"
    )
    if "tp" not in r:
        print("b, e, f: skipped (BENCH_ONLY_IO=1)")
        _print_openai(r)
        return
    t = r["tp"]
    print(
        f"b. throughput, {t['n']:,} items at {t['latency_ms']:g} ms upstream latency, 1 worker x {SLOTS} slots: "
        f"{t['rate']:.1f} items/s = {t['rate'] / t['ceiling']:.2f} of the {t['ceiling']:.0f} items/s ceiling"
    )
    _print_tp_details(t)
    tr = r["tp_results"]
    print(
        f"   (its results, {tr['results']:,} items: {tr['seconds']:.2f} s, web memory "
        f"+{tr['mem']['growth_mib']:.1f} MiB; its submit: {t['submit_s']:.2f} s, web memory "
        f"+{t['submit_mem']['growth_mib']:.1f} MiB)"
    )
    if "tp0" in r:
        t0 = r["tp0"]
        print(f"   worker ceiling, {t0['n']:,} items at 0 ms upstream latency: {t0['rate']:.1f} items/s")
        _print_tp_details(t0)
    if "tp_large" in r:
        tl = r["tp_large"]
        print(
            f"b″. drain of a large batch, {tl['n']:,} items at {tl['latency_ms']:g} ms: {tl['rate']:.1f} items/s = "
            f"{tl['rate'] / tl['ceiling']:.2f} of {tl['ceiling']:.0f} items/s (vs {t['rate'] / t['ceiling']:.2f} "
            f"at {t['n']:,} items)"
        )
        _print_tp_details(tl)
    for sc in r.get("scale", []):
        print(
            f"e. scale-out, {sc['workers']} worker(s) x {SLOTS} slots at {sc['tp']['latency_ms']:g} ms, "
            f"{sc['tp']['n']:,} items: {sc['rate']:.2f} items/s = {sc['ratio']:.2f} of {sc['ideal']:.0f} items/s "
            f"(target >= 0.95); at most {sc['tp']['upstream_max_in_flight']} in flight upstream, answered in "
            f"{_ms(sc['tp'].get('upstream_served_ms'))} on average; all {sc['workers'] * SLOTS} slots busy "
            f"{sc['tp']['fill_s']:.2f} s after the 202"
        )
    if "rl" in r:
        rl = r["rl"]
        if "skipped" in rl:
            print(f"f. rate-limited provider: {rl['skipped']}")
        else:
            print(
                f"f. rate-limited provider (2 keys x {rl['key_rps']:g} req/s, 429 + Retry-After beyond, "
                f"{'with' if rl.get('limit_headers', True) else 'without'} x-ratelimit headers), "
                f"{rl['n']} items (OpenAI-compatible surface): {rl['ok']} of {rl['n']} completed with 200, batch done "
                f"in {rl['seconds']:.1f} s: drain {rl['rate']:.2f} items/s = {rl['fraction']:.2f} of the "
                f"{rl['limit']:g} items/s limit (time counted as at least n / limit)"
            )
            states = ", ".join(f"{k} {v}" for k, v in sorted(rl["states"].items()))
            codes = ", ".join(f"{k}: {v}" for k, v in sorted(rl["status_codes"].items(), key=lambda kv: str(kv[0])))
            print(
                f"   items: {states}; status codes {codes}; upstream saw {rl['upstream_requests']} requests, "
                f"answered {rl['upstream_429']} with 429; create -> batch completed {rl['batch_seconds']:.1f} s"
            )
    _print_openai(r)


def _web_cpu(fig: dict, units: int, unit: str) -> str:
    """The web process's CPU, which the one-decimal figure above rounds to 0.0 ms."""
    if fig.get("web_cpu_s") is None:
        return "web CPU: not measured"
    return (
        f"web CPU {fig['web_cpu_s']:.2f} s = {fig['web_cpu_s'] * 1e6 / max(1, units):.1f} µs per {unit} "
        f"(machine {fig['busy']:.2f} of {os.cpu_count()} cores busy)"
    )


def _print_openai(r: dict) -> None:
    n = r["n"]
    o = r["openai"]
    if "skipped" in o:
        print(f"d. OpenAI-compatible {n:,}-record JSONL upload + create: {o['skipped']}")
    else:
        print(
            f"d. OpenAI-compatible {n:,}-record JSONL ({o['bytes'] / measure.MiB:.1f} MiB): POST /v1/files "
            f"{o['upload_s']:.2f} s + POST /v1/batches {o['create_s']:.2f} s = {o['upload_s'] + o['create_s']:.2f} s "
            f"(batch {o['batch_id']}, status {o['batch_status']}, total {o['total']})"
        )
        print(f"   web memory: {fmt_mem(o['mem'])}")
    print(f"benchmark wall time {r['wall_s']:.0f} s; memory = RSS of the gunicorn worker that served the request")
    print()


def _ms(value) -> str:
    return "?" if value is None else f"{value:.1f} ms"


def _print_tp_details(t: dict) -> None:
    counts = ", ".join(f"{k} {v}" for k, v in sorted(t["counts"].items()))
    print(
        f"   202 -> CompletedAt {t['seconds']:.1f} s (first item started {t['first_start_s']:.2f} s after the 202; "
        f"first start -> last finish {t['steady_rate']:.1f} items/s); items: {counts}; status {t['status']}; "
        f"upstream saw {t['upstream_requests']} requests, at most {t['upstream_max_in_flight']} in flight, "
        f"answered in {_ms(t.get('upstream_served_ms'))} on average (the {t['latency_ms']:g} ms latency included)"
    )
    print(f"   {t['cpu']}")


if __name__ == "__main__":
    run()
