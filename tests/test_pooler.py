"""PgBouncer in transaction mode between the relay's processes and PostgreSQL (docs/pooler.md).

A throwaway PgBouncer (scripts/pgbouncer.sh: Debian's 1.18, `pool_mode = transaction`, no
`ignore_startup_parameters`) stands in front of the test database; worker fleets reach it told so
(DATABASE_POOLER=transaction). Between them and PgBouncer, a relay of PostgreSQL's wire protocol keeps
every query string they send, so the tests can say what crossed: no PREPARE, no session SET, no
advisory lock, no LISTEN, no connect-time `options`. The test process itself (the live server and
the assertions) talks to PostgreSQL directly.
"""

import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import uuid
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import openai
import psycopg2
import pytest
import requests

from batches.models import Batch, Item
from devkit.upstream import Reply
from tests.workers import wait_for
from usage.models import UsageEvent

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent
CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "pooled"}]}


# --- PgBouncer -------------------------------------------------------------------------------------


class Bouncer:
    def __init__(self, port: int, database: str):
        self.port, self.database = port, database

    def admin(self, command: str) -> list[dict]:
        """A command of PgBouncer's admin console (SHOW …, KILL …), its rows as dicts."""
        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="pgbouncer")
        conn.autocommit = True  # the console takes simple queries only, no BEGIN
        try:
            with conn.cursor() as cur:
                cur.execute(command)
                if cur.description is None:
                    return []
                names = [col[0] for col in cur.description]
                return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        finally:
            conn.close()


def _script(action: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "pgbouncer.sh"), action], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="session")
def pgbouncer(django_db_setup):
    from django.db import connection

    was_running = _script("status").returncode == 0
    started = _script("start")
    if started.returncode == 3:  # the script's "cannot install" (no package, not root)
        pytest.skip(f"PgBouncer is not available here: {started.stderr.strip()}")
    assert started.returncode == 0, started.stderr
    port = int(started.stdout.strip().rsplit("=", 1)[1])
    bouncer = Bouncer(port, connection.settings_dict["NAME"])
    yield bouncer
    # Its server connections to the test database go first, else the database cannot be dropped.
    bouncer.admin(f"KILL {bouncer.database}")
    bouncer.admin(f"RESUME {bouncer.database}")
    if not was_running and not os.environ.get("PYTEST_XDIST_WORKER"):
        _script("stop")


def _with_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{parts.netloc.rsplit(':', 1)[0]}:{port}"))


def direct_url(db_url: str) -> str:
    """The test database on PostgreSQL itself: `db_url`, or, when the whole run goes through the pooler
    (DATABASE_DIRECT_URL set), the same database at the direct URL's address."""
    direct = os.environ.get("DATABASE_DIRECT_URL")
    if not direct:
        return db_url
    return urlunsplit(urlsplit(db_url)._replace(netloc=urlsplit(direct).netloc))


def pooled_env(db_url: str, port: int) -> dict:
    """What a relay process behind the pooler is given (compose.yaml's worker, control and beat)."""
    return {
        "DATABASE_URL": _with_port(db_url, port),
        "DATABASE_POOLER": "transaction",
        "DATABASE_DIRECT_URL": direct_url(db_url),
    }


# --- a query log: PostgreSQL's wire protocol relayed, the frontend's messages read -----------------

_SSL_REQUEST, _GSS_REQUEST, _PROTOCOL_3 = 80877103, 80877104, 196608


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


class QueryLog:
    """A TCP relay to PgBouncer that keeps the startup parameters, the simple-protocol query strings
    ('Q') and any extended-protocol Parse ('P') of every client connection."""

    def __init__(self, port: int):
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.startups: list[dict] = []
        self.queries: list[str] = []
        self.parses: list[bytes] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._backend, args=(server, client), daemon=True).start()
            threading.Thread(target=self._frontend, args=(client, server), daemon=True).start()

    @staticmethod
    def _backend(server: socket.socket, client: socket.socket) -> None:
        try:
            while chunk := server.recv(65536):
                client.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (client, server):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _frontend(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while True:  # untyped messages: SSL / GSS encryption requests (answered 'N'), then the startup
                head = _exactly(client, 8)
                length, code = struct.unpack("!ii", head)
                body = _exactly(client, length - 8)
                server.sendall(head + body)
                if code not in (_SSL_REQUEST, _GSS_REQUEST):
                    break
            if code == _PROTOCOL_3:
                fields = body.split(b"\0")
                with self.lock:
                    self.startups.append(dict(zip(fields[0:-2:2], fields[1:-2:2], strict=True)))
            while True:
                kind = _exactly(client, 1)
                size = _exactly(client, 4)
                body = _exactly(client, struct.unpack("!i", size)[0] - 4)
                server.sendall(kind + size + body)
                if kind == b"Q":
                    with self.lock:
                        self.queries.append(body[:-1].decode("utf-8", "replace"))
                elif kind == b"P":
                    with self.lock:
                        self.parses.append(body)
        except (OSError, EOFError, struct.error):
            pass
        finally:
            for s in (client, server):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture
def query_log(pgbouncer):
    log = QueryLog(pgbouncer.port)
    yield log
    log.close()


# Session state a transaction pooler does not carry, at the start of a statement of a query string.
_SESSION_STATEMENTS = re.compile(
    r"(?:^|;)\s*(PREPARE|EXECUTE|DEALLOCATE|LISTEN|UNLISTEN|DISCARD|DECLARE|RESET|LOAD"
    r"|CREATE\s+(?:GLOBAL\s+|LOCAL\s+)?TEMP(?:ORARY)?)\b",
    re.IGNORECASE,
)
_SET = re.compile(r"(?:^|;)\s*SET\s+(?!LOCAL\b)(?:SESSION\s+)?(\w+)", re.IGNORECASE)
# What PgBouncer itself carries from one server connection to the next (its tracked parameters: Django
# sets the time zone once per connection), and what lasts one transaction only.
_CARRIED = {"time", "timezone", "client_encoding", "datestyle", "standard_conforming_strings", "application_name"}
_TRANSACTION_SCOPED = {"constraints", "transaction"}
_SET_CONFIG = re.compile(r"set_config\(\s*'(\w+)'\s*,[^,]*,\s*(\w+)\s*\)", re.IGNORECASE)


def _rows(query: str, params: list) -> list[tuple]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(query, params)
        return cursor.fetchall()


def session_state(queries: list[str]) -> list[str]:
    """What in `queries` would need a session: named statements, session SETs, advisory locks, …"""
    found = []
    for q in queries:
        found += [m.group(1) for m in _SESSION_STATEMENTS.finditer(q)]
        found += [
            f"SET {m.group(1)}" for m in _SET.finditer(q) if m.group(1).lower() not in _CARRIED | _TRANSACTION_SCOPED
        ]
        found += [
            f"set_config {m.group(1)}"
            for m in _SET_CONFIG.finditer(q)
            if m.group(1).lower() not in _CARRIED and m.group(2).lower() == "false"
        ]
        if re.search(r"pg_(try_)?advisory_(?!xact)", q):
            found.append(q[:200])
    return found


def test_the_session_state_check_sees_what_it_looks_for():
    """The check below is not vacuous: it finds each kind of session state, and passes what is fine."""
    bad = [
        "PREPARE relay_claim_fairest(text) AS SELECT 1",
        "EXECUTE relay_claim_fairest('x')",
        "SET plan_cache_mode = force_generic_plan",
        "SET SESSION statement_timeout = 5",
        "SELECT pg_advisory_lock(1)",
        "LISTEN relay",
        "SET LOCAL jit = off; SET enable_sort = off; SELECT 1",
        "CREATE TEMP TABLE t (a int)",
        "SELECT set_config('jit', 'off', false)",
        "SELECT set_config('plan_cache_mode', 'force_generic_plan', FALSE)",
    ]
    assert [bool(session_state([q])) for q in bad] == [True] * len(bad)
    fine = [
        "SET LOCAL statement_timeout = 60000; SET LOCAL enable_sort = off; SELECT 1",
        "SET TIME ZONE 'UTC'",
        "SET CONSTRAINTS ALL DEFERRED",
        "SELECT set_config('synchronous_commit', 'off', true)",
        "SELECT set_config('TimeZone', 'UTC', false)",
        "SELECT pg_advisory_xact_lock(1)",
        "UPDATE t SET a = 1 WHERE b = 'SET x'",
    ]
    assert session_state(fine) == []


# --- through the pooler ------------------------------------------------------------------------------


def submit_native(live_server, key, n: int) -> str:
    resp = requests.post(
        live_server.url + "/v1/batches",
        json={"shape": "openai", "requests": [CHAT] * n},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def assert_every_item_done_once(batch_id, n):
    batch = Batch.objects.get(pk=batch_id)
    assert batch.completed_at is not None
    assert Counter(Item.objects.filter(batch_id=batch_id).values_list("state", flat=True)) == {"completed": n}
    # One usage event per item, never two, whatever was retried.
    assert UsageEvent.objects.filter(batch_id=batch_id).count() == n
    assert set(UsageEvent.objects.filter(batch_id=batch_id).values_list("request_id", flat=True)) == {
        str(i) for i in Item.objects.filter(batch_id=batch_id).values_list("id", flat=True)
    }


def test_batches_drain_through_the_pooler_keeping_no_session_state(
    live_server, catalog, fake, workers, db_url, pgbouncer, query_log
):
    env = pooled_env(db_url, query_log.port)
    # Claiming ahead from the 5th item on: finishes go in front of claims (one query string) too.
    workers("pooled", extra_env={**env, "RELAY_BATCH_CLAIM_AHEAD_MIN_LEFT": "4"})
    native = submit_native(live_server, catalog.key, 150)
    records = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": CHAT} for i in range(30)]
    with openai.OpenAI(base_url=live_server.url + "/v1", api_key=catalog.key) as sdk:
        uploaded = sdk.files.create(
            file=("in.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode()), purpose="batch"
        )
        created = sdk.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_for(lambda: Batch.objects.get(pk=native).completed_at, 90, what="the native batch to finish")
        done = wait_for(
            lambda: (b := sdk.batches.retrieve(created.id)).status in ("completed", "failed") and b,
            90,
            what="the OpenAI batch to finish",
        )
        assert done.status == "completed" and done.request_counts.completed == 30, done
        lines = sdk.files.content(done.output_file_id).text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in lines) == sorted(r["custom_id"] for r in records)
    assert_every_item_done_once(native, 150)
    openai_batch = uuid.UUID(hex=created.id.removeprefix("batch_"))
    assert UsageEvent.objects.filter(batch_id=str(openai_batch)).count() == 30

    with query_log.lock:
        queries, startups, parses = list(query_log.queries), list(query_log.startups), list(query_log.parses)
    # Every process went through the log (a connection each at least), none asked for `options`, and
    # nothing used the extended protocol's named statements.
    assert startups and all(b"options" not in s for s in startups), startups
    assert parses == []
    assert session_state(queries) == []
    # The claim and the finish are calls of their PL/pgSQL functions (batches/lifecycle/sql.py), created
    # in the database by whichever process needed them first, the claim's planned under its own settings.
    functions = dict(
        _rows(
            "SELECT proname, array_to_string(proconfig, ',') FROM pg_proc WHERE proname LIKE 'relay_fn_%%'"
            " AND prosrc LIKE %s",
            ["%WITH pick AS MATERIALIZED%"],
        )
    )
    finish_functions = {
        n for n, _ in _rows("SELECT proname, 1 FROM pg_proc WHERE prosrc LIKE %s", ["%fin AS (UPDATE%"])
    }
    assert len(functions) == 2 and finish_functions, (functions, finish_functions)
    assert all(c == "enable_sort=off,jit=off,plan_cache_mode=force_generic_plan" for c in functions.values())
    calls = [q for q in queries if "CREATE FUNCTION" not in q]
    claims = [q for q in calls if any(f"FROM {n}(" in q for n in functions)]
    finishes = [q for q in calls if any(f"FROM {n}(" in q for n in finish_functions)]
    assert len(claims) >= 180 and len(finishes) >= 180
    # The timeouts go with every claim, in its own transaction; the planner settings are the function's.
    assert all(q.startswith("SET LOCAL statement_timeout = ") for q in claims)
    assert not any("enable_sort" in q for q in claims)
    assert any(q in finishes for q in claims)  # a finish sent in front of a claim
    # Control work (validation, finalization, sweeps) went through too, each transaction with its timeouts.
    assert any("SET LOCAL idle_in_transaction_session_timeout = 600000" in q for q in queries)
    # PgBouncer saw these transactions, in transaction mode.
    pools = [p for p in pgbouncer.admin("SHOW POOLS") if p["database"] == pgbouncer.database]
    assert pools and all(p["pool_mode"] == "transaction" for p in pools)
    stats = [s for s in pgbouncer.admin("SHOW STATS") if s["database"] == pgbouncer.database]
    assert stats and stats[0]["total_xact_count"] >= len(claims)


def test_a_worker_killed_mid_batch_behind_the_pooler_loses_nothing_and_runs_nothing_twice(
    live_server, catalog, fake, workers, db_url, pgbouncer
):
    n = 40
    env = pooled_env(db_url, pgbouncer.port)
    fake.script("*", [Reply(delay=0.4) for _ in range(200)])
    first = workers("doomed", extra_env=env)
    batch_id = submit_native(live_server, catalog.key, n)
    wait_for(lambda: Item.objects.filter(batch_id=batch_id, state="completed").count() >= 8, 30, what="progress")
    wait_for(lambda: Item.objects.filter(batch_id=batch_id, state="running").count() >= 4, 10, what="items in flight")
    completed_before = set(Item.objects.filter(batch_id=batch_id, state="completed").values_list("id", flat=True))
    first.kill()
    assert Item.objects.filter(batch_id=batch_id, state="running").count() >= 1  # the kill interrupted work
    workers("rescuer", extra_env=env)
    wait_for(lambda: Batch.objects.get(pk=batch_id).completed_at, 60, what="the batch to finish after the kill")
    assert_every_item_done_once(batch_id, n)
    assert not Item.objects.filter(id__in=completed_before).exclude(attempt=1).exists()
    assert Item.objects.filter(batch_id=batch_id, attempt=2).count() >= 1


# --- the connection behind the pooler: timeouts as SET LOCAL ---------------------------------------


def pooled_connection(pgbouncer, **timeouts):
    """A connection of the relay's backend to PgBouncer, configured as settings.py does it for
    DATABASE_POOLER=transaction (no connect-time options; timeouts per transaction)."""
    from django.db import connection

    from core.db.postgresql.base import DatabaseWrapper

    options = {k: v for k, v in connection.settings_dict["OPTIONS"].items() if k != "options"}
    values = {"statement_timeout": 60_000, "lock_timeout": 10_000, "idle_in_transaction_session_timeout": 30_000}
    return DatabaseWrapper(
        {
            **connection.settings_dict,
            "PORT": pgbouncer.port,
            "OPTIONS": options,
            "POOLER": "transaction",
            "TIMEOUTS_PER_TRANSACTION": {**values, **timeouts},
        },
        alias="pooled",
    )


def _settings(db) -> tuple:
    with db.cursor() as cur:
        cur.execute(
            "SELECT current_setting('statement_timeout'), current_setting('lock_timeout'),"
            " current_setting('idle_in_transaction_session_timeout')"
        )
        return cur.fetchone()


def test_timeouts_hold_in_every_transaction_and_every_autocommit_statement(pgbouncer):
    from django.db import OperationalError

    db = pooled_connection(pgbouncer, statement_timeout=300)
    try:
        assert _settings(db) == ("300ms", "10s", "30s")  # an autocommit statement: its own transaction
        for _ in range(2):  # and each transaction anew, whichever server connection it gets
            db.set_autocommit(False)
            assert _settings(db) == ("300ms", "10s", "30s")
            with db.cursor() as cur:
                cur.execute("SET LOCAL statement_timeout = 5000")  # the transaction's own choice wins
            assert _settings(db)[0] == "5s"
            db.commit()
            db.set_autocommit(True)
        for in_transaction in (False, True):
            db.set_autocommit(not in_transaction)
            with pytest.raises(OperationalError, match="statement timeout"), db.cursor() as cur:
                cur.execute("SELECT pg_sleep(2)")
            if in_transaction:
                db.rollback()
            db.set_autocommit(True)
        # What PostgreSQL refuses in a transaction block goes alone.
        with db.cursor() as cur:
            cur.execute("VACUUM batches_batch")
    finally:
        db.close()
    # Nothing lasted beyond its transaction: a plain connection through PgBouncer sees the defaults.
    conn = psycopg2.connect(host="127.0.0.1", port=pgbouncer.port, user="postgres", dbname=pgbouncer.database)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW statement_timeout")
            assert cur.fetchone() == ("0",)
    finally:
        conn.close()


def test_pgbouncer_refuses_the_direct_settings_and_migrate_takes_the_direct_alias(pgbouncer, db_url):
    env = {
        **os.environ,
        **pooled_env(db_url, pgbouncer.port),
        "DJANGO_SETTINGS_MODULE": "relay.settings",
    }
    # Without DATABASE_POOLER the timeouts go as connect-time options, which PgBouncer refuses.
    code = "import django; django.setup(); from django.db import connection; connection.ensure_connection()"
    refused = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "DATABASE_POOLER": ""},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "unsupported startup parameter: options" in refused.stderr
    told = subprocess.run(
        [sys.executable, "-c", code + "; print('connected')"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert told.returncode == 0 and "connected" in told.stdout, told.stderr
    # A pooler with session timeouts is a contradiction, refused at start.
    both = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        env={**env, "RELAY_DB_TIMEOUTS": "session"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert both.returncode != 0 and "RELAY_DB_TIMEOUTS=session" in both.stderr
    # `migrate --database direct`: the direct alias, a session of its own (nothing left to apply here).
    migrate = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--database", "direct", "--check"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert migrate.returncode == 0, migrate.stdout + migrate.stderr
