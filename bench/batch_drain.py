"""The batch benchmark's scenarios on one batch at a time: the request bodies written to disk, the
native submit, the results and status fetches, a batch completed in the database, a drain by the
running workers (throughput), and the OpenAI-compatible upload + create. Run by bench/batch.py.
"""

import io
import json
import os
import secrets
import time
from datetime import datetime
from pathlib import Path

import requests

from bench import catalog, harness
from bench.measure import CpuWatch, MemWatch

SLOTS = 8  # items in flight per worker replica (docs/decisions/0006-postgres-is-the-truth.md)


# --- request bodies on disk ------------------------------------------------------------------------


def write_native_body(path: Path, n: int, item_bytes: int) -> int:
    with open(path, "wb") as fh:
        fh.write(b'{"shape":"openai","requests":[')
        for i in range(n):
            if i:
                fh.write(b",")
            fh.write(json.dumps(catalog.chat_body(i, item_bytes), separators=(",", ":")).encode())
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
                "body": catalog.chat_body(i, max(0, item_bytes - envelope)),
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
    with CpuWatch(cpu_groups) as cpu, MemWatch(web.worker_pids()) as mem, open(path, "rb") as fh:
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
    from devkit.upstream import canned

    def store(row) -> tuple[str, str]:
        item_id, input_ref = row
        request = json.loads(storage.read(input_ref))
        request["model"] = catalog.UPSTREAM_MODEL  # what the relay sends upstream
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
    with CpuWatch(cpu_groups) as cpu, MemWatch(web.worker_pids()) as mem, open(os.devnull, "wb") as sink:
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
    with CpuWatch(cpu_groups) as cpu:
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
