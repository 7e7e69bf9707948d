"""One run of each figure of the side by side (bench/sidebyside.py) on one tree's stack, over HTTP and /proc only:
nothing of the relay is imported here, so the same code measures any release.
"""

import threading
import time
from dataclasses import dataclass, field
from datetime import datetime

import requests

from bench import catalog, harness, live_overhead, measure, streaming, tree_catalog
from bench.batch_drain import SLOTS, write_native_body
from bench.measure import CpuWatch, percentile
from bench.provider_batch_parts import upload_and_create, write_jsonl
from bench.trees import Tree


@dataclass
class Side:
    """One tree's relay, as the side by side runs it: its stack, fake upstream, web server, key, processes."""

    tree: Tree
    stack: harness.Stack
    upstream: harness.Upstream
    web: harness.Web
    key: str
    fleet: dict = field(default_factory=dict)  # role -> Proc of the first fleet (worker, control, beat, webhooks)
    notes: list = field(default_factory=list)  # what this release lacks or does differently

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}

    def tree_of(self, role: str) -> list[int]:
        proc = self.fleet.get(role)
        return measure.process_tree(proc.popen.pid) if proc is not None else []

    def pg_not_web(self) -> list[int]:
        return pg_backends(self.stack.db_name, but_app=harness.WEB_APP_NAME)


def pg_backends(db_name: str, **kw) -> list[int]:
    """measure.pg_backends through a restart of the shared PostgreSQL (another session's durability tests): the
    observer's connection is made again, once; a second failure gives no backends for that sample."""
    for _ in range(2):
        try:
            return measure.pg_backends(db_name, **kw)
        except Exception:  # noqa: BLE001 - psycopg2's OperationalError / InterfaceError: the server went away
            measure._pg_local.conn = None
    return []


# --- live --------------------------------------------------------------------------------------------------


def live(side: Side, n: int, warmup: int, conc: int, seconds: float) -> dict:
    """bench/live_overhead.py's two figures: relay and direct calls alternating (the overhead is the per-pair
    difference), then requests/s of `conc` client threads against the direct fake and against the relay."""
    body = catalog.chat_body(1)
    relay = ("relay", f"{side.web.url}/v1/chat/completions", side.auth, body)
    direct = (
        "direct",
        f"{side.upstream.url}/v1/chat/completions",
        {"Authorization": f"Bearer {catalog.UPSTREAM_KEY}"},
        dict(body, model=catalog.UPSTREAM_MODEL),
    )
    times, _ = live_overhead._sequential([relay, direct], n, warmup)
    diff = [r - d for r, d in zip(times["relay"], times["direct"], strict=True)]
    direct_tp = live_overhead._throughput(*direct[1:], conc, seconds)
    relay_tp = live_overhead._throughput(*relay[1:], conc, seconds)
    return {
        "overhead_p50": percentile(diff, 50) * 1000,
        "overhead_p99": percentile(diff, 99) * 1000,
        "relay_rps": relay_tp["rps"],
        "direct_rps": direct_tp["rps"],
        "rps_ratio": relay_tp["rps"] / direct_tp["rps"] if direct_tp["rps"] else 0.0,
        "errors": relay_tp["errors"],
    }


# --- streaming ---------------------------------------------------------------------------------------------


def stream(side: Side, n: int, warmup: int, seconds: float, paced_ms: float, clients: int = 50) -> dict:
    """bench/streaming.py's figures: first byte through the relay against direct (per-pair difference), and
    chunk throughput of `clients` streams against direct's, unpaced and paced."""
    events = harness.env_int("BENCH_STREAM_EVENTS", 100)
    relay = streaming.Target("relay", side.web.url, side.auth, streaming.body(events, catalog.MODEL))
    direct = streaming.Target(
        "direct",
        side.upstream.url,
        {"Authorization": f"Bearer {catalog.UPSTREAM_KEY}"},
        streaming.body(events, catalog.UPSTREAM_MODEL),
    )
    streaming.upstream_config(side.upstream, 0)
    times = streaming.first_bytes([relay, direct], n, warmup)
    diff = [a - b for a, b in zip(times["relay"], times["direct"], strict=True)]
    out = {"ttfb_p50": percentile(diff, 50) * 1000, "ttfb_p99": percentile(diff, 99) * 1000, "errors": 0}
    for name, pace in (("unpaced", 0.0), ("paced", paced_ms)):
        streaming.upstream_config(side.upstream, pace)
        d = streaming.throughput(direct, clients, seconds)
        v = streaming.throughput(relay, clients, seconds)
        out[name] = v["events_s"] / d["events_s"] if d["events_s"] else 0.0
        out["errors"] += d["errors"] + v["errors"]
    streaming.upstream_config(side.upstream, 0)
    return out


# --- batches -----------------------------------------------------------------------------------------------


def _iso_ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _submit_native(side: Side, n: int, item_bytes: int) -> tuple[str, float]:
    path = side.stack.tmp / "sbs-batch.json"
    write_native_body(path, n, item_bytes)
    with open(path, "rb") as fh:
        resp = requests.post(
            f"{side.web.url}/v1/batches",
            data=fh,
            headers={**side.auth, "Content-Type": "application/json"},
            timeout=900,
        )
    t202 = time.time()
    path.unlink()
    if resp.status_code != 202:
        raise RuntimeError(f"{side.tree}: POST /v1/batches answered {resp.status_code}: {resp.text[:300]}")
    return resp.json()["id"], t202


def _wait_native(side: Side, batch_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = requests.get(f"{side.web.url}/v1/batches/{batch_id}", headers=side.auth, timeout=60)
        body = resp.json() if resp.status_code == 200 else {}
        if body.get("CompletedAt"):
            return body
        time.sleep(0.5)
    raise RuntimeError(f"{side.tree}: batch {batch_id} not completed after {timeout:.0f} s")


class LiveLoad:
    """Live calls at `rps` on the batch's own key and policy while a drain runs (live-first at work)."""

    def __init__(self, side: Side, rps: float):
        self.side, self.rps, self.sent, self.failed = side, rps, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "LiveLoad":
        if self.rps > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        url, body = f"{self.side.web.url}/v1/chat/completions", catalog.chat_body(7)
        with requests.Session() as s:
            while not self._stop.wait(1 / self.rps):
                try:
                    ok = s.post(url, json=body, headers=self.side.auth, timeout=60).status_code == 200
                except requests.RequestException:
                    ok = False
                self.sent += 1
                self.failed += not ok


def drain(side: Side, n: int, latency_ms: float, item_bytes: int, live_rps: float = 0.0) -> dict:
    """A native batch of `n` records at `latency_ms` drained by one item worker (8 slots): the CPU of the item
    worker and of PostgreSQL (every session but the web server's) per record, and items/s against the slots'."""
    side.upstream.configure(latency_ms)
    groups = {
        "item worker": lambda: side.tree_of("worker"),
        "postgres": side.pg_not_web,
        "control": lambda: side.tree_of("control"),
        "webhooks": lambda: side.tree_of("webhooks"),
        "beat": lambda: side.tree_of("beat"),
        "web": lambda: measure.process_tree(side.web.proc.popen.pid),
    }
    with CpuWatch(groups) as cpu, LiveLoad(side, live_rps) as load:
        batch_id, t202 = _submit_native(side, n, item_bytes)
        status = _wait_native(side, batch_id, timeout=max(600, n / SLOTS * latency_ms / 1000 * 10))
    elapsed = _iso_ts(status["CompletedAt"]) - t202
    per = cpu.per_unit_ms(n)
    return {
        "cpu_ms": per["item worker"] + per["postgres"],
        "worker_ms": per["item worker"],
        "pg_ms": per["postgres"],
        "others_ms": {g: per[g] for g in ("control", "webhooks", "beat", "web")},
        "rate": n / elapsed,
        "ratio": n / elapsed / (SLOTS * 1000 / latency_ms) if latency_ms else None,
        "counts": status.get("counts"),
        "busy": cpu.machine_busy,
        "live_sent": load.sent,
        "live_failed": load.failed,
    }


def scale(side: Side, n: int, latency_ms: float, workers: list[int], item_bytes: int) -> dict:
    """Scale-out: the tree's item worker plus extra ones (started once, the highest count first, then stopped
    one by one), each count draining `n` records at `latency_ms`; items/s against workers × 8 slots."""
    extra = [side.stack.start_worker(name=f"scale{i}", beat=False) for i in range(1, max(workers))]
    out = {}
    try:
        side.upstream.configure(latency_ms)
        for count in sorted(workers, reverse=True):
            while len(extra) > count - 1:
                extra.pop().stop()
            batch_id, t202 = _submit_native(side, n, item_bytes)
            status = _wait_native(side, batch_id, timeout=max(600, n / SLOTS * latency_ms / 1000 * 10))
            ideal = count * SLOTS * 1000 / latency_ms
            out[count] = n / (_iso_ts(status["CompletedAt"]) - t202) / ideal
    finally:
        for proc in extra:
            proc.stop()
    return out


def provider(side: Side, n: int, job_seconds: float, item_bytes: int) -> dict:
    """An OpenAI-surface batch for the provider-mode model, from the upload to the batch's completion (its
    results ingested and its output file written): the CPU of every relay process and PostgreSQL per record."""
    requests.post(
        f"{side.upstream.url}/_bench/config", json={"batch_seconds": job_seconds, "delay_ms": 0}, timeout=10
    ).raise_for_status()
    path = side.stack.tmp / "sbs-provider.jsonl"
    write_jsonl(path, n, item_bytes, tree_catalog.PROVIDER_MODEL)
    groups = {
        "web": lambda: measure.process_tree(side.web.proc.popen.pid),
        **{role: (lambda r=role: side.tree_of(r)) for role in side.fleet},
        "postgres": lambda: pg_backends(side.stack.db_name),
    }
    t0 = time.monotonic()
    with CpuWatch(groups) as cpu:
        created = upload_and_create(side.web, side.key, path)
        deadline = time.monotonic() + max(600, job_seconds * 10)
        while True:
            resp = requests.get(f"{side.web.url}/v1/batches/{created['public_id']}", headers=side.auth, timeout=60)
            status = resp.json().get("status") if resp.status_code == 200 else None
            if status == "completed":
                break
            if status in ("failed", "expired", "cancelled") or time.monotonic() > deadline:
                raise RuntimeError(f"{side.tree}: provider-mode batch {created['public_id']} {status}")
            time.sleep(0.5)
    path.unlink()
    per = cpu.per_unit_ms(n)
    return {
        "cpu_ms": sum(per.values()),
        "by_group_us": {g: round(v * 1000, 1) for g, v in per.items()},
        "seconds": time.monotonic() - t0,
        "counts": resp.json().get("request_counts"),
    }
