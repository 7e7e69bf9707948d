"""The measurement pieces of bench/provider_batch.py: the JSONL input file and its upload, the relay's state
read from its database, one batch timed and measured by phase (CPU and peak RSS per process group), the
output file, the upstream batch-API requests from the fake's log, and the batch's cost.

bench/provider_batch.py runs them in order and prints the report; this module imports nothing from it.
"""

import contextlib
import json
import os
import threading
import time
import uuid

import requests

from bench import catalog, harness, measure
from bench.batch_drain import MultipartFile
from bench.measure import CpuWatch, MemWatch

PROVIDER_MODEL = "gpt-4o-provider"
ENDPOINT = "/v1/chat/completions"


# --- the input file -------------------------------------------------------------------------------


def write_jsonl(path, n: int, item_bytes: int, model: str) -> int:
    """OpenAI's batch input: one {custom_id, method, url, body} line per record, ~item_bytes each."""
    envelope = len('{"custom_id":"request-00000","method":"POST","url":"/v1/chat/completions","body":}')
    with open(path, "wb") as fh:
        for i in range(n):
            record = {
                "custom_id": f"request-{i}",
                "method": "POST",
                "url": ENDPOINT,
                "body": catalog.chat_body(i, max(0, item_bytes - envelope), model=model),
            }
            fh.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
    return path.stat().st_size


def upload_and_create(web: harness.Web, key: str, path) -> dict:
    auth = {"Authorization": f"Bearer {key}"}
    body = MultipartFile({"purpose": "batch"}, "file", path, "application/jsonl")
    try:
        t0 = time.perf_counter()
        up = requests.post(
            f"{web.url}/v1/files", data=body, headers={**auth, "Content-Type": body.content_type}, timeout=900
        )
        upload_s = time.perf_counter() - t0
    finally:
        body.close()
    if not 200 <= up.status_code < 300:
        raise RuntimeError(f"POST /v1/files answered {up.status_code}: {up.text[:500]}")
    t1 = time.perf_counter()
    created = requests.post(
        f"{web.url}/v1/batches",
        json={"input_file_id": up.json()["id"], "endpoint": ENDPOINT, "completion_window": "24h"},
        headers=auth,
        timeout=900,
    )
    create_s = time.perf_counter() - t1
    if not 200 <= created.status_code < 300:
        raise RuntimeError(f"POST /v1/batches answered {created.status_code}: {created.text[:500]}")
    public_id = created.json()["id"]
    return {
        "public_id": public_id,
        "pk": uuid.UUID(hex=public_id.removeprefix("batch_")),
        "upload_s": upload_s,
        "create_s": create_s,
    }


# --- the relay's state, read from its database ------------------------------------------------------


def db(fn, *args):
    """`fn(*args)` through a PostgreSQL restart (the shared server may be restarted by someone's durability
    tests): the connection is dropped and the call made again, for up to a minute."""
    from django.db import InterfaceError, OperationalError, connections

    deadline = time.monotonic() + 60
    while True:
        try:
            return fn(*args)
        except (OperationalError, InterfaceError):
            if time.monotonic() > deadline:
                raise
            connections.close_all()
            time.sleep(1)


def pg_backends(db_name: str) -> list[int]:
    try:
        return measure.pg_backends(db_name)
    except Exception:  # noqa: BLE001 - the server restarting: none this second, a new observer next time
        measure._pg_local.conn = None
        return []


def _state(pk) -> tuple[str, dict]:
    """(the batch's status, its provider jobs by status)."""
    from django.db.models import Count

    from batches.models import Batch
    from batches.provider.models import ProviderJob

    status = Batch.objects.filter(pk=pk).values_list("status", flat=True).first()
    jobs = dict(
        ProviderJob.objects.filter(batch_id=pk).values_list("status").annotate(n=Count("id")).values_list("status", "n")
    )
    return status, jobs


def _wait(pk, done, what: str, timeout: float, every=None) -> float:
    """Wait until `done(status, jobs)`, calling `every()` (if given) every 10 s; returns the seconds it took."""
    t0 = next_call = time.monotonic()
    while True:
        status, jobs = db(_state, pk)
        if status in ("failed", "cancelled", "expired"):
            raise RuntimeError(f"batch {pk} ended {status} while waiting for {what} (jobs {jobs})")
        if done(status, jobs):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"batch {pk}: no {what} after {timeout:.0f} s (status {status}, jobs {jobs})")
        if every is not None and time.monotonic() >= next_call:
            every()
            next_call += 10
        time.sleep(0.5)


def _sent(status, jobs) -> bool:
    return bool(jobs) and not ({"pending", "submitting"} & set(jobs))


def _polled(status, jobs) -> bool:
    return bool(jobs) and "running" not in jobs and _sent(status, jobs)


def _completed(status, jobs) -> bool:
    return status == "completed"


# --- one batch, by phase -------------------------------------------------------------------------------


class Phases:
    """CPU (CpuWatch) and peak RSS (MemWatch) of each phase in turn, and over all of them."""

    def __init__(self, groups: dict, mem_pids: dict):
        self.groups, self.mem_pids = groups, mem_pids
        self.rows: list[dict] = []
        self.total = CpuWatch(groups)

    def __enter__(self) -> "Phases":
        self.total.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.total.__exit__(*exc)

    def run(self, name: str, fn, profile: bool = False):
        pids = {label: fn_pids() for label, fn_pids in self.mem_pids.items()}
        every = [p for group in pids.values() for p in group]
        series: list[dict] = []  # VmRSS of each process every second: does it grow as the records go by?
        stop = threading.Event()

        def sample():
            while not stop.wait(1.0):
                with contextlib.suppress(OSError):
                    series.append({p: measure._status_kib(p, "VmRSS") for p in every})

        sampler = threading.Thread(target=sample, daemon=True)
        with CpuWatch(self.groups) as cpu, MemWatch(every) as mem:
            sampler.start()
            with _profiled(name, pids.get("control worker", []) if profile else []):
                t0 = time.monotonic()
                out = fn()
                seconds = time.monotonic() - t0
            stop.set()
            sampler.join()
        peaks = {label: {p: (mem.baseline[p], mem.peak[p]) for p in group} for label, group in pids.items()}
        self.rows.append({"phase": name, "seconds": seconds, "cpu": cpu, "mem": peaks, "series": series})
        return out


def _profiled(label: str, pids: list[int]):
    if not pids or not os.environ.get("BENCH_PYSPY"):
        return _nothing()
    return harness.profiled(None, "provider-" + label.replace(" + ", "-"), pids=pids)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_batch(web, key, upstream, tmp, n: int, item_bytes: int, model: str, job_seconds: float, groups, mem_pids):
    """One OpenAI-surface batch of `n` records for `model`, from the upload to `completed`, by phase."""
    provider = model == PROVIDER_MODEL
    if provider:
        config = {"batch_seconds": job_seconds}
        requests.post(f"{upstream.url}/_bench/config", json=config, timeout=10).raise_for_status()
    path = tmp / f"batch-{model}-{n}.jsonl"
    size = write_jsonl(path, n, item_bytes, model)
    t_start = time.time()
    out: dict = {"n": n, "bytes": size, "model": model, "job_seconds": job_seconds, "t_start": t_start}
    with Phases(groups, mem_pids) as phases:

        def submit():
            sub = upload_and_create(web, key, path)
            out.update(sub)
            if provider:  # validated, the records delegated to a job, the job's input uploaded and created upstream
                _wait(sub["pk"], _sent, "job sent", 900)
            else:
                _wait(sub["pk"], _completed, "completion", 3600)
            return sub

        sub = phases.run("submit + send" if provider else "submit + run + finalize", submit, profile=provider)
        path.unlink()
        if provider:
            seen = out["counts_seen"] = []

            def counts():  # what a client sees while the job runs (request_counts move with the provider's)
                got = requests.get(f"{web.url}/v1/batches/{sub['public_id']}", headers=auth(key), timeout=60)
                seen.append(got.json().get("request_counts", {}).get("completed"))

            phases.run("polling", lambda: _wait(sub["pk"], _polled, "job ended", job_seconds * 3 + 600, counts))
            phases.run("results", lambda: _wait(sub["pk"], _completed, "completion", 3600), profile=True)
    out["t_end"] = time.time()
    out["phases"] = phases.rows
    out["total"] = phases.total
    out.update(db(_check, sub["pk"], n))
    out["timeline"] = db(_timeline, sub["pk"])
    return out


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _timeline(pk) -> list[tuple[str, float]]:
    """Seconds from the batch's creation to each step, from the relay's own timestamps."""
    from django.db.models import Max, Min

    from batches.models import Batch
    from batches.provider.models import ProviderJob

    b = Batch.objects.get(pk=pk)
    j = ProviderJob.objects.filter(batch_id=pk).aggregate(
        send=Min("submit_started_at"), sent=Max("submitted_at"), ended=Max("ended_at")
    )
    steps = [
        ("validated", b.in_progress_at),
        ("job input uploaded", j["send"]),
        ("job created upstream", j["sent"]),
        ("job seen ended", j["ended"]),
        ("finalizing", b.finalizing_at),
        ("completed", b.completed_at),
    ]
    return [(name, (at - b.created_at).total_seconds()) for name, at in steps if at is not None]


def _check(pk, n: int) -> dict:
    from django.db.models import Count

    from batches.models import Item
    from batches.provider.models import ProviderJob
    from usage.models import UsageEvent

    states = dict(Item.objects.filter(batch_id=pk).values_list("state").annotate(c=Count("id")))
    where = dict(UsageEvent.objects.filter(batch_id=str(pk)).values_list("executed_by").annotate(c=Count("id")))
    jobs = list(ProviderJob.objects.filter(batch_id=pk).values("upstream_id", "records", "polls", "status"))
    return {"states": states, "executed_by": where, "jobs": jobs, "complete": states.get("completed") == n}


def fetch_output(web, key: str, public_id: str, groups: dict) -> dict:
    auth = {"Authorization": f"Bearer {key}"}
    batch = requests.get(f"{web.url}/v1/batches/{public_id}", headers=auth, timeout=60).json()
    lines = size = 0
    with CpuWatch(groups) as cpu:
        t0 = time.perf_counter()
        resp = requests.get(
            f"{web.url}/v1/files/{batch['output_file_id']}/content", headers=auth, stream=True, timeout=900
        )
        resp.raise_for_status()
        for chunk in resp.iter_content(64 * 1024):
            lines += chunk.count(b"\n")
            size += len(chunk)
        seconds = time.perf_counter() - t0
    return {"request_counts": batch["request_counts"], "lines": lines, "bytes": size, "seconds": seconds, "cpu": cpu}


# --- upstream requests, from the fake's log ---------------------------------------------------------------


def upstream_requests(upstream, r: dict) -> dict:
    log_ = requests.get(f"{upstream.url}/_bench/batches", timeout=30).json()["log"]
    mine = [e for e in log_ if r["t_start"] - 1 <= e["t"] <= r["t_end"] + 1]
    out = {"all": len(mine), "ops": {}, "jobs": []}
    for e in mine:
        out["ops"][e["op"]] = out["ops"].get(e["op"], 0) + 1
    for job in r["jobs"]:
        uid = job["upstream_id"]
        about = sorted(e["t"] for e in mine if e["job"] == uid)
        polls = sorted(e["t"] for e in mine if e["job"] == uid and e["op"] == "retrieve")
        span = polls[-1] - polls[0] if len(polls) > 1 else 0.0
        created = next((e["t"] for e in mine if e["job"] == uid and e["op"] == "create"), None)
        out["jobs"].append(
            {
                "upstream_id": uid,
                "polls": len(polls),
                "relay_polls": job["polls"],
                "poll_span_s": span,
                "poll_offsets_s": [round(t - created, 1) for t in polls] if created else [],
                "max_polls_60s": max_in(polls, 60.0),
                "max_requests_60s": max_in(about, 60.0),
                "per_minute": (len(polls) - 1) / span * 60 if span else float("nan"),
            }
        )
    return out


def max_in(times: list[float], window: float) -> int:
    """The most of `times` (sorted) within any `window` seconds."""
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] >= window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


# --- cost ---------------------------------------------------------------------------------------------


def costs(pk) -> dict:
    """The batch's events as recorded, and the same token counts priced as a relay-run record (list price;
    billed by the same rule)."""
    from batches.models import Batch
    from core.models import HostBinding
    from usage.models import UsageEvent
    from usage.pricing import cost_nano_usd, discounted
    from usage.tokens import Tokens

    batch = Batch.objects.get(pk=pk)
    pricing = HostBinding.objects.select_related("pricing").get(model__name=PROVIDER_MODEL).pricing
    rows = UsageEvent.objects.filter(batch_id=str(pk)).values_list(
        "input_tokens",
        "output_tokens",
        "cache_read_tokens",
        "cache_write_tokens",
        "cost_nano_usd",
        "billed_cost_nano_usd",
    )
    out = {"events": 0, "cost": 0, "billed": 0, "list": 0, "list_billed": 0, "input": 0, "output": 0}
    for inp, outp, cr, cw, cost, billed in rows.iterator(chunk_size=5000):
        out["events"] += 1
        out["input"] += inp
        out["output"] += outp
        out["cost"] += cost or 0
        out["billed"] += billed if billed is not None else (cost or 0)
        listed = cost_nano_usd(pricing, Tokens(input=inp, output=outp, cache_read=cr, cache_write=cw)) or 0
        out["list"] += listed
        out["list_billed"] += discounted(listed, batch.discount_percent) if batch.discount_percent else listed
    out["discount_percent"] = batch.discount_percent
    out["rates"] = (pricing.input_nanos_per_mtok, pricing.output_nanos_per_mtok)
    return out
