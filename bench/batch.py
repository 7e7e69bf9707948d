"""Issue 4: the relay-native batch API under load, in one run.

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
"""

import io
import json
import os
import secrets
import time
from datetime import datetime
from pathlib import Path

import requests

from bench import harness
from bench.harness import MemWatch, env_float, env_int, fmt_mem, log

SLOTS = 8  # items in flight per worker replica (design.md §4)


# --- request bodies on disk ------------------------------------------------------------------------


def write_native_body(path: Path, n: int, item_bytes: int) -> int:
    with open(path, "wb") as fh:
        fh.write(b'{"shape":"openai","requests":[')
        for i in range(n):
            if i:
                fh.write(b",")
            fh.write(json.dumps(harness.chat_body(i, item_bytes), separators=(",", ":")).encode())
        fh.write(b"]}")
    return path.stat().st_size


def write_openai_jsonl(path: Path, n: int, item_bytes: int) -> int:
    """The OpenAI Batch input format: one {custom_id, method, url, body} record per line, sized like
    the native submission (the record envelope is taken out of the body's padding)."""
    envelope = len('{"custom_id":"request-00000","method":"POST","url":"/v1/chat/completions","body":}')
    with open(path, "wb") as fh:
        for i in range(n):
            record = {
                "custom_id": f"request-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": harness.chat_body(i, max(0, item_bytes - envelope)),
            }
            fh.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
    return path.stat().st_size


class MultipartFile:
    """multipart/form-data read from disk as requests sends it, so the client holds no copy of the file."""

    def __init__(self, fields: dict, file_field: str, path: Path, content_type: str):
        boundary = "relay-bench-" + secrets.token_hex(12)
        head = "".join(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n' for k, v in fields.items()
        )
        head += (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{file_field}"; filename="{path.name}"\r\n'
            f"Content-Type: {content_type}\r\n\r\n"
        )
        tail = f"\r\n--{boundary}--\r\n".encode()
        self.content_type = f"multipart/form-data; boundary={boundary}"
        self._parts = [io.BytesIO(head.encode()), open(path, "rb"), io.BytesIO(tail)]  # noqa: SIM115 - close()
        self._len = len(head.encode()) + path.stat().st_size + len(tail)

    def __len__(self) -> int:
        return self._len

    def read(self, n: int = -1) -> bytes:
        out = b""
        while self._parts and (n < 0 or len(out) < n):
            chunk = self._parts[0].read(-1 if n < 0 else n - len(out))
            if chunk:
                out += chunk
            else:
                self._parts.pop(0).close()
        return out

    def __iter__(self):
        while chunk := self.read(64 * 1024):
            yield chunk

    def close(self) -> None:
        for part in self._parts:
            part.close()


# --- the figures ---------------------------------------------------------------------------------------


def _iso_ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def submit(web: harness.Web, key: str, path: Path, cpu_groups: dict) -> dict:
    with harness.CpuWatch(cpu_groups) as cpu, MemWatch(web.worker_pids()) as mem, open(path, "rb") as fh:
        t0 = time.perf_counter()
        resp = requests.post(
            f"{web.url}/v1/batches",
            data=fh,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            timeout=900,
        )
        elapsed = time.perf_counter() - t0
        t202 = time.time()
    if resp.status_code != 202:
        raise RuntimeError(f"POST /v1/batches answered {resp.status_code}: {resp.text[:500]}")
    body = resp.json()
    return {
        "id": body["id"],
        "total": body["total_items"],
        "seconds": elapsed,
        "t202": t202,
        "mem": mem.summary(),
        "cpu": cpu.describe(body["total_items"], "item"),
        "web_cpu_s": cpu.used["web (gunicorn)"] if "web (gunicorn)" in cpu.used else None,
        "busy": cpu.machine_busy,
    }


def complete_in_db(batch_id: str) -> dict:
    """Finish every item as a worker would have: the fake upstream's reply for that item's own request,
    stored through the storage interface (batches.storage.write_result); then item states, the batch
    status and CompletedAt, in one transaction."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection, transaction
    from django.utils import timezone

    from batches import storage
    from batches.models import Batch, BatchStatus, Item, ItemState
    from relay.demo_upstream import canned

    def store(row) -> tuple[str, str]:
        item_id, input_ref = row
        request = json.loads(storage.read(input_ref))
        request["model"] = harness.UPSTREAM_MODEL  # what the relay sends upstream
        reply = json.dumps(canned("/v1/chat/completions", request)).encode()
        return str(item_id), storage.write_result(batch_id, str(item_id), reply)

    t0 = time.perf_counter()
    rows = list(Item.objects.filter(batch_id=batch_id).order_by("idx").values_list("id", "input_ref"))
    with ThreadPoolExecutor(4) as pool:  # file writes release the GIL
        refs = list(pool.map(store, rows, chunksize=256))
    now = timezone.now()
    table = Item._meta.db_table
    with transaction.atomic(), connection.cursor() as cur:
        for i in range(0, len(refs), 5000):
            chunk = refs[i : i + 5000]
            values = ",".join(["(%s::uuid, %s)"] * len(chunk))
            cur.execute(
                f'UPDATE "{table}" AS i SET result_ref = v.ref, state = %s, attempt = 1, started_at = %s, '
                f"finished_at = %s, status_code = 200 FROM (VALUES {values}) AS v(id, ref) WHERE i.id = v.id",
                [ItemState.COMPLETED, now, now, *[x for pair in chunk for x in pair]],
            )
        Batch.objects.filter(pk=batch_id).update(status=BatchStatus.COMPLETED, completed_at=now)
    return {"seconds": time.perf_counter() - t0, "items": len(refs)}


def wait_completed(batch_id: str, timeout: float) -> None:
    from batches.models import Batch

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Batch.objects.filter(pk=batch_id, completed_at__isnull=False).exists():
            return
        time.sleep(0.25)
    raise RuntimeError(f"batch {batch_id} not completed after {timeout:.0f} s")


def fetch_results(web: harness.Web, key: str, batch_id: str, cpu_groups: dict) -> dict:
    marker = b'{"idx":'
    count, size, tail = 0, 0, b""
    head = b""
    with harness.CpuWatch(cpu_groups) as cpu, MemWatch(web.worker_pids()) as mem, open(os.devnull, "wb") as sink:
        t0 = time.perf_counter()
        resp = requests.get(
            f"{web.url}/v1/batches/{batch_id}/results",
            headers={"Authorization": f"Bearer {key}"},
            stream=True,
            timeout=900,
        )
        ttfb = time.perf_counter() - t0
        if resp.status_code != 200:
            raise RuntimeError(f"GET results answered {resp.status_code}: {resp.text[:500]}")
        for chunk in resp.iter_content(64 * 1024):
            sink.write(chunk)
            if len(head) < 32:
                head += chunk[:32]
            window = tail + chunk
            count += window.count(marker)
            tail = window[-(len(marker) - 1) :]
            size += len(chunk)
        elapsed = time.perf_counter() - t0
    well_formed = head.startswith(b'{"results":[') and tail.endswith(b"]}")
    return {
        "seconds": elapsed,
        "ttfb": ttfb,
        "bytes": size,
        "results": count,
        "well_formed": well_formed,
        "mem": mem.summary(),
        "cpu": cpu.describe(count, "result"),
        "web_cpu_s": cpu.used["web (gunicorn)"] if "web (gunicorn)" in cpu.used else None,
        "busy": cpu.machine_busy,
    }


def fetch_status(web: harness.Web, key: str, batch_id: str) -> dict:
    with MemWatch(web.worker_pids()) as mem:
        t0 = time.perf_counter()
        resp = requests.get(f"{web.url}/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {key}"}, timeout=600)
        elapsed = time.perf_counter() - t0
    if resp.status_code != 200:
        raise RuntimeError(f"GET /v1/batches/{{id}} answered {resp.status_code}: {resp.text[:500]}")
    body = resp.json()
    return {"seconds": elapsed, "bytes": len(resp.content), "body": body, "mem": mem.summary()}


def throughput(
    web, key, upstream, tmp: Path, n: int, latency_ms: float, item_bytes: int, cpu_groups: dict, slots: int = SLOTS
) -> dict:
    from django.db.models import Max, Min

    from batches.models import Item

    upstream.configure(latency_ms)
    upstream.reset_stats()
    path = tmp / f"throughput-{latency_ms:g}ms.json"
    write_native_body(path, n, item_bytes)
    with harness.CpuWatch(cpu_groups) as cpu:
        sub = submit(web, key, path, cpu_groups)
        path.unlink()
        ideal = n / SLOTS * latency_ms / 1000
        wait_completed(sub["id"], timeout=max(600, ideal * 10))
    status = fetch_status(web, key, sub["id"])["body"]
    span = Item.objects.filter(batch_id=sub["id"]).aggregate(first=Min("started_at"), last=Max("finished_at"))
    first, last = span["first"].timestamp(), span["last"].timestamp()
    # When every slot had started an item: the slots-th earliest start (an item's last attempt's start).
    starts = Item.objects.filter(batch_id=sub["id"]).order_by("started_at").values_list("started_at", flat=True)
    fill = starts[min(slots, n) - 1].timestamp() - sub["t202"]
    elapsed = _iso_ts(status["CompletedAt"]) - sub["t202"]
    stats = upstream.stats()
    return {
        "n": n,
        "latency_ms": latency_ms,
        "submit_s": sub["seconds"],
        "seconds": elapsed,
        "rate": n / elapsed,
        "steady_rate": n / (last - first) if last > first else float("nan"),
        "first_start_s": first - sub["t202"],
        "fill_s": fill,
        "ceiling": SLOTS / (latency_ms / 1000) if latency_ms else None,
        "counts": status["counts"],
        "status": status["Status"],
        "upstream_requests": stats["requests"],
        "upstream_max_in_flight": stats["max_in_flight"],
        "upstream_served_ms": stats.get("served_ms_mean"),
        "submit_mem": sub["mem"],
        "id": sub["id"],
        "cpu": cpu.describe(n, "item"),
    }


def openai_upload(web: harness.Web, key: str, tmp: Path, n: int, item_bytes: int) -> dict:
    """`POST /v1/files` (multipart: file, purpose=batch) then `POST /v1/batches` from that file."""
    auth = {"Authorization": f"Bearer {key}"}
    try:
        probe = requests.options(f"{web.url}/v1/files", headers=auth, timeout=30)
        if probe.status_code == 404:
            return {"skipped": "skipped: /v1/files not available (404)"}
        path = tmp / "openai-batch.jsonl"
        size = write_openai_jsonl(path, n, item_bytes)
        body = MultipartFile({"purpose": "batch"}, "file", path, "application/jsonl")
        try:
            with MemWatch(web.worker_pids()) as mem:
                t0 = time.perf_counter()
                up = requests.post(
                    f"{web.url}/v1/files", data=body, headers={**auth, "Content-Type": body.content_type}, timeout=900
                )
                t_upload = time.perf_counter() - t0
                if up.status_code in (404, 405):
                    return {"skipped": f"skipped: /v1/files not available ({up.status_code})"}
                if not 200 <= up.status_code < 300:
                    return {"skipped": f"failed: POST /v1/files answered {up.status_code}: {up.text[:300]}"}
                file_id = up.json()["id"]
                t1 = time.perf_counter()
                created = requests.post(
                    f"{web.url}/v1/batches",
                    json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
                    headers=auth,
                    timeout=900,
                )
                t_create = time.perf_counter() - t1
        finally:
            body.close()
            path.unlink(missing_ok=True)
        if not 200 <= created.status_code < 300:
            return {
                "skipped": f"failed: POST /v1/batches (input_file_id) answered {created.status_code}: "
                f"{created.text[:300]}"
            }
        batch = created.json()
        return {
            "bytes": size,
            "upload_s": t_upload,
            "create_s": t_create,
            "file_id": file_id,
            "batch_id": batch.get("id"),
            "batch_status": batch.get("status"),
            "total": (batch.get("request_counts") or {}).get("total"),
            "mem": mem.summary(),
        }
    except (requests.RequestException, ValueError, KeyError) as exc:
        return {"skipped": f"failed: {type(exc).__name__}: {exc}"}


# --- the run -----------------------------------------------------------------------------------------


# --- issue 11: scale-out, the rate-limited provider ------------------------------------------------


def scale_out(stack, web, key, upstream, n: int, latency_ms: float, workers: int, item_bytes: int, procs) -> dict:
    """`workers` Celery workers (8 slots each; the first one runs the sweeper) drain `n` items at
    `latency_ms`: items/s against workers x 8 slots / latency."""
    started = [stack.start_worker()]
    for i in range(1, workers):
        started.append(stack.start_worker(name=f"bench{i + 1}", beat=False))
    procs["workers"] = started
    try:
        t = throughput(web, key, upstream, stack.tmp, n, latency_ms, item_bytes, {}, slots=workers * SLOTS)
    finally:
        for w in started:
            w.stop()
        procs.pop("workers", None)
    ideal = workers * SLOTS / (latency_ms / 1000)
    return {"workers": workers, "rate": t["rate"], "ideal": ideal, "ratio": t["rate"] / ideal, "tp": t}


def rate_limited_drain(
    web, key, upstream, tmp: Path, n: int, latency_ms: float, key_rps: float, limit_headers: bool = True
) -> dict:
    """An OpenAI-compatible batch (inline `requests`) for the model whose two host keys the fake
    upstream limits to `key_rps` requests/s each (429 + Retry-After beyond). The drain rate is the
    items that completed with 200 divided by the time from the create's answer to the batch's
    completion, but never less than n / limit (no batch drains faster), against the 2 x key_rps the
    provider allows: 1.0 means every item went through as fast as the provider lets. Items that
    failed (429) count for nothing, so a batch that gives up on a busy provider scores low however
    fast it ends."""
    from django.db.models import Count, Max

    from batches.models import Batch, Item

    upstream.configure(latency_ms)
    config = {"key_rps": key_rps, "limit_headers": limit_headers}
    requests.post(f"{upstream.url}/_bench/config", json=config, timeout=10).raise_for_status()
    upstream.reset_stats()
    records = [
        {
            "custom_id": f"rl-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": dict(harness.chat_body(i), model=harness.RL_MODEL),
        }
        for i in range(n)
    ]
    body = {"endpoint": "/v1/chat/completions", "completion_window": "24h", "requests": records}
    t0 = time.time()
    resp = requests.post(f"{web.url}/v1/batches", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    t_created = time.time()
    if resp.status_code not in (200, 202):
        return {"skipped": f"POST /v1/batches answered {resp.status_code}: {resp.text[:300]}"}
    batch_pk = resp.json()["id"].removeprefix("batch_")
    limit = 2 * key_rps
    wait_completed(batch_pk, timeout=max(600, n / limit * 20))
    batch = Batch.objects.get(pk=batch_pk)
    items = Item.objects.filter(batch_id=batch_pk)
    states = {row["state"]: row["n"] for row in items.values("state").annotate(n=Count("id"))}
    ok = items.filter(state="completed", status_code=200)
    n_ok = ok.count()
    last = items.aggregate(last=Max("finished_at"))["last"]
    end = batch.completed_at or last
    seconds = max(end.timestamp() - t_created, 1e-3) if end else float("nan")
    codes = {row["status_code"]: row["n"] for row in items.values("status_code").annotate(n=Count("id"))}
    stats = upstream.stats()
    requests.post(f"{upstream.url}/_bench/config", json={"key_rps": 5}, timeout=10)
    rate = n_ok / max(seconds, n / limit) if n_ok and seconds > 0 else 0.0
    return {
        "n": n,
        "key_rps": key_rps,
        "limit_headers": limit_headers,
        "limit": limit,
        "ok": n_ok,
        "rate": rate,
        "fraction": rate / limit,
        "seconds": seconds,
        "batch_seconds": end.timestamp() - t0 if end else float("nan"),
        "states": states,
        "status_codes": codes,
        "upstream_requests": stats["requests"],
        "upstream_429": stats.get("rate_limited", 0),
    }


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
        key = harness.seed_catalog(upstream.url)
        web = stack.start_web()
        log(f"fake upstream {upstream.url}, relay {web.url} (gunicorn {' '.join(harness.GUNICORN_ARGS)})")
        procs = {"web": web.proc}
        cpu_groups = {
            "web (gunicorn)": lambda: harness.process_tree(web.proc.popen.pid),
            "worker (celery)": lambda: harness.process_tree(procs["worker"].popen.pid) if "worker" in procs else [],
            "postgres": lambda: harness.pg_backends(stack.db_name),
            "redis (whole server)": lambda: harness.redis_server_pids(stack.redis_url),
            "fake upstream": lambda: [upstream.proc.popen.pid],
            "this client": lambda: [os.getpid()],
        }
        for _ in range(20):  # load every module in both gunicorn workers before the baselines
            requests.get(f"{web.url}/v1/batches/0", headers={"Authorization": f"Bearer {key}"}, timeout=30)

        # a. submission
        body_path = stack.tmp / "native-batch.json"
        r["body_bytes"] = write_native_body(body_path, n, item_bytes)
        log(f"a. POST /v1/batches: {n} items, {r['body_bytes'] / harness.MiB:.1f} MiB, streamed from disk")
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
                web, "drain", pids=[worker.popen.pid, *harness.children_of(worker.popen.pid)], idle=idle
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
    print(f"== Batch API (issues 4, 11) — {harness.machine()}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"load at the end: {harness.load()}")
    s = r["submit"]
    print(f"a. submit {n:,} items ({r['body_bytes'] / harness.MiB:.1f} MiB) -> 202 in {s['seconds']:.2f} s")
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
    mib = res["bytes"] / harness.MiB
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
        f"   (also GET /v1/batches/{{id}} of that batch: {sv['bytes'] / harness.MiB:.1f} MiB in {sv['seconds']:.2f} s, "
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
            f"d. OpenAI-compatible {n:,}-record JSONL ({o['bytes'] / harness.MiB:.1f} MiB): POST /v1/files "
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
