"""Autovacuum at PostgreSQL's defaults against the per-table settings docs/many-hosts.md recommends, on the
items and usage tables' own write pattern.

    .venv/bin/python -m bench.vacuum          (about 10 minutes at the defaults on a 2-core machine)

The machine's shared PostgreSQL may run with autovacuum off and is not ours to reconfigure, so this starts
its own PostgreSQL cluster: initdb into a temporary directory (as scripts/drill does: as the `postgres`
user when run as root), on a free loopback port, autovacuum on with autovacuum_naptime lowered for every
configuration alike (BENCH_VACUUM_NAPTIME, 10 s: a short run behaves like a long one at the default 60 s)
and log_autovacuum_min_duration = 0 (each run's CPU is read from that log). The cluster and its directory
are removed at the end, on an error, Ctrl-C or SIGTERM; one left by a run killed outright (SIGKILL) is
removed by the next run. Redis: db BENCH_REDIS_DB_VACUUM (11), flushed at start and end (bench.harness).

Once, into a template database: the relay's migrations (bench.harness), five tenants (bench.scale), and a
history of BENCH_VACUUM_HISTORY finished items with one usage event each, in batches of about
BENCH_VACUUM_ITEMS (bench.scale's SQL copies of rows the relay stored), then VACUUM ANALYZE. Each
configuration (BENCH_VACUUM_CONFIGS) gets its own copy of that template:

- `default`: autovacuum at PostgreSQL's defaults;
- `tuned`: the ALTER TABLE … SET (…) of docs/many-hosts.md on batches_item and usage_usageevent (TUNED);
- `off`: autovacuum_enabled = false on both tables, the worst case.

Then BENCH_VACUUM_ROUNDS rounds, each configuration's round r run one after the other (who goes first
rotates) so that all see the same load of a shared machine. A round: a native batch of BENCH_VACUUM_ITEMS
items stored as the API stores it (`store_native`), drained in this process as a worker slot drains (the
relay's claim with the drain's floor and completion check, every UNFLOORED-th claim without the floor;
`run_item` against the fake provider at 0 ms, whose finish writes the item's usage event and attempt), then
the relay's retention (`batches.retention.sweep`) deleting the oldest finished batches, so the items table
stays at the history's size while every item row is written three times and deleted. The usage table only
grows, as it does in production.

Printed per round: both tables' heap and index size, item_available's size, live and dead rows (statistics
views), autovacuum and autoanalyze counts, the usage table's all-visible pages (pg_visibility); the claim's
and the finish's p50/p99; the CPU of the drain's PostgreSQL backend per item. At the end one row per
configuration, where PostgreSQL's CPU per item is its backend's (/proc) plus every autovacuum and autoanalyze
of its database (the server log), and the whole cluster's CPU over the rounds (/proc: every process of the
cluster, ended ones through the postmaster's cutime/cstime).
"""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from bench import harness
from bench.measure import children_of, cpu_seconds, load, machine, percentile, table

CONFIGS = [c for c in (os.environ.get("BENCH_VACUUM_CONFIGS") or "default,tuned,off").split(",") if c]
ITEMS = harness.env_int("BENCH_VACUUM_ITEMS", 1500)
ROUNDS = harness.env_int("BENCH_VACUUM_ROUNDS", 12)
HISTORY = harness.env_int("BENCH_VACUUM_HISTORY", 100_000)
NAPTIME = harness.env_int("BENCH_VACUUM_NAPTIME", 10)
REDIS_DB = harness.env_int("BENCH_REDIS_DB_VACUUM", 11)
DB = harness.db_name("_vacuum")
TEMPLATE = harness.db_name("_vacuum_tpl")
TABLES = ("batches_item", "usage_usageevent")
OWNER = "bench-vacuum:1:1"
# Every UNFLOORED-th claim is made without the drain's floor, as a drain's first claim and the claim's
# fallback are: its scan of item_available starts at the batch's first entry and walks the entries of the
# items already claimed, which stay in the index until a vacuum. Timed apart from the others.
UNFLOORED = 50
TMP_PREFIX = "relay-bench-vacuum-"

# docs/many-hosts.md, "Autovacuum": the settings this benchmark measures against the defaults.
TUNED = {
    "batches_item": "autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.01, "
    "autovacuum_vacuum_cost_limit = 2000",
    "usage_usageevent": "autovacuum_vacuum_insert_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02",
}
OFF = dict.fromkeys(TABLES, "autovacuum_enabled = false")
TABLE_SETTINGS = {"default": {}, "tuned": TUNED, "off": OFF}


# --- the cluster ------------------------------------------------------------------------------------


def _pgbin() -> str:
    bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    if not bins:
        raise SystemExit("no PostgreSQL server binaries under /usr/lib/postgresql/*/bin (apt-get install postgresql)")
    return str(bins[-1].parent)


def _as_postgres(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: exec as `postgres` (scripts/drill/stack.py's way: setpriv execs,
    so the pid we hold is the postmaster's)."""
    if os.geteuid() != 0:
        return argv
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--", *argv]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _remove_leftovers() -> None:
    """Clusters of runs killed outright (no cleanup ran): their directory is named after their pid."""
    for d in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*"):
        m = re.match(rf"{TMP_PREFIX}(\d+)\.", d.name)
        if not m or Path(f"/proc/{m.group(1)}").exists():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError, ProcessLookupError):
            pid = int((d / "data" / "postmaster.pid").read_text().split()[0])
            if str(d).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():  # its postmaster, not a reused pid
                os.kill(pid, signal.SIGQUIT)
                time.sleep(1)
        harness.log(f"removing {d}, left by run {m.group(1)} (no longer running)")
        shutil.rmtree(d, ignore_errors=True)


class Cluster:
    """Our own PostgreSQL: initdb into a temporary directory, loopback only, trust auth; stopped
    (immediate: its data is thrown away) and removed on exit, whatever the exit."""

    def __enter__(self) -> "Cluster":
        _remove_leftovers()
        self.bin = _pgbin()
        self.dir = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}."))
        self.popen = None
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        os.chmod(self.dir, 0o755)
        if os.geteuid() == 0:
            subprocess.run(["chown", "postgres:postgres", str(self.dir)], check=True)
        data = self.dir / "data"
        subprocess.run(
            _as_postgres(
                [f"{self.bin}/initdb", "-D", str(data), "-U", "postgres", "-E", "UTF8", "--locale=C", "--auth=trust"]
            ),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        self.port = _free_port()
        self.logfile = self.dir / "postgres.log"
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": self.port,
            "unix_socket_directories": str(self.dir),
            "autovacuum": "on",
            "autovacuum_naptime": f"{NAPTIME}s",
            "log_autovacuum_min_duration": "0",
            "max_connections": "50",
        }
        argv = [f"{self.bin}/postgres", "-D", str(data)]
        for k, v in settings.items():
            argv += ["-c", f"{k}={v}"]
        out = open(self.logfile, "ab")  # noqa: SIM115 - the server's stderr for its life; closed in __exit__
        self._out = out
        self.popen = subprocess.Popen(
            _as_postgres(argv), stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + 60
        while subprocess.run([f"{self.bin}/pg_isready", "-q", "-h", "127.0.0.1", "-p", str(self.port)]).returncode:
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"our PostgreSQL did not start:\n{self.logfile.read_text()[-2000:]}")
            time.sleep(0.2)
        self.url = f"postgres://postgres@127.0.0.1:{self.port}"
        harness.log(f"PostgreSQL {self.version()} on 127.0.0.1:{self.port}, data in {data}")

    def __exit__(self, *exc) -> None:
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGQUIT)  # immediate shutdown
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        if self.popen is not None:
            self._out.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def admin(self):
        import psycopg2

        conn = psycopg2.connect(f"{self.url}/postgres")
        conn.autocommit = True
        return conn

    def version(self) -> str:
        return subprocess.run(
            [f"{self.bin}/postgres", "--version"], capture_output=True, text=True, check=True
        ).stdout.split()[2]

    def cpu_seconds(self) -> float:
        """Every process of the cluster, ended ones included: the postmaster reaps its children, and the
        kernel adds their CPU to its cutime/cstime."""
        with open(f"/proc/{self.popen.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        own = sum(int(f) for f in fields[11:15]) / tick  # utime stime cutime cstime
        return own + sum(cpu_seconds(p) or 0.0 for p in children_of(self.popen.pid))

    def log_offset(self) -> int:
        return self.logfile.stat().st_size

    def autovacuum_log(self, since: int) -> dict:
        """(database, vacuum|analyze, table) -> [runs, CPU s, elapsed s] from the server's log after `since`."""
        text = self.logfile.read_bytes()[since:].decode(errors="replace")
        out, current = {}, None
        for line in text.splitlines():
            m = re.search(r'automatic (vacuum|analyze) of table "(\w+)\.\w+\.(\w+)"', line)
            if m:
                current = (m.group(2), m.group(1), m.group(3))
                out.setdefault(current, [0, 0.0, 0.0])[0] += 1
                continue
            m = re.search(r"system usage: CPU: user: ([\d.]+) s, system: ([\d.]+) s, elapsed: ([\d.]+) s", line)
            if m and current is not None:
                out[current][1] += float(m.group(1)) + float(m.group(2))
                out[current][2] += float(m.group(3))
                current = None
        return out


# --- the template database and its copies ---------------------------------------------------------


def _prepare(cluster: Cluster, stack: harness.Stack, upstream_url: str) -> list:
    """Migrations, tenants and the history in DB, made the template of every configuration's copy."""
    stack.fresh()
    from django.db import connection

    from batches.lifecycle import claim as claims
    from batches.worker import execute
    from bench import scale

    principals = scale._tenants(upstream_url)
    templates = [scale._submit(principals[i % len(principals)], 10) for i in range(max(1, HISTORY // ITEMS))]
    while (item := claims.claim(OWNER)) is not None:
        execute.run_item(item)
    t0 = time.perf_counter()
    scale._grow(principals, templates, HISTORY)
    with connection.cursor() as cur:
        cur.execute("CREATE EXTENSION pg_visibility")  # the visibility map's real state (pg_class's is stale)
        cur.execute("VACUUM ANALYZE")
    harness.log(f"history of {HISTORY:,} items written in {time.perf_counter() - t0:.0f} s")
    _disconnect()
    with contextlib.closing(cluster.admin()) as conn:
        conn.cursor().execute(f'ALTER DATABASE "{DB}" RENAME TO "{TEMPLATE}"')
    return principals


def _disconnect() -> None:
    """Close this process's connections, the heartbeat thread's (run_item's) included: a database is
    renamed or dropped only with no session on it."""
    from django.db import connections

    from batches.worker.bookkeeper import bookkeeper

    bookkeeper().submit(connections.close_all).result(timeout=60)
    connections.close_all()


def _use(db: str) -> None:
    """Point the `default` database at `db`, for every thread (their connections share its settings)."""
    from django.db import connections

    _disconnect()
    connections.settings["default"]["NAME"] = db


def _copy(cluster: Cluster, config: str) -> str:
    """The configuration's copy of the template, with its table settings and statistics as after ANALYZE
    (a copy starts with none)."""
    from django.db import connection

    db = harness.db_name(f"_vacuum_{config}")
    with contextlib.closing(cluster.admin()) as conn:
        cur = conn.cursor()
        cur.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        cur.execute(f'CREATE DATABASE "{db}" TEMPLATE "{TEMPLATE}" STRATEGY FILE_COPY')
    _use(db)
    with connection.cursor() as cur:
        for name, options in TABLE_SETTINGS[config].items():
            cur.execute(f"ALTER TABLE {name} SET ({options})")
        for name in TABLES:
            cur.execute(f"ANALYZE {name}")
    return db


# --- the rounds -------------------------------------------------------------------------------------


def _tables() -> dict:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT pg_stat_clear_snapshot()")
        cur.execute(
            """
            SELECT s.relname, s.n_live_tup, s.n_dead_tup, s.autovacuum_count, s.autoanalyze_count,
                   s.last_autovacuum, s.last_autoanalyze, pg_relation_size(s.relid), pg_indexes_size(s.relid),
                   pg_total_relation_size(s.relid),
                   pg_relation_size(s.relid) / current_setting('block_size')::int,
                   (pg_visibility_map_summary(s.relid)).all_visible
            FROM pg_stat_user_tables s WHERE s.relname = ANY(%s)
            """,
            [list(TABLES)],
        )
        keys = ("live", "dead", "av", "aa", "last_av", "last_aa", "heap", "idx", "total", "pages", "visible")
        out = {row[0]: dict(zip(keys, row[1:], strict=True)) for row in cur.fetchall()}
        cur.execute("SELECT pg_relation_size('item_available')")
        out["batches_item"]["available_idx"] = cur.fetchone()[0]
    return out


def _backend_pid() -> int:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        return cur.fetchone()[0]


def _drain() -> tuple[int, list, list, list]:
    """One worker slot's drain of what is claimable: the claim with the drain's floor (but every
    UNFLOORED-th) and completion check, `run_item` handing its final write over (as the drain does) to be
    timed on its own. (items, claim ms, unfloored claim ms, finish ms)"""
    from batches.lifecycle import claim as claims
    from batches.worker import execute

    claim_ms, unfloored_ms, finish_ms = [], [], []

    def timed_write(write):
        t0 = time.perf_counter()
        write()
        finish_ms.append((time.perf_counter() - t0) * 1000)

    floor = check = None
    n = 0
    while True:
        unfloored = n % UNFLOORED == UNFLOORED - 1
        t0 = time.perf_counter()
        item = claims.claim(OWNER, None if unfloored else floor, check)
        if item is None:
            return n, claim_ms, unfloored_ms, finish_ms
        (unfloored_ms if unfloored else claim_ms).append((time.perf_counter() - t0) * 1000)
        execute.run_item(item, check_done=False, hand_over=timed_write)
        floor, check = (item.batch_id, item.idx), item.batch_id
        n += 1


def _retention(kept: list) -> None:
    """The relay's retention job deleting the oldest finished batches, until the items table is back at
    HISTORY rows. `kept`: (batch id, items, completed_at) of the finished batches, oldest first."""
    from django.test import override_settings

    from batches import retention

    total = sum(n for _, n, _ in kept)
    cutoff = None
    while kept and total - kept[0][1] >= HISTORY:
        _, n, cutoff = kept.pop(0)
        total -= n
    if cutoff is not None:
        with override_settings(RELAY_NATIVE_BATCH_RETENTION_SECONDS=1):
            retention.sweep(now=cutoff + timedelta(seconds=1, microseconds=1))


def _mb(n: int) -> str:
    return f"{n / 1024 / 1024:.1f}"


@dataclass
class Run:
    """One configuration: its database and what its rounds measured."""

    config: str
    db: str
    kept: list
    usage0: int
    start: dict
    snapshots: list = field(default_factory=list)
    claim: list = field(default_factory=list)
    unfloored: list = field(default_factory=list)
    finish: list = field(default_factory=list)
    items: int = 0
    wall: float = 0.0
    backend_s: float = 0.0
    relay_s: float = 0.0


def _start(cluster: Cluster, config: str) -> Run:
    from django.db.models import Count

    from batches.models import Batch
    from usage.models import UsageEvent

    db = _copy(cluster, config)
    finished = Batch.objects.filter(completed_at__isnull=False).annotate(n=Count("items")).order_by("completed_at")
    kept = [(b.id, b.n, b.completed_at) for b in finished]
    return Run(config, db, kept, UsageEvent.objects.count(), _tables())


def _round(run: Run, r: int, principal) -> None:
    from batches.models import Batch
    from bench import scale

    _use(run.db)
    pid = _backend_pid()
    be0, me0, t0 = cpu_seconds(pid), time.process_time(), time.perf_counter()
    batch = scale._submit(principal, ITEMS)
    n, claim_ms, unfloored_ms, finish_ms = _drain()
    batch = Batch.objects.get(pk=batch.pk)
    if batch.status != "completed" or n != ITEMS:
        raise RuntimeError(f"{run.config} round {r}: {n} items drained, batch {batch.status}")
    run.kept.append((batch.id, n, batch.completed_at))
    _retention(run.kept)
    elapsed = time.perf_counter() - t0
    be, me = (cpu_seconds(pid) or 0.0) - be0, time.process_time() - me0
    run.items += n
    run.wall += elapsed
    run.backend_s += be
    run.relay_s += me
    run.claim += claim_ms
    run.unfloored += unfloored_ms
    run.finish += finish_ms
    t = _tables()
    run.snapshots.append(t)
    it, us = t["batches_item"], t["usage_usageevent"]
    harness.log(
        f"{run.config:<7} round {r + 1}/{ROUNDS}: {n / elapsed:.0f} items/s; "
        f"claim p50/p99 {percentile(claim_ms, 50):.2f}/{percentile(claim_ms, 99):.2f} ms "
        f"(without floor {percentile(unfloored_ms, 50):.2f}/{percentile(unfloored_ms, 99):.2f}), "
        f"finish {percentile(finish_ms, 50):.2f}/{percentile(finish_ms, 99):.2f}; "
        f"backend CPU {be * 1000 / n:.2f} ms/item; "
        f"items live/dead {it['live']:,}/{it['dead']:,}, heap+idx {_mb(it['heap'])}+{_mb(it['idx'])} MB "
        f"(item_available {it['available_idx'] / 1024:.0f} kB), autovacuum/autoanalyze {it['av']}/{it['aa']}; "
        f"usage live/dead {us['live']:,}/{us['dead']:,}, heap+idx {_mb(us['heap'])}+{_mb(us['idx'])} MB, "
        f"all-visible {us['visible']}/{us['pages']} pages, autovacuum/autoanalyze {us['av']}/{us['aa']}"
    )


def _finish(run: Run) -> None:
    from batches.models import Item
    from usage.models import UsageEvent

    _use(run.db)
    for name in TABLES:
        s = run.snapshots[-1][name]
        harness.log(
            f"{run.config} {name}: last autovacuum {s['last_av'] or '-'}, last autoanalyze "
            f"{s['last_aa'] or '-'}, total {_mb(s['total'])} MB"
        )
    if Item.objects.count() > HISTORY + ITEMS or UsageEvent.objects.count() != run.usage0 + run.items:
        raise RuntimeError(f"{run.config}: the items table left its size, or not one usage event per item")


# --- the report -------------------------------------------------------------------------------------


def _pp(values: list) -> str:
    return f"{percentile(values, 50):.2f} / {percentile(values, 99):.2f}"


def _report(runs: list, av: dict, cluster_s: float) -> None:
    print()
    print(f"machine: {machine()}; {load()}")
    print(
        f"{ROUNDS} rounds of {ITEMS:,} items per configuration, interleaved, on a history of {HISTORY:,} items "
        f"kept at that size by retention; autovacuum_naptime {NAPTIME} s in every configuration"
    )
    s = runs[0].start
    print(
        f"start (every configuration): items heap+idx {_mb(s['batches_item']['heap'])} + "
        f"{_mb(s['batches_item']['idx'])} MB (item_available {s['batches_item']['available_idx'] / 1024:.0f} kB), "
        f"usage heap+idx {_mb(s['usage_usageevent']['heap'])} + {_mb(s['usage_usageevent']['idx'])} MB"
    )
    rows = []
    logged = 0.0
    for run in runs:
        it, us = run.snapshots[-1]["batches_item"], run.snapshots[-1]["usage_usageevent"]

        def cell(kind, name, db=run.db):
            n, cpu, _ = av.get((db, kind, name), (0, 0.0, 0.0))
            return f"{n} ({cpu:.1f})"

        vacuum_s = sum(v[1] for k, v in av.items() if k[0] == run.db)
        logged += vacuum_s
        third = max(1, len(run.claim) // 3)
        rows.append(
            [
                run.config,
                f"{run.items / run.wall:.0f}",
                _pp(run.claim),
                _pp(run.claim[-third:]),
                _pp(run.unfloored),
                _pp(run.finish),
                _pp(run.finish[-third:]),
                f"{(run.backend_s + vacuum_s) * 1000 / run.items:.2f}",
                f"{run.backend_s * 1000 / run.items:.2f}",
                f"{vacuum_s * 1000 / run.items:.2f}",
                f"{max(t['batches_item']['dead'] for t in run.snapshots):,} / {it['dead']:,}",
                f"{_mb(it['heap'])} + {_mb(it['idx'])}",
                f"{it['available_idx'] / 1024:.0f}",
                f"{cell('vacuum', 'batches_item')}, {cell('analyze', 'batches_item')}",
                f"{_mb(us['heap'])} + {_mb(us['idx'])}",
                f"{100 * us['visible'] / max(us['pages'], 1):.0f}%",
                f"{cell('vacuum', 'usage_usageevent')}, {cell('analyze', 'usage_usageevent')}",
            ]
        )
    print(
        table(
            [
                "config",
                "items/s",
                "claim p50/p99 ms",
                "last third",
                "claim w/o floor",
                "finish p50/p99 ms",
                "last third",
                "pg CPU ms/item",
                "of it backend",
                "autovacuum",
                "item dead max / end",
                "item heap+idx MB",
                "item_available kB",
                "item autovacuums, autoanalyzes (CPU s)",
                "usage heap+idx MB",
                "usage all-visible",
                "usage autovacuums, autoanalyzes (CPU s)",
            ],
            rows,
        )
    )
    items = sum(r.items for r in runs)
    backends = sum(r.backend_s for r in runs)
    print(
        f"pg CPU ms/item = the drain's backend + every autovacuum/autoanalyze of that configuration's database "
        f"(from the server log, all tables). The whole cluster over the rounds: {cluster_s * 1000 / items:.2f} "
        f"ms/item, of which {(cluster_s - backends - logged) * 1000 / items:.2f} in neither (checkpointer, "
        f"WAL writer, heartbeat and admin sessions, autovacuum launcher)."
    )
    relay = ", ".join(f"{r.config} {r.relay_s * 1000 / r.items:.2f}" for r in runs)
    print(f"this process's CPU ms/item (store_native, run_item, the fake call's client side): {relay}")


def run() -> None:
    unknown = set(CONFIGS) - set(TABLE_SETTINGS)
    if unknown:
        raise SystemExit(f"BENCH_VACUUM_CONFIGS: unknown {sorted(unknown)} (known: {sorted(TABLE_SETTINGS)})")
    harness._install_signal_handlers()  # SIGTERM/SIGHUP raise SystemExit: the cluster is removed
    harness.log(f"machine: {machine()}; {load()}")
    with Cluster() as cluster:
        os.environ["BENCH_PG_URL"] = cluster.url
        with harness.Stack(db_name=DB, redis_db=REDIS_DB) as stack:
            upstream = stack.start_upstream(0)
            principals = _prepare(cluster, stack, upstream.url)
            runs = [_start(cluster, config) for config in CONFIGS]
            log_from, cpu0, t0 = cluster.log_offset(), cluster.cpu_seconds(), time.perf_counter()
            for r in range(ROUNDS):
                # Every configuration's round r under the same load of the machine; who goes first rotates.
                for i in range(len(runs)):
                    _round(runs[(r + i) % len(runs)], r, principals[r % len(principals)])
            cluster_s = cluster.cpu_seconds() - cpu0
            harness.log(f"rounds done in {time.perf_counter() - t0:.0f} s; {load()}")
            av = cluster.autovacuum_log(log_from)
            for run_ in runs:
                _finish(run_)
            _report(runs, av, cluster_s)


if __name__ == "__main__":
    run()
