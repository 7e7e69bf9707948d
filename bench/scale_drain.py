"""A real drain at size: batches from 5 tenants drained by item-worker replicas — real Celery
processes, as compose starts them — through PgBouncer in transaction mode, with the s3 payload store
(moto's server on loopback), on top of a small and then a large history of rows.

    make bench-scale    (runs bench/scale.py, then this)

Knobs: BENCH_SCALE_HISTORIES [2000,1000000] rows of history before each drain (written by SQL as in
bench/scale.py), BENCH_SCALE_DRAIN_BATCHES [20] × BENCH_SCALE_DRAIN_RECORDS [500] records drained by
BENCH_SCALE_WORKERS [4] item-worker replicas (one control worker and beat beside them), fake provider at
BENCH_SCALE_LATENCY_MS [0]. Prints, per history: records, wall time, CPU per record of the workers, of
PostgreSQL, of PgBouncer and of the S3 server, and the /metrics scrape (median of 5) after the drain.
"""

import os
import re
import statistics
import subprocess
import time
from pathlib import Path

from bench import harness
from bench.measure import CpuWatch, machine, pg_backends, process_tree, table

ROOT = Path(__file__).resolve().parent.parent
HISTORIES = [int(s) for s in (os.environ.get("BENCH_SCALE_HISTORIES") or "2000,1000000").split(",")]
BATCHES = harness.env_int("BENCH_SCALE_DRAIN_BATCHES", 20)
RECORDS = harness.env_int("BENCH_SCALE_DRAIN_RECORDS", 500)
WORKERS = harness.env_int("BENCH_SCALE_WORKERS", 4)
LATENCY_MS = harness.env_float("BENCH_SCALE_LATENCY_MS", 0.0)
S3_PORT = harness.env_int("BENCH_SCALE_S3_PORT", 9391)
BUCKET = "relay-bench-scale"


def pgbouncer(directory: str | None = None) -> tuple[int, int]:
    """(port, pid) of the throwaway PgBouncer (scripts/pgbouncer.sh starts it unless it runs). `directory`:
    its PGBOUNCER_DIR, for a PgBouncer of one's own (default: $PGBOUNCER_DIR, else the tests' shared one)."""
    env = {**os.environ, "PGBOUNCER_DIR": directory} if directory else None
    out = subprocess.run(["bash", "scripts/pgbouncer.sh", "start"], cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"PgBouncer did not start: {out.stderr[-2000:]}")
    port = int(re.search(r"PGBOUNCER_PORT=(\d+)", out.stdout).group(1))
    directory = directory or os.environ.get("PGBOUNCER_DIR", "/tmp/relay-pgbouncer")
    pid = int(Path(directory, "pgbouncer.pid").read_text().strip())
    return port, pid


def _moto() -> tuple[str, int]:
    out = subprocess.run(["bash", "scripts/s3.sh", str(S3_PORT)], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the S3 server did not start: {out.stderr[-2000:]}")
    pid = int(Path(f"/tmp/relay-s3-moto-{S3_PORT}.pid").read_text().strip())
    return f"http://127.0.0.1:{S3_PORT}", pid


class PooledStack(harness.Stack):
    """The benchmark stack behind PgBouncer in transaction mode (docs/pooler.md): every relay process on
    the pooler with DATABASE_POOLER=transaction, migrations over DATABASE_DIRECT_URL."""

    pooler_port: int = 0

    def app_env(self) -> dict:
        env = super().app_env()
        env.update(
            DATABASE_URL=f"{self.pg_base.rsplit(':', 1)[0]}:{self.pooler_port}/{self.db_name}",
            DATABASE_POOLER="transaction",
            DATABASE_DIRECT_URL=self.database_url,
        )
        return env

    def fresh(self) -> None:
        harness.claim_redis(self.redis_url)
        self.redis_claimed = True
        harness.drop_database(self.pg_base, self.db_name)
        harness.create_database(self.pg_base, self.db_name)
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", "--database", "direct", "--noinput", verbosity=0)


class _Stack(PooledStack):
    """The benchmark stack with the production settings of a many-host deployment: PgBouncer, s3."""

    s3_endpoint: str = ""

    def app_env(self) -> dict:
        env = super().app_env()
        env.update(
            RELAY_BATCH_PAYLOAD_STORE="s3",
            RELAY_S3_BUCKET=BUCKET,
            RELAY_S3_ENDPOINT_URL=self.s3_endpoint,
            RELAY_S3_PREFIX=f"{self.db_name}/",
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench-secret",
        )
        return env


def _bucket(endpoint: str) -> None:
    import boto3

    s3 = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench", aws_secret_access_key="x"
    )
    if BUCKET not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        s3.create_bucket(Bucket=BUCKET)


def _one(history: int, pooler: tuple[int, int], s3: tuple[str, int]) -> list:
    stack = _Stack(db_name=harness.db_name("_scale_drain"), redis_db=harness.env_int("BENCH_REDIS_DB_SCALE_DRAIN", 7))
    stack.pooler_port, stack.s3_endpoint = pooler[0], s3[0]
    with stack:
        stack.fresh()
        from django.conf import settings
        from django.test import Client

        from batches.lifecycle import claim as claims
        from batches.models import Batch
        from batches.worker import execute
        from bench import scale

        upstream = stack.start_upstream(LATENCY_MS)
        principals = scale._tenants(upstream.url)
        templates = [scale._submit(principals[i % scale.TENANTS], 10) for i in range(scale.BATCHES)]
        while (item := claims.claim("bench-scale:seed:1")) is not None:
            execute.run_item(item)
        scale._grow(principals, templates, history)
        workers = [stack.start_worker(f"w{i}", beat=i == 0) for i in range(WORKERS)]
        rest = [p for p in stack.procs if p.name.startswith(("control-", "beat-"))]
        groups = {
            "workers": lambda: [q for w in workers for q in process_tree(w.popen.pid)],
            "control+beat": lambda: [q for p in rest for q in process_tree(p.popen.pid)],
            "postgres": lambda: pg_backends(stack.db_name),
            "pgbouncer": lambda: [pooler[1]],
            "s3": lambda: [s3[1]],
        }
        harness.log(f"history {history:,}: draining {BATCHES} x {RECORDS} records on {WORKERS} workers")
        with CpuWatch(groups) as cpu:
            ids = [scale._submit(principals[i % scale.TENANTS], RECORDS).pk for i in range(BATCHES)]
            deadline = time.monotonic() + 3600
            while Batch.objects.filter(pk__in=ids, status="completed").count() < len(ids):
                if time.monotonic() > deadline:
                    raise RuntimeError("the drain did not finish within an hour")
                time.sleep(1)
        n = BATCHES * RECORDS
        per = cpu.per_unit_ms(n)
        client = Client()
        token = {"HTTP_AUTHORIZATION": f"Bearer {settings.RELAY_ADMIN_TOKEN}"}
        scrapes = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert client.get("/metrics", **token).status_code == 200
            scrapes.append((time.perf_counter() - t0) * 1000)
        harness.log(cpu.describe(n, "record"))
        return [
            f"{history:,}",
            f"{n:,}",
            f"{cpu.elapsed:.0f}",
            f"{n / cpu.elapsed:.0f}",
            f"{per['workers']:.2f}",
            f"{per['control+beat']:.2f}",
            f"{per['postgres']:.2f}",
            f"{per['pgbouncer']:.2f}",
            f"{per['s3']:.2f}",
            f"{sum(per.values()):.2f}",
            f"{statistics.median(scrapes):.0f}",
        ]


def run() -> None:
    pooler, s3 = pgbouncer(), _moto()
    _bucket(s3[0])
    rows = [_one(h, pooler, s3) for h in HISTORIES]
    print()
    print(f"machine: {machine()}")
    print(
        f"{BATCHES} batches x {RECORDS} records from 5 tenants, {WORKERS} item workers, through PgBouncer "
        f"(transaction mode), s3 store on moto, fake provider at {LATENCY_MS:.0f} ms"
    )
    print(
        table(
            [
                "history rows",
                "records",
                "wall s",
                "records/s",
                "workers ms/rec",
                "control ms/rec",
                "pg ms/rec",
                "pgbouncer ms/rec",
                "s3 ms/rec",
                "total ms/rec",
                "/metrics ms",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    run()
