"""Webhook delivery under load, in one run.

    .venv/bin/python -m bench.webhooks          (or: make bench, BENCH_ONLY=webhooks)

Starts, on loopback only: the fake upstream, the relay web server (gunicorn, as in production), the
background processes as compose declares them (the 8-slot item worker, the control worker that delivers
webhooks, beat) on a fresh PostgreSQL database `relay_bench_hooks` and Redis db 14 (BENCH_REDIS_DB_HOOKS),
and a webhook receiver in its own process (a ThreadingHTTPServer that notes when each delivery arrived).
One endpoint is registered for `batch.completed`. Item workers are kept busy throughout by a native batch
of BENCH_HOOKS_ITEMS items at 100 ms upstream latency (the 8 slots full), so deliveries share the machine
with item work, as they would in production.

Events are raised by the real final move: BENCH_HOOKS_EVENTS (10,000) native batches, stored `running`
with no item, are moved to `completed` by `batches.lifecycle.states.move` from this process — the same
call the lifecycle makes, so each writes its event and delivery in the move's transaction and hands the
delivery to the control worker when it commits. Latency is from the move's commit to the receiver's
arrival time (same clock).

 a. steady: BENCH_HOOKS_EVENTS at BENCH_HOOKS_RATE (200/s): delivered rate, p50/p99/max latency.
 b. burst: BENCH_HOOKS_BURST (2,000) moves as fast as this process makes them: the delivery ceiling.
 c. outage: the receiver answers 503 for BENCH_HOOKS_OUTAGE_S (60 s; the issue's 10 minutes scaled down)
    while events keep coming at BENCH_HOOKS_OUTAGE_RATE (5/s); then it answers 200 again and no new event
    comes: how long until every event arrived. Default retry settings (base 5 s, max 3600 s, probe 30 s).

Prints figures; asserts only that every event arrived.
"""

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests

from bench import catalog, harness, measure

EVENTS = harness.env_int("BENCH_HOOKS_EVENTS", 10_000)
RATE = harness.env_float("BENCH_HOOKS_RATE", 200.0)
BURST = harness.env_int("BENCH_HOOKS_BURST", 2_000)
OUTAGE_S = harness.env_float("BENCH_HOOKS_OUTAGE_S", 60.0)
OUTAGE_RATE = harness.env_float("BENCH_HOOKS_OUTAGE_RATE", 5.0)
ITEMS = harness.env_int("BENCH_HOOKS_ITEMS", 12_000)
REDIS_DB = harness.env_int("BENCH_REDIS_DB_HOOKS", 14)


# --- the receiver (its own process) ----------------------------------------------------------------


def receiver_main(port_file: str, log_file: str) -> None:
    """Answer every POST with the current status (200; POST /__status sets another) and note
    `webhook-id data.id arrival status` per delivery."""
    status = {"code": 200}
    lock = threading.Lock()
    out = open(log_file, "a", buffering=1)  # noqa: SIM115 - the process's whole life

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/__status":
                status["code"] = int(body)
                code = 200
            else:
                code = status["code"]
                arrived = time.time()
                data_id = json.loads(body)["data"]["id"]
                with lock:
                    out.write(f"{self.headers['webhook-id']} {data_id} {arrived:.6f} {code}\n")
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    Path(port_file).write_text(str(server.server_address[1]))
    server.serve_forever()


class Receiver:
    def __init__(self, stack: harness.Stack):
        self.log = stack.tmp / "arrivals.log"
        self.log.touch()
        port_file = stack.tmp / "receiver.port"
        self.proc = stack.spawn(
            "receiver", [harness.PY, "-m", "bench.webhooks", "receiver", str(port_file), str(self.log)]
        )
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the receiver did not start\n{self.proc.tail()}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port_file.read_text()}/hooks"

    def set_status(self, code: int) -> None:
        requests.post(self.url.replace("/hooks", "/__status"), data=str(code), timeout=5).raise_for_status()

    def arrivals(self) -> list[tuple[str, str, float, int]]:
        rows = []
        for line in self.log.read_text().splitlines():
            webhook_id, data_id, at, code = line.split()
            rows.append((webhook_id, data_id, float(at), int(code)))
        return rows


# --- raising events ---------------------------------------------------------------------------------


HOLDER = "bench-holder"


def stored_batches(key: str, n: int) -> list:
    """`n` native batches of the bench's key, `running`, each with one item held `running` under a lease that
    outlives the run (so the sweeper does not complete them first, and no worker claims anything of them):
    each becomes one event when moved."""
    from datetime import timedelta

    import uuid6
    from django.utils import timezone

    from batches.models import Batch, BatchStatus, Item, Surface
    from relay.auth import principal_for_key

    attribution = Batch.attribution(principal_for_key(key))
    now = timezone.now()
    rows = [
        Batch(
            id=uuid6.uuid7(), inbound_shape="openai", surface=Surface.NATIVE, status=BatchStatus.RUNNING, **attribution
        )
        for _ in range(n)
    ]
    Batch.objects.bulk_create(rows, batch_size=2000)
    held = now + timedelta(days=1)
    Item.objects.bulk_create(
        [
            Item(
                id=uuid6.uuid7(),
                batch=row,
                idx=0,
                state="running",
                lease_owner=HOLDER,
                lease_expires_at=held,
                started_at=now,
                input_ref="bench",
            )
            for row in rows
        ],
        batch_size=2000,
    )
    return [row.id for row in rows]


def end_batches(ids: list, rate: float | None) -> dict[str, float]:
    """Move each batch to completed (its final move), `rate` a second (None: as fast as possible); when
    each move committed, by the batch id its event names."""
    from batches.lifecycle import states
    from batches.models import BatchStatus, Surface

    moved, start = {}, time.perf_counter()
    for i, batch_id in enumerate(ids):
        if rate:
            wait = start + i / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        if not states.move(batch_id, Surface.NATIVE, BatchStatus.COMPLETED):
            raise RuntimeError(f"batch {batch_id} did not move")
        moved[str(batch_id)] = time.time()
    return moved


def wait_arrived(receiver: Receiver, moved: dict, timeout: float) -> dict[str, float]:
    """First 2xx arrival per batch id, once every moved batch has one."""
    deadline = time.monotonic() + timeout
    while True:
        first = {}
        for _, data_id, at, code in receiver.arrivals():
            if code == 200 and data_id in moved and data_id not in first:
                first[data_id] = at
        if len(first) == len(moved):
            return first
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(moved) - len(first)} of {len(moved)} events did not arrive in {timeout:.0f} s")
        time.sleep(0.25)


def latency_report(moved: dict, first: dict) -> dict:
    lat = [first[k] - moved[k] for k in moved]
    span = max(first.values()) - min(moved.values())
    return {
        "n": len(moved),
        "rate": len(moved) / span,
        "p50_ms": measure.percentile(lat, 50) * 1000,
        "p99_ms": measure.percentile(lat, 99) * 1000,
        "max_ms": max(lat) * 1000,
        "span_s": span,
    }


def items_running() -> int:
    from batches.models import Item

    return Item.objects.filter(state="running").exclude(lease_owner=HOLDER).count()


# --- the run ----------------------------------------------------------------------------------------


def main() -> None:
    os.environ.update(RELAY_WEBHOOK_ALLOWED_HOSTS="127.0.0.1", RELAY_WEBHOOK_SWEEP_SECONDS="5")
    harness.log(f"webhooks: {measure.machine()}; load {measure.load()}")
    with harness.Stack(harness.db_name("_hooks"), REDIS_DB) as stack:
        stack.fresh()
        upstream = stack.start_upstream(delay_ms=100)
        key = catalog.seed_catalog(upstream.url)
        web = stack.start_web()
        stack.start_worker("hooks")
        receiver = Receiver(stack)

        from batches.webhooks import services
        from relay.auth import principal_for_key

        services.create_endpoint(
            principal_for_key(key), {"url": receiver.url, "name": "bench", "event_types": ["batch.completed"]}
        )
        busy = requests.post(
            f"{web.url}/v1/batches",
            json={"shape": "openai", "requests": [catalog.chat_body(i) for i in range(ITEMS)]},
            headers={"Authorization": f"Bearer {key}"},
            timeout=300,
        )
        busy.raise_for_status()
        time.sleep(2)
        harness.log(f"item workers busy: {items_running()} items running (8 slots)")

        ids = stored_batches(key, EVENTS + BURST + int(OUTAGE_S * OUTAGE_RATE) + 10)
        steady_ids, ids = ids[:EVENTS], ids[EVENTS:]
        burst_ids, outage_ids = ids[:BURST], ids[BURST:]

        harness.log(f"a. steady: {EVENTS} events at {RATE:g}/s")
        moved = end_batches(steady_ids, RATE)
        running_after = items_running()
        steady = latency_report(moved, wait_arrived(receiver, moved, 600))
        harness.log(f"   items running when the last event was raised: {running_after}")

        harness.log(f"b. burst: {BURST} events as fast as they are raised")
        moved = end_batches(burst_ids, None)
        burst = latency_report(moved, wait_arrived(receiver, moved, 600))

        harness.log(f"c. outage: the receiver answers 503 for {OUTAGE_S:g} s, events at {OUTAGE_RATE:g}/s")
        receiver.set_status(503)
        moved = end_batches(outage_ids, OUTAGE_RATE)
        receiver.set_status(200)
        back = time.time()
        first = wait_arrived(receiver, moved, 600)
        refused = sum(1 for *_, code in receiver.arrivals() if code == 503)
        ids_seen = [row for row in receiver.arrivals() if row[3] == 200]
        duplicates = len(ids_seen) - len({row[0] for row in ids_seen})

        print()
        print(f"Webhooks ({measure.machine()}), item workers busy with a {ITEMS}-item batch at 100 ms:")
        print(
            measure.table(
                ["phase", "events", "delivered/s", "p50 ms", "p99 ms", "max ms"],
                [
                    [
                        f"a. steady at {RATE:g}/s",
                        steady["n"],
                        f"{steady['rate']:.0f}",
                        f"{steady['p50_ms']:.0f}",
                        f"{steady['p99_ms']:.0f}",
                        f"{steady['max_ms']:.0f}",
                    ],
                    [
                        "b. burst",
                        burst["n"],
                        f"{burst['rate']:.0f}",
                        f"{burst['p50_ms']:.0f}",
                        f"{burst['p99_ms']:.0f}",
                        f"{burst['max_ms']:.0f}",
                    ],
                ],
            )
        )
        last = max(first.values()) - back
        print(
            f"c. outage of {OUTAGE_S:g} s ({len(moved)} events, {refused} attempts answered 503): every event "
            f"arrived {last:.1f} s after the receiver came back; duplicates (same webhook-id twice): {duplicates}"
        )
        print(f"   load after the run: {measure.load()}")
        if os.environ.get("BENCH_HOOKS_LOGS"):  # keep the processes' logs (the stack's directory is removed)
            import shutil

            shutil.copytree(stack.tmp, os.environ["BENCH_HOOKS_LOGS"], ignore=shutil.ignore_patterns("payloads"))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "receiver":
        receiver_main(sys.argv[2], sys.argv[3])
    else:
        main()
