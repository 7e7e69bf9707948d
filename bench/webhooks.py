"""Webhook delivery with silent receivers among the tenants, in one run.

    .venv/bin/python -m bench.webhooks          (or: make bench-webhooks; make bench, BENCH_ONLY=webhooks)

Starts, on loopback only: the fake upstream, the background processes as compose declares them (item worker,
control worker, the webhook lane, beat) on a fresh PostgreSQL database `relay_bench_hooks` and Redis db 14
(BENCH_REDIS_DB_HOOKS), a webhook receiver in its own process (a ThreadingHTTPServer that notes when each
delivery arrived and answers 200) and a silent server in another (it accepts every connection and never
answers, nor reads).

BENCH_HOOKS_ENDPOINTS (100) tenants — one relay key each — register one endpoint each for `batch.completed`;
BENCH_HOOKS_SILENT (10) of them point at the silent server, the others at the receiver. BENCH_HOOKS_EVENTS
(10,000) events are spread evenly over the tenants and raised by the real final move, owner after owner in
turn, at BENCH_HOOKS_RATE (300/s) from BENCH_HOOKS_RAISERS (3) processes: native batches stored `running`
(each holding one item under a lease the sweeper leaves alone) moved to `completed` by
`batches.lifecycle.states.move` — the lifecycle's own call, so each writes its event and delivery in the
move's transaction and wakes the lane on commit.

Prints the rate at which events reached the answering endpoints (their count over the time from the first
move to the last arrival) and their latency (arrival − the move's commit, same clock): p50, p99, max. Asserts
only that every event to an answering endpoint arrived.
"""

import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench import catalog, harness, measure

EVENTS = harness.env_int("BENCH_HOOKS_EVENTS", 10_000)
ENDPOINTS = harness.env_int("BENCH_HOOKS_ENDPOINTS", 100)
SILENT = harness.env_int("BENCH_HOOKS_SILENT", 10)
RATE = harness.env_float("BENCH_HOOKS_RATE", 300.0)
RAISERS = harness.env_int("BENCH_HOOKS_RAISERS", 3)
REDIS_DB = harness.env_int("BENCH_REDIS_DB_HOOKS", 14)
HOLDER = "bench-holder"


# --- the receiver and the silent server (each its own process) ----------------------------------------------


def receiver_main(port_file: str, log_file: str) -> None:
    """Answer every POST 200 and note `webhook-id data.id arrival` per delivery."""
    lock = threading.Lock()
    out = open(log_file, "a", buffering=1)  # noqa: SIM115 - the process's whole life

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            arrived = time.time()
            with lock:
                out.write(f"{self.headers['webhook-id']} {json.loads(body)['data']['id']} {arrived:.6f}\n")
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.request_queue_size = 1024
    Path(port_file).write_text(str(server.server_address[1]))
    server.serve_forever()


def silent_main(port_file: str, count_file: str) -> None:
    """Accept every connection and hold it: never read, never answer. Notes how many it holds."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    Path(port_file).write_text(str(sock.getsockname()[1]))
    held = []
    while True:
        conn, _ = sock.accept()
        held.append(conn)
        Path(count_file).write_text(str(len(held)))


def start(stack: harness.Stack, role: str, *files) -> str:
    port_file = stack.tmp / f"{role}.port"
    proc = stack.spawn(role, [harness.PY, "-m", "bench.webhooks", role, str(port_file), *map(str, files)])
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {role} did not start\n{proc.tail()}")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port_file.read_text()}/hooks"


# --- tenants, endpoints and events ----------------------------------------------------------------------------


def tenants(first_key: str, n: int) -> list[str]:
    """`n` relay keys of their own service accounts (owners), the bench's first key among them."""
    from core.models import ServiceAccount
    from core.services import create_relay_key

    base = ServiceAccount.objects.get(name="bench")
    keys = [first_key]
    for i in range(1, n):
        sa = ServiceAccount.objects.create(project=base.project, name=f"tenant-{i}", policy=base.policy)
        keys.append(create_relay_key(service_account=sa, name=f"tenant-{i}")[1])
    return keys


def stored_batches(key: str, n: int) -> list:
    """`n` native batches of `key`'s owner, `running`, each with one item held `running` under a lease that
    outlives the run (the sweeper leaves them alone, no worker claims them): each becomes one event when moved."""
    from datetime import timedelta

    import uuid6
    from django.utils import timezone

    from batches.models import Batch, BatchStatus, Item, Surface
    from core.auth import principal_for_key

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


def raiser_main(ids_file: str, rate: str, start_at: str, out_file: str) -> None:
    """A raiser process: move its batches to completed at `rate` a second from `start_at` (epoch seconds) and
    note `batch-id commit-time` per move. Several run at once: one Python process cannot raise 200 a second on
    a busy 2-core machine, and the raising is not what is measured."""
    import django

    django.setup()
    from batches.lifecycle import states
    from batches.models import BatchStatus, Surface

    ids = Path(ids_file).read_text().split()
    with open(out_file, "w") as out:
        for i, batch_id in enumerate(ids):
            wait = float(start_at) + i / float(rate) - time.time()
            if wait > 0:
                time.sleep(wait)
            if states.move(batch_id, Surface.NATIVE, BatchStatus.COMPLETED):
                out.write(f"{batch_id} {time.time():.6f}\n")
            else:  # moved by someone else first (the sweeper): its event is not timed
                out.write(f"{batch_id} -\n")


def end_batches(stack: harness.Stack, ids: list, rate: float, raisers: int) -> dict[str, float]:
    """Move each batch to completed (its final move) at `rate` a second in all, from `raisers` processes; when
    each move committed, by batch id."""
    start_at = time.time() + 3  # every raiser has set Django up by then
    procs, outs = [], []
    for k in range(raisers):
        share = stack.tmp / f"raise-{k}.ids"
        share.write_text("\n".join(str(b) for b in ids[k::raisers]))
        outs.append(stack.tmp / f"raise-{k}.out")
        argv = [
            harness.PY,
            "-m",
            "bench.webhooks",
            "raise",
            str(share),
            str(rate / raisers),
            str(start_at),
            str(outs[-1]),
        ]
        procs.append(stack.spawn(f"raiser-{k}", argv))
    for proc in procs:
        if proc.popen.wait(timeout=3600) != 0:
            raise RuntimeError(f"a raiser failed\n{proc.tail()}")
    moved = {}
    for out in outs:
        for line in out.read_text().splitlines():
            batch_id, at = line.split()
            if at != "-":
                moved[batch_id] = float(at)
    return moved


def arrivals(log: Path) -> dict[str, float]:
    first: dict[str, float] = {}
    for line in log.read_text().splitlines():
        _, data_id, at = line.split()
        first.setdefault(data_id, float(at))
    return first


# --- the run --------------------------------------------------------------------------------------------------


def main() -> None:
    os.environ.update(RELAY_WEBHOOK_ALLOWED_HOSTS="127.0.0.1")
    harness.log(f"webhooks: {measure.machine()}; load {measure.load()}")
    with harness.Stack(harness.db_name("_hooks"), REDIS_DB) as stack:
        stack.fresh()
        upstream = stack.start_upstream(delay_ms=100)
        first_key = catalog.seed_catalog(upstream.url)
        stack.start_worker("hooks")
        log = stack.tmp / "arrivals.log"
        log.touch()
        count_file = stack.tmp / "silent.count"
        good_url = start(stack, "receiver", log)
        silent_url = start(stack, "silent", count_file)

        from batches.webhooks import services
        from batches.webhooks.models import Delivery
        from core.auth import principal_for_key

        keys = tenants(first_key, ENDPOINTS)
        silent_keys = set(keys[:: max(1, ENDPOINTS // SILENT)][:SILENT])  # spread among the others
        for i, key in enumerate(keys):
            url = silent_url if key in silent_keys else f"{good_url}/{i}"
            body = {"url": url, "name": f"t{i}", "event_types": ["batch.completed"]}
            services.create_endpoint(principal_for_key(key), body)
        per_tenant = EVENTS // ENDPOINTS
        stored = {key: stored_batches(key, per_tenant) for key in keys}
        # Owner after owner in turn, as many tenants' batches end at once.
        order = [stored[key][j] for j in range(per_tenant) for key in keys]
        answering = {str(b) for key in keys if key not in silent_keys for b in stored[key]}
        harness.log(
            f"{len(order)} events to {ENDPOINTS} endpoints ({len(silent_keys)} silent) at {RATE:g}/s "
            f"from {RAISERS} processes"
        )
        lane_proc = next(p for p in stack.procs if p.name.startswith("webhooks-"))
        cpu0 = measure.cpu_seconds(lane_proc.popen.pid)
        moved = end_batches(stack, order, RATE, RAISERS)
        raised_in = max(moved.values()) - min(moved.values())
        if len(moved) < len(order):
            harness.log(f"{len(order) - len(moved)} batches were ended by another process first: not timed")
        answering &= moved.keys()
        harness.log(f"raised {len(moved)} events in {raised_in:.1f} s ({len(moved) / raised_in:.0f}/s)")
        deadline = time.monotonic() + 600
        while True:
            first = arrivals(log)
            got = answering & first.keys()
            if len(got) == len(answering):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(answering) - len(got)} of {len(answering)} events did not arrive")
            time.sleep(0.25)
        lat = [first[k] - moved[k] for k in answering]
        span = max(first[k] for k in answering) - min(moved.values())
        lane_cpu = (measure.cpu_seconds(lane_proc.popen.pid) or 0) - (cpu0 or 0)
        silent_held = int(count_file.read_text()) if count_file.exists() else 0
        silent_pending = Delivery.objects.filter(endpoint__url=silent_url, outcome="pending").count()

        print()
        print(
            f"Webhooks ({measure.machine()}): {len(moved)} events to {ENDPOINTS} endpoints, "
            f"{len(silent_keys)} never answering; raised at {len(moved) / raised_in:.0f}/s"
        )
        print(
            measure.table(
                ["to the answering endpoints", "events", "delivered/s", "p50 ms", "p99 ms", "max ms"],
                [
                    [
                        f"{ENDPOINTS - len(silent_keys)} endpoints",
                        len(answering),
                        f"{len(answering) / span:.0f}",
                        f"{measure.percentile(lat, 50) * 1000:.0f}",
                        f"{measure.percentile(lat, 99) * 1000:.0f}",
                        f"{max(lat) * 1000:.0f}",
                    ]
                ],
            )
        )
        print(
            f"   the lane process's CPU: {lane_cpu:.1f} s, {lane_cpu / len(answering) * 1000:.2f} ms per event "
            f"delivered (one core's worth: {len(answering) / lane_cpu if lane_cpu else 0:.0f} events/s)"
        )
        print(
            f"   silent endpoints: {silent_held} connections held by the silent server, "
            f"{silent_pending} deliveries still pending; load after the run: {measure.load()}"
        )
        if os.environ.get("BENCH_HOOKS_LOGS"):  # keep the processes' logs (the stack's directory is removed)
            import shutil

            shutil.copytree(stack.tmp, os.environ["BENCH_HOOKS_LOGS"], ignore=shutil.ignore_patterns("payloads"))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "receiver":
        receiver_main(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "raise":
        raiser_main(*sys.argv[2:6])
    elif len(sys.argv) > 1 and sys.argv[1] == "silent":
        silent_main(sys.argv[2], sys.argv[3])
    else:
        main()
