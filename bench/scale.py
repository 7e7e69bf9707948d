"""What the claim, the finish, the sweeper, /metrics and the admin cost as the tables grow.

    make bench-scale                  (BENCH_SCALE_SIZES=2000,1000000 by default)

For each size the items and usage tables are grown to that many rows of history (finished items of 20
batches from 5 tenants, one usage event each, written by SQL from real rows the relay stored, so every
column and index is as the relay writes it), the statistics are refreshed (ANALYZE, as autovacuum
would), and then, on top of that history:
- a fresh native batch of BENCH_SCALE_DRAIN items is drained in this process against the fake provider
  (0 ms): each claim and each run (the call and the finish) is timed, and the CPU per item counted is
  this process's plus its PostgreSQL backend's (read from /proc: both run on this machine);
- the sweeper (`batches.sweeper.sweep`) is timed three times;
- /metrics: the usage rollup first catches up on the history (timed once: a one-off at upgrade), then
  five scrapes are timed;
- the admin changelists of items, batches and usage events are timed (a superuser, three loads each);
- the admin's landing page, the operator's console (relay/console.py), is timed cold (the first load after
  LANDING_NEW usage events were written: it counts them into the rollups, then reads) and warm (nothing new),
  three loads each;
- table and index sizes per row are read from PostgreSQL.

It measures the cost of size, not of a many-host drain: the history is written by SQL, not by 20 × 50,000
records drained by four replicas through PgBouncer (bench/README.md says what was run).
"""

import json
import os
import statistics
import subprocess
import sys
import time
import uuid

from bench import harness
from bench.measure import cpu_seconds, machine, percentile, table

SIZES = [int(s) for s in (os.environ.get("BENCH_SCALE_SIZES") or "2000,1000000").split(",")]
DRAIN = harness.env_int("BENCH_SCALE_DRAIN", 1000)
BATCHES = 20
TENANTS = 5


def _tenants(upstream_url: str) -> list:
    """Five service accounts on the bench catalog's policy, each with a relay key; their principals."""
    from bench.catalog import seed_catalog
    from core import auth
    from core.models import Project, ServiceAccount
    from core.services import create_relay_key
    from policies.models import Policy

    seed_catalog(upstream_url)
    project = Project.objects.get(name="bench")
    policy = Policy.objects.get(name="bench")
    principals = []
    for t in range(TENANTS):
        sa = ServiceAccount.objects.create(project=project, name=f"tenant-{t}", policy=policy)
        _, plaintext = create_relay_key(name=f"tenant-{t}", service_account=sa)
        principals.append(auth.principal_for_key(plaintext))
    return principals


def _submit(principal, n: int):
    import io

    from batches import ingest
    from batches.surfaces.native import submit
    from bench.catalog import chat_body

    body = {"shape": "openai", "requests": [chat_body(i) for i in range(n)]}
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**9, 1_000_000) as submission:
        return submit.store_native(principal, submission)


def _grow(principals, templates: list, target: int) -> None:
    """Grow the items and usage tables to `target` rows each: copies of the template batches' finished
    items (new ids, idx past the template's) and one usage event per copy."""
    from django.db import connection

    from batches.models import Item
    from usage.models import UsageEvent

    have = Item.objects.count()
    if have >= target:
        return
    per_batch = -(-(target - have) // len(templates))
    with connection.cursor() as cur:
        for b in templates:
            template = Item.objects.filter(batch=b).order_by("idx").first()
            base = Item.objects.filter(batch=b).order_by("-idx").values_list("idx", flat=True).first() + 1
            cur.execute(
                """
                INSERT INTO batches_item (id, batch_id, idx, state, attempt, retries, max_attempts, not_before,
                    lease_owner, lease_expires_at, started_at, finished_at, input_ref, result_ref, status_code,
                    error, error_body, custom_id, error_code, provider_job_id, placement)
                SELECT gen_random_uuid(), batch_id, %s + g, 'completed', 1, 0, max_attempts, NULL, '', NULL,
                    now() - interval '1 hour', now() - interval '1 hour' + (g %% 7000) * interval '1 ms',
                    input_ref, input_ref, 200, '', '', '', '', NULL, ''
                FROM batches_item t, generate_series(0, %s - 1) g WHERE t.id = %s
                """,
                [base, per_batch, template.id],
            )
            cur.execute(
                """
                INSERT INTO usage_usageevent (request_id, source, ts, status, duration_ms, attempts, error_kind,
                    error_message, credential_kind, credential_id, principal_kind, principal_id, project_id,
                    team_id, policy_id, host_key_id, project, team, policy, model, provider, host, batch_id,
                    input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, cost_nano_usd,
                    billed_cost_nano_usd, executed_by, usage_estimated)
                SELECT i.id::text, 'batch', now() - (i.idx %% 86400) * interval '1 s',
                    CASE WHEN i.idx %% 50 = 0 THEN 500 ELSE 200 END, 20 + i.idx %% 3000, 1, '', '', 'key', '1',
                    'serviceaccount', %s, NULL, NULL, NULL, NULL, 'bench', 'bench', 'bench', 'gpt-4o', 'openai',
                    'openai', %s, 12, 40, 0, 0, 430000, 215000, 'relay', false
                FROM batches_item i WHERE i.batch_id = %s AND i.idx >= %s
                """,
                [principals[hash(b.id) % len(principals)].principal_id, str(b.id), b.id, base],
            )
        # The grown batches ended with their copies too: their counts on the row are what the relay would have
        # kept when their last item became final (batches.lifecycle.stop.keep_ended_counts).
        cur.execute(
            """
            UPDATE batches_batch b SET ended_counts = (SELECT jsonb_object_agg(state, n) FROM (SELECT state,
                COUNT(*) AS n FROM batches_item WHERE batch_id = b.id GROUP BY state) AS by_state)
            WHERE b.ended_counts IS NOT NULL AND b.id = ANY(%s)
            """,
            [[b.id for b in templates]],
        )
        cur.execute("ANALYZE batches_item")
        cur.execute("ANALYZE usage_usageevent")
        cur.execute("ANALYZE batches_batch")
    harness.log(f"grown to {Item.objects.count():,} items, {UsageEvent.objects.count():,} usage events")


def _drain(principal, pg_pid: int) -> dict:
    from batches.lifecycle import claim as claims
    from batches.worker import execute

    batch = _submit(principal, DRAIN)
    claim_ms, run_ms = [], []
    cpu0, pg0 = time.process_time(), cpu_seconds(pg_pid)
    n = 0
    while True:
        t0 = time.perf_counter()
        item = claims.claim("bench-scale:1:1")
        t1 = time.perf_counter()
        if item is None:
            break
        execute.run_item(item)
        t2 = time.perf_counter()
        claim_ms.append((t1 - t0) * 1000)
        run_ms.append((t2 - t1) * 1000)
        n += 1
    cpu = time.process_time() - cpu0
    pg = cpu_seconds(pg_pid) - pg0
    batch.refresh_from_db()
    return {
        "items": n,
        "status": batch.status,
        "cpu_ms_per_item": (cpu + pg) * 1000 / max(n, 1),
        "relay_cpu_ms": cpu * 1000 / max(n, 1),
        "pg_cpu_ms": pg * 1000 / max(n, 1),
        "claim_p50": percentile(claim_ms, 50),
        "claim_p99": percentile(claim_ms, 99),
        "run_p50": percentile(run_ms, 50),
        "run_p99": percentile(run_ms, 99),
    }


def _timed(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


LANDING_NEW = 1_000


def _landing_ms(client) -> tuple[float, float]:
    """The landing page after LANDING_NEW new usage events (each load counts them into the usage and spend
    rollups first, as after a minute of traffic), then with nothing new. The spend chart reads the spend rollup
    either way: no load groups the month's usage events."""
    from usage.models import UsageEvent

    def cold():
        UsageEvent.objects.bulk_create(
            UsageEvent(request_id=uuid.uuid4().hex, source="live", project="bench", model="gpt-4o", cost_nano_usd=430)
            for _ in range(LANDING_NEW)
        )
        t0 = time.perf_counter()
        assert client.get("/admin/").status_code == 200
        return time.perf_counter() - t0

    def warm():
        assert client.get("/admin/").status_code == 200

    return statistics.median(cold() * 1000 for _ in range(3)), _timed(warm, 3)


def _sizes() -> dict:
    from django.db import connection

    out = {}
    with connection.cursor() as cur:
        for name in ("batches_item", "usage_usageevent"):
            cur.execute(f"SELECT pg_relation_size('{name}'), pg_indexes_size('{name}'), (SELECT count(*) FROM {name})")
            heap, idx, rows = cur.fetchone()
            out[name] = (heap / max(rows, 1), idx / max(rows, 1), rows)
    return out


COLUMNS = [
    "item rows",
    "CPU ms/item (relay + pg)",
    "claim p50/p99 ms",
    "run+finish p50/p99 ms",
    "sweep ms",
    "/metrics median ms",
    "admin ms",
    "landing ms cold / warm",
    "item B/row heap+idx",
    "usage B/row heap+idx",
]
ADMIN_PAGES = ("/admin/batches/item/", "/admin/batches/batch/", "/admin/usage/usageevent/")


def measure_point(principal, pg_pid: int, client, token: dict) -> tuple[list[str], int]:
    """The measurements at the tables' current size, as cells under COLUMNS, and the usage events' row count:
    the metrics roll-up caught up, a drain claim by claim, the sweeper, /metrics, the admin changelists (median
    of 3), bytes per row. Also bench/scale_million.py's, at 2k and at 1M rows."""
    from batches import sweeper
    from relay import metrics_rollup

    t0 = time.perf_counter()
    metrics_rollup.catch_up()
    catch_up_s = time.perf_counter() - t0
    drain = _drain(principal, pg_pid)
    sweep_ms = _timed(sweeper.sweep, 3)

    def scrape():
        assert client.get("/metrics", **token).status_code == 200

    scrape_ms = _timed(scrape, 5)
    admin_ms = [_timed(lambda p=page: client.get(p), 3) for page in ADMIN_PAGES]
    landing_cold, landing_warm = _landing_ms(client)
    sizes = _sizes()
    cells = [
        f"{sizes['batches_item'][2]:,}",
        f"{drain['cpu_ms_per_item']:.2f} ({drain['relay_cpu_ms']:.2f} + {drain['pg_cpu_ms']:.2f} pg)",
        f"{drain['claim_p50']:.1f} / {drain['claim_p99']:.1f}",
        f"{drain['run_p50']:.1f} / {drain['run_p99']:.1f}",
        f"{sweep_ms:.0f}",
        f"{scrape_ms:.0f} (catch-up {catch_up_s:.1f} s)",
        " / ".join(f"{v:.0f}" for v in admin_ms),
        f"{landing_cold:.0f} / {landing_warm:.0f}",
        f"{sizes['batches_item'][0]:.0f} + {sizes['batches_item'][1]:.0f}",
        f"{sizes['usage_usageevent'][0]:.0f} + {sizes['usage_usageevent'][1]:.0f}",
    ]
    return cells, sizes["usage_usageevent"][2]


def run() -> None:
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client

    upstream = subprocess.Popen(
        [sys.executable, "-m", "bench.fake_upstream", "--delay-ms", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        url = upstream.stdout.readline().split()[-1]
        principals = _tenants(url)
        templates = [_submit(principals[i % TENANTS], 10) for i in range(BATCHES)]
        from batches.lifecycle import claim as claims
        from batches.worker import execute

        while (item := claims.claim("bench-scale:seed:1")) is not None:
            execute.run_item(item)
        admin = get_user_model().objects.create_superuser("scale-admin", "a@example.com", uuid.uuid4().hex)
        client = Client()
        client.force_login(admin)
        token = {"HTTP_AUTHORIZATION": f"Bearer {settings.RELAY_ADMIN_TOKEN}"}
        with connection.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            pg_pid = cur.fetchone()[0]
        rows = []
        for size in SIZES:
            t0 = time.perf_counter()
            _grow(principals, templates, size)
            harness.log(f"history written in {time.perf_counter() - t0:.0f} s")
            rows.append(measure_point(principals[0], pg_pid, client, token)[0])
            harness.log(f"size {size:,}: {rows[-1]}")
        print()
        print(f"machine: {machine()}")
        print(f"drain of {DRAIN} items per size, in-process, fake provider at 0 ms; admin = items / batches / usage")
        print(
            table(
                COLUMNS,
                rows,
            )
        )
    finally:
        upstream.terminate()
        upstream.wait(10)


if __name__ == "__main__":
    run()
