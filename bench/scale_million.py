"""A million records: 20 batches × 50,000 records from 5 tenants, submitted through the API as a
client would, on the stack of a many-host deployment — PgBouncer in transaction mode, the s3 payload store
(moto's server on loopback), 4 item-worker replicas, a control worker and beat, the web server — with the
relay's own measurements at 2,000 and at ~1,000,000 rows of items and usage events written by the relay.

    make bench-million      (or: .venv/bin/python -m bench.scale_million)

The million runs in provider mode (`gpt-4o-provider`, `batch_mode: provider`; every BENCH_MILLION_ANTHROPIC_EVERY-th
batch on the Anthropic surface, `claude-provider`): the fake provider (bench/fake_upstream.py) runs each job in
BENCH_MILLION_JOB_SECONDS. In relay mode a record is a live call (~7-21 ms of CPU): a million of them is
hours of CPU on a 2-core machine; in provider mode the relay validates, sends, polls and writes results
(~1 ms a record). Steps:
1. warm-up: BENCH_MILLION_WARMUP (2,000) provider-mode records through the API (every process has loaded
   its code), then the measurements at "2k";
2. the million: BENCH_MILLION_BATCHES × BENCH_MILLION_RECORDS from BENCH_MILLION_TENANTS tenants (each a
   service account with its own relay key), `POST /v1/files` + `POST /v1/batches` (or
   `POST /v1/messages/batches`), paced: the next batch goes when the previous one's job is sent and fewer
   than BENCH_MILLION_OPEN batches are unfinished. CPU per record by process group from /proc (as
   bench/scale_drain.py counts it). Then verified: every batch completed, its request counts, its output's
   lines and custom_ids, its items' states and one usage event per record (rows counted in PostgreSQL);
3. the measurements at "1M", on top of those rows.
The measurements at each point: bench/scale.py's (an in-process drain of BENCH_SCALE_DRAIN [1000] items
timed claim by claim, the sweeper, /metrics, the admin changelists, bytes per row — with the item workers
stopped so that they do not take its items, and this process on a direct connection so its backend's CPU
is its own), then bench/scale_drain.py's: BENCH_MILLION_DRAIN_BATCHES (20) × BENCH_MILLION_DRAIN_RECORDS
(500) records in relay mode (gpt-4o, fake at 0 ms) drained by the 4 item workers through PgBouncer.

Database relay_bench_million (BENCH_DB_PREFIX), Redis db BENCH_REDIS_DB_MILLION (5); its own PgBouncer
(BENCH_MILLION_PGBOUNCER_DIR) and moto server (BENCH_SCALE_S3_PORT, 9395 here) so no one else's traffic is
counted. Prints tables; asserts nothing about timings; exits non-zero when a record is lost or duplicated.
"""

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid

os.environ.setdefault("BENCH_SCALE_S3_PORT", "9395")  # a moto server of our own (read by bench.scale_drain)

import requests  # noqa: E402

from bench import catalog, harness, measure, scale  # noqa: E402
from bench import scale_drain as drain_mod  # noqa: E402
from bench.harness import env_int, log  # noqa: E402
from bench.measure import CpuWatch, load, machine, pg_backends, process_tree, table  # noqa: E402
from bench.provider_batch_parts import PROVIDER_MODEL, _sent, _state, db, upload_and_create, write_jsonl  # noqa: E402

BATCHES = env_int("BENCH_MILLION_BATCHES", 20)
RECORDS = env_int("BENCH_MILLION_RECORDS", 50_000)
TENANTS = env_int("BENCH_MILLION_TENANTS", 5)
WORKERS = env_int("BENCH_MILLION_WORKERS", 4)
WARMUP = env_int("BENCH_MILLION_WARMUP", 2_000)
JOB_SECONDS = harness.env_float("BENCH_MILLION_JOB_SECONDS", 20.0)
OPEN = env_int("BENCH_MILLION_OPEN", 4)
ANTHROPIC_EVERY = env_int("BENCH_MILLION_ANTHROPIC_EVERY", 4)  # 0: every batch on the OpenAI surface
DRAIN_BATCHES = env_int("BENCH_MILLION_DRAIN_BATCHES", 20)
DRAIN_RECORDS = env_int("BENCH_MILLION_DRAIN_RECORDS", 500)
ITEM_BYTES = env_int("BENCH_ITEM_BYTES", 650)
REDIS_DB = env_int("BENCH_REDIS_DB_MILLION", 5)
PGBOUNCER_DIR = os.environ.get("BENCH_MILLION_PGBOUNCER_DIR") or "/tmp/relay-bench-million-pgbouncer"
ANTHROPIC_MODEL = "claude-provider"
DRIVER = "relay-bench-million-driver"
GROUPS = ("web", "item workers", "control", "beat", "postgres", "pgbouncer", "s3 (moto)", "fake")
RELAY = ("web", "item workers", "control", "beat", "postgres", "pgbouncer")


# --- the stack and the catalog --------------------------------------------------------------------------


def _driver_env(stack) -> None:
    """This process (migrate, seed, poll, verify, scale.py's in-process measurements) talks to PostgreSQL
    directly under a name of its own, so pg_backends can leave it out; the relay's processes get
    stack.app_env() (PgBouncer, transaction mode)."""
    url = f"{stack.database_url}?application_name={DRIVER}"
    os.environ.update(DATABASE_URL=url, DATABASE_DIRECT_URL=url)
    os.environ.pop("DATABASE_POOLER", None)


def _catalog(upstream_url: str) -> list[tuple[str, object]]:
    """The bench catalog, gpt-4o-provider (batch_mode provider), claude-provider on an Anthropic host of the
    fake (batch_mode provider), and TENANTS service accounts on the bench policy, each with a relay key.
    Returns [(plaintext key, principal)] per tenant."""
    from core import auth
    from core.models import Host, HostBinding, HostKey, LLMModel, Project, ServiceAccount
    from core.services import create_relay_key
    from policies.models import Policy, PolicyHostKey

    catalog.seed_catalog(upstream_url)
    catalog.add_batch_binding(PROVIDER_MODEL, "provider")
    policy = Policy.objects.get(name="bench")
    price = HostBinding.objects.get(model__name=catalog.MODEL).pricing
    host = Host.objects.create(name="anthropic", base_url=upstream_url)
    model = LLMModel.objects.create(name=ANTHROPIC_MODEL, provider="anthropic")
    HostBinding.objects.create(
        model=model,
        host=host,
        adapter="anthropic",
        upstream_name="claude-sonnet-4",
        pricing=price,
        batch_mode="provider",
    )
    key = HostKey(name="anthropic-bench", host=host)
    key.set_value("bench-anthropic-key")
    key.save()
    PolicyHostKey.objects.create(policy=policy, host_key=key, position=10)
    project = Project.objects.get(name="bench")
    out = []
    for t in range(TENANTS):
        sa = ServiceAccount.objects.create(project=project, name=f"tenant-{t}", policy=policy)
        _, plaintext = create_relay_key(name=f"tenant-{t}", service_account=sa)
        out.append((plaintext, auth.principal_for_key(plaintext)))
    return out


def _anthropic_body(n: int) -> bytes:
    """Anthropic's Message Batches body: {"requests": [{custom_id, params}]}, ~ITEM_BYTES a request."""
    reqs = []
    for i in range(n):
        body = catalog.chat_body(i, max(0, ITEM_BYTES - 60), model=ANTHROPIC_MODEL)
        params = {
            "model": ANTHROPIC_MODEL,
            "max_tokens": body["max_tokens"],
            "system": body["messages"][0]["content"],
            "messages": [body["messages"][1]],
        }
        reqs.append({"custom_id": f"request-{i}", "params": params})
    return json.dumps({"requests": reqs}, separators=(",", ":")).encode()


def _submit(web, key: str, surface: str, inputs: dict) -> dict:
    if surface == "openai":
        out = upload_and_create(web, key, inputs["openai"])
    else:
        t0 = time.perf_counter()
        got = requests.post(
            f"{web.url}/v1/messages/batches",
            data=inputs["anthropic"],
            headers={"x-api-key": key, "anthropic-version": "2023-06-01", "content-type": "application/json"},
            timeout=900,
        )
        if got.status_code != 200:
            raise RuntimeError(f"POST /v1/messages/batches answered {got.status_code}: {got.text[:500]}")
        public_id = got.json()["id"]
        out = {"public_id": public_id, "pk": uuid.UUID(hex=public_id.removeprefix("msgbatch_"))}
        out["create_s"] = time.perf_counter() - t0
    return {**out, "surface": surface, "key": key, "t": time.monotonic()}


def _statuses(pks) -> dict:
    from batches.models import Batch

    return dict(Batch.objects.filter(pk__in=pks).values_list("pk", "status"))


def _wait_all(pks, timeout: float, what: str, progress=None) -> None:
    deadline, next_log = time.monotonic() + timeout, time.monotonic() + 30
    while True:
        st = db(_statuses, pks)
        bad = {k: v for k, v in st.items() if v in ("failed", "cancelled", "expired")}
        if bad:
            raise RuntimeError(f"{what}: batches ended {bad}")
        if sum(v == "completed" for v in st.values()) == len(pks):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not completed after {timeout:.0f} s: {st}")
        if progress is not None and time.monotonic() >= next_log:
            progress()
            next_log += 30
        time.sleep(2)


# --- the million ------------------------------------------------------------------------------------------


def _million(stack, web, tenants, groups) -> dict:
    """BATCHES × RECORDS records in provider mode, through the API, paced; CPU per record by group."""
    requests.post(f"{stack.upstream.url}/_bench/config", json={"batch_seconds": JOB_SECONDS}, timeout=10)
    surfaces = [
        "anthropic" if ANTHROPIC_EVERY and i % ANTHROPIC_EVERY == ANTHROPIC_EVERY - 1 else "openai"
        for i in range(BATCHES)
    ]
    inputs = {"openai": stack.tmp / "million.jsonl"}
    write_jsonl(inputs["openai"], RECORDS, ITEM_BYTES, PROVIDER_MODEL)
    if "anthropic" in surfaces:
        inputs["anthropic"] = _anthropic_body(RECORDS)
    subs: list[dict] = []

    def progress():
        from django.db import connection

        def events():
            with connection.cursor() as cur:
                cur.execute("SELECT count(*) FROM usage_usageevent")
                return cur.fetchone()[0]

        events = db(events)
        st = db(_statuses, [s["pk"] for s in subs])
        done = sum(v == "completed" for v in st.values())
        log(f"million: {len(subs)}/{BATCHES} submitted, {done} completed, {events:,} usage events; {load()}")

    with CpuWatch(groups) as cpu:
        for i, surface in enumerate(surfaces):
            while subs:  # pacing: the previous batch's job sent, fewer than OPEN batches unfinished
                status, jobs = db(_state, subs[-1]["pk"])
                if status in ("failed", "cancelled", "expired"):
                    raise RuntimeError(f"batch {subs[-1]['public_id']} ended {status} (jobs {jobs})")
                unfinished = sum(v != "completed" for v in db(_statuses, [s["pk"] for s in subs]).values())
                if (status == "completed" or _sent(status, jobs)) and unfinished < OPEN:
                    break
                time.sleep(1)
            tenant_key = tenants[i % len(tenants)][0]
            subs.append(_submit(web, tenant_key, surface, inputs))
            log(f"million: batch {i + 1}/{BATCHES} ({surface}, tenant {i % len(tenants)}) {subs[-1]['public_id']}")
        _wait_all([s["pk"] for s in subs], 6 * 3600, "the million", progress)
    log(f"million: {cpu.describe(BATCHES * RECORDS, 'record')}")
    return {"cpu": cpu, "subs": subs, "surfaces": surfaces}


def _verify(web, subs: list[dict]) -> dict:
    """Every batch completed with RECORDS completed requests, RECORDS output lines with RECORDS distinct
    custom_ids, RECORDS items completed and RECORDS usage events (one per item, none twice)."""
    from django.db import connection

    problems, lines_total = [], 0
    for s in subs:
        auth = {"Authorization": f"Bearer {s['key']}"}
        if s["surface"] == "openai":
            b = requests.get(f"{web.url}/v1/batches/{s['public_id']}", headers=auth, timeout=60).json()
            done, status = b["request_counts"]["completed"], b["status"]
            url = f"{web.url}/v1/files/{b['output_file_id']}/content"
        else:
            b = requests.get(f"{web.url}/v1/messages/batches/{s['public_id']}", headers=auth, timeout=60).json()
            done, status = b["request_counts"]["succeeded"], b["processing_status"]
            url = f"{web.url}/v1/messages/batches/{s['public_id']}/results"
        ids, n = set(), 0
        with requests.get(url, headers=auth, stream=True, timeout=900) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if line:
                    n += 1
                    ids.add(json.loads(line)["custom_id"])
        lines_total += n
        s.update(counted=done, lines=n, distinct=len(ids))
        if status not in ("completed", "ended") or done != RECORDS or n != RECORDS or len(ids) != RECORDS:
            problems.append(f"{s['public_id']}: status {status}, completed {done}, lines {n}, custom_ids {len(ids)}")
    pks = [str(s["pk"]) for s in subs]
    with connection.cursor() as cur:
        cur.execute(
            "SELECT batch_id::text, state, count(*) FROM batches_item WHERE batch_id::text = ANY(%s) GROUP BY 1, 2",
            [pks],
        )
        items = cur.fetchall()
        cur.execute(
            "SELECT batch_id, count(*), count(DISTINCT request_id), count(DISTINCT executed_by), min(executed_by) "
            "FROM usage_usageevent WHERE batch_id = ANY(%s) GROUP BY 1",
            [pks],
        )
        events = {row[0]: row[1:] for row in cur.fetchall()}
        cur.execute(
            "SELECT count(*) FROM (SELECT e.request_id FROM usage_usageevent e JOIN batches_item i "
            "ON e.request_id = i.id::text WHERE i.batch_id::text = ANY(%s)) x",
            [pks],
        )
        joined = cur.fetchone()[0]
    completed = {b: n for b, state, n in items if state == "completed"}
    for b, state, n in items:
        if state != "completed":
            problems.append(f"batch {b}: {n} items {state}")
    for b in pks:
        ev = events.get(b, (0, 0, 0, None))
        if completed.get(b) != RECORDS or ev[0] != RECORDS or ev[1] != RECORDS:
            problems.append(f"batch {b}: items completed {completed.get(b)}, usage events {ev[0]} ({ev[1]} distinct)")
    total_events = sum(ev[0] for ev in events.values())
    executed_by = sorted({ev[3] for ev in events.values()})
    n = len(subs) * RECORDS
    return {
        "problems": problems,
        "items": sum(completed.values()),
        "events": total_events,
        "events_joined": joined,
        "lines": lines_total,
        "executed_by": executed_by,
        "lost": n - min(sum(completed.values()), total_events),
        "duplicated": max(0, total_events - joined) + max(0, lines_total - n),
    }


# --- the measurements at one size ------------------------------------------------------------------


class Workers:
    """The item-worker replicas, stopped while scale.py's in-process drain runs (they would take its items)."""

    def __init__(self, stack):
        self.stack, self.procs, self.gen = stack, [], 0

    def start(self) -> None:
        self.gen += 1
        for i in range(WORKERS):
            first = not any(p.name.startswith("control-") for p in self.stack.procs)
            self.procs.append(self.stack.start_worker(f"w{i}g{self.gen}", beat=first))

    def stop(self) -> None:
        for p in self.procs:
            p.stop()
            self.stack.procs.remove(p)
        self.procs = []

    def pids(self) -> list[int]:
        return [q for w in self.procs for q in process_tree(w.popen.pid)]


def _in_process(label: str, principal, client, token) -> list:
    """bench/scale.py's measurements at this size (scale.measure_point), under MEASURE_COLUMNS."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        pg_pid = cur.fetchone()[0]
    cells, usage_rows = scale.measure_point(principal, pg_pid, client, token)
    log(f"{label}: {dict(zip(scale.COLUMNS, cells, strict=True))}")
    return [label, cells[0], f"{usage_rows:,}", *cells[1:]]


MEASURE_COLUMNS = ["point", "item rows", "usage rows", *scale.COLUMNS[1:]]


def _worker_drain(label: str, principals, groups, client, token) -> list:
    """bench/scale_drain.py's drain: DRAIN_BATCHES × DRAIN_RECORDS relay-mode records by the item workers."""
    n = DRAIN_BATCHES * DRAIN_RECORDS
    log(f"{label}: relay-mode drain of {DRAIN_BATCHES} x {DRAIN_RECORDS} records on {WORKERS} workers")
    with CpuWatch(groups) as cpu:
        ids = [db(scale._submit, principals[i % len(principals)], DRAIN_RECORDS).pk for i in range(DRAIN_BATCHES)]
        _wait_all(ids, 3600, f"{label} drain")
    per = cpu.per_unit_ms(n)
    scrapes = []
    for _ in range(5):
        t0 = time.perf_counter()
        assert client.get("/metrics", **token).status_code == 200
        scrapes.append((time.perf_counter() - t0) * 1000)
    log(f"{label}: {cpu.describe(n, 'record')}")
    return [
        label,
        f"{n:,}",
        f"{cpu.elapsed:.0f}",
        f"{n / cpu.elapsed:.0f}",
        *[f"{per[g]:.2f}" for g in GROUPS],
        f"{sum(per[g] for g in GROUPS):.2f}",
        f"{statistics.median(scrapes):.0f}",
        f"{cpu.machine_busy:.2f}",
    ]


def _point(label, workers, principals, groups, client, token) -> tuple[list, list]:
    workers.stop()
    row = _in_process(label, principals[0], client, token)
    workers.start()
    return row, _worker_drain(label, principals, groups, client, token)


# --- the run ------------------------------------------------------------------------------------------


def _backends(db_name: str, **kw) -> list[int]:
    """pg_backends through a restart of the shared PostgreSQL (other people's durability tests restart it):
    none this second, a new observer connection next time."""
    try:
        return pg_backends(db_name, **kw)
    except Exception:  # noqa: BLE001
        measure._pg_local.conn = None
        return []


def run() -> int:
    started, load0 = time.time(), load()
    pooler = drain_mod.pgbouncer(PGBOUNCER_DIR)
    s3 = drain_mod._moto()
    drain_mod._bucket(s3[0])
    stack = drain_mod._Stack(db_name=harness.db_name("_million"), redis_db=REDIS_DB)
    stack.pooler_port, stack.s3_endpoint = pooler[0], s3[0]
    with _own_servers(), stack, _tails_on_error(stack):
        _signals()
        _driver_env(stack)
        log(f"fresh database {stack.db_name}, Redis db {stack.redis_db}; PgBouncer :{pooler[0]}, s3 {s3[0]}")
        stack.fresh()
        from django.conf import settings
        from django.contrib.auth import get_user_model
        from django.test import Client

        stack.upstream = upstream = stack.start_upstream(0.0)
        tenants = _catalog(upstream.url)
        principals = [p for _, p in tenants]
        web = stack.start_web(production=True)
        workers = Workers(stack)
        workers.start()
        rest = [p for p in stack.procs if p.name.startswith(("control-", "beat-"))]
        control = [p for p in rest if p.name.startswith("control-")]
        beat = [p for p in rest if p.name.startswith("beat-")]
        groups = {
            "web": lambda: process_tree(web.proc.popen.pid),
            "item workers": workers.pids,
            "control": lambda: [q for p in control for q in process_tree(p.popen.pid)],
            "beat": lambda: [q for p in beat for q in process_tree(p.popen.pid)],
            "postgres": lambda: _backends(stack.db_name, backend_type="client backend", but_app=DRIVER),
            "pgbouncer": lambda: [pooler[1]],
            "s3 (moto)": lambda: [s3[1]],
            "fake": lambda: process_tree(upstream.proc.popen.pid),
            "autovacuum": lambda: _backends(stack.db_name, backend_type="autovacuum worker"),
            "this client": lambda: [os.getpid()],
        }
        admin = get_user_model().objects.create_superuser("million-admin", "a@example.com", uuid.uuid4().hex)
        client = Client()
        client.force_login(admin)
        token = {"HTTP_AUTHORIZATION": f"Bearer {settings.RELAY_ADMIN_TOKEN}"}

        log(f"warm-up: {WARMUP} provider-mode records through the API (5 s job)")
        requests.post(f"{upstream.url}/_bench/config", json={"batch_seconds": 5}, timeout=10).raise_for_status()
        path = stack.tmp / "warmup.jsonl"
        write_jsonl(path, WARMUP, ITEM_BYTES, PROVIDER_MODEL)
        warm = [upload_and_create(web, tenants[0][0], path)["pk"]]
        if ANTHROPIC_EVERY:
            body = {"anthropic": _anthropic_body(50)}
            warm.append(_submit(web, tenants[1][0], "anthropic", body)["pk"])
        _wait_all(warm, 900, "warm-up")
        small = _point("2k", workers, principals, groups, client, token)

        m = _million(stack, web, tenants, groups)
        log("million: verifying (API counts, output lines, items, usage events)")
        v = db(_verify, web, m["subs"])
        log(f"million: verified: {json.dumps({k: val for k, val in v.items() if k != 'problems'})}")
        for p in v["problems"][:20]:
            log(f"PROBLEM {p}")
        big = _point("1M", workers, principals, groups, client, token)
        load1 = load()
    _report(started, load0, load1, m, v, [small[0], big[0]], [small[1], big[1]])
    return 1 if v["problems"] or v["lost"] or v["duplicated"] else 0


@contextlib.contextmanager
def _own_servers():
    """Stops the run's own PgBouncer and moto server at the end, however it ends: moto keeps every object in
    memory (~850 MB after a million records), and no one else uses these two."""
    try:
        yield
    finally:
        subprocess.run(
            ["bash", "scripts/pgbouncer.sh", "stop"],
            cwd=drain_mod.ROOT,
            capture_output=True,
            env={**os.environ, "PGBOUNCER_DIR": PGBOUNCER_DIR},
        )
        subprocess.run(
            ["bash", "scripts/s3.sh", "stop", str(drain_mod.S3_PORT)], cwd=drain_mod.ROOT, capture_output=True
        )


def _signals() -> None:
    """After the harness's handlers: a hangup is ignored (a run of 40 minutes started with nohup outlives its
    terminal), and a SIGTERM says where it came from before the stack is cleaned up."""

    def term(signum, _frame):
        log(f"signal {signum} received (sender unknown); stopping")
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, term)


@contextlib.contextmanager
def _tails_on_error(stack):
    """On a failure, the end of each process's log (the stack's directory goes with it)."""
    try:
        yield
    except BaseException:
        for p in stack.procs:
            if p.name != "upstream":
                print(f"--- {p.name} (last lines)\n{p.tail(4000)}", file=sys.stderr)
        raise


def _report(started, load0, load1, m, v, scale_rows, drain_rows) -> None:
    cpu, n = m["cpu"], BATCHES * RECORDS
    per = cpu.per_unit_ms(n)
    n_anthropic = m["surfaces"].count("anthropic")
    print()
    print(f"== A million records — {machine()}")
    print(
        f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(started))}–{time.strftime('%H:%M', time.gmtime())} UTC; "
        f"{load0} at the start, {load1} at the end"
    )
    print(
        f"{BATCHES} batches x {RECORDS:,} records ({BATCHES - n_anthropic} OpenAI surface, {n_anthropic} Anthropic) "
        f"from {TENANTS} tenants, provider mode (fake job {JOB_SECONDS:g} s), through PgBouncer (transaction mode), "
        f"s3 store on moto, {WORKERS} item workers + control worker + beat + web"
    )
    print(
        f"wall {cpu.elapsed:.0f} s ({n / cpu.elapsed:.0f} records/s); the whole machine {cpu.machine_busy:.2f} of "
        f"{os.cpu_count()} cores busy (steal {cpu.machine_steal:.2f})"
    )
    relay = sum(per[g] for g in RELAY)
    print("CPU ms per record:")
    print(
        table(
            [*GROUPS, "relay (web..pgbouncer)", "all", "autovacuum", "this client"],
            [
                [
                    *[f"{per[g]:.3f}" for g in GROUPS],
                    f"{relay:.3f}",
                    f"{sum(per[g] for g in GROUPS):.3f}",
                    f"{per['autovacuum']:.3f}",
                    f"{per['this client']:.3f}",
                ]
            ],
        )
    )
    print(
        f"verified: items completed {v['items']:,}, usage events {v['events']:,} (joined to their items "
        f"{v['events_joined']:,}; executed_by {v['executed_by']}), output lines {v['lines']:,}; lost {v['lost']}, "
        f"duplicated {v['duplicated']}; problems {len(v['problems'])}"
    )
    for p in v["problems"][:20]:
        print(f"  PROBLEM {p}")
    print()
    print("bench/scale.py's measurements (in-process drain of the items claimed one by one; this process direct")
    print("to PostgreSQL; admin = items / batches / usage events changelists, median of 3):")
    print(
        table(
            MEASURE_COLUMNS,
            scale_rows,
        )
    )
    print()
    print(f"bench/scale_drain.py's drain: {DRAIN_BATCHES} x {DRAIN_RECORDS} records in relay mode (fake at 0 ms) by")
    print(f"{WORKERS} item workers through PgBouncer, s3 store on moto; CPU ms per record:")
    print(
        table(
            [
                "point",
                "records",
                "wall s",
                "records/s",
                *GROUPS,
                "total",
                "/metrics ms",
                "machine busy",
            ],
            drain_rows,
        )
    )
    print(f"benchmark wall time {time.time() - started:.0f} s")


if __name__ == "__main__":
    sys.exit(run())
