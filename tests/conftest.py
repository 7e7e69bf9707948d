"""Test set-up: real PostgreSQL and Redis (started by scripts/services.sh), a fake
upstream on loopback that speaks the providers' wire formats. Nothing of ours
is mocked."""

import os
import re
import signal
import time

if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
    raise RuntimeError("The suite runs against PostgreSQL: use `make test` (it sets DATABASE_URL).")

import pytest  # noqa: E402

from devkit.upstream import DemoUpstream  # noqa: E402
from tests import factories  # noqa: E402

# --- parallel runs (pytest-xdist) ----------------------------------------------------------------------
# Each xdist worker gets its own test database (pytest-django: test_<name>_gwN), its own Redis database
# (REDIS_URL's number + N: the broker too, so no worker takes another's Celery tasks, and the flush
# before each test empties only its own) and its own payload directory. They are set in the worker's
# environment before it starts, so Django's settings read them, and every process a test starts
# (Celery workers, gunicorn) inherits them. RELAY_TESTS_RUN_DIR is the run's own directory (the locks
# and the groups below), removed at its end.


def _shift_redis_db(url: str, n: int) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    db = int(parts.path.strip("/") or 0) + n
    return urlunsplit(parts._replace(path=f"/{db}"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config, specs):
    import tempfile

    import redis

    base = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        databases = int(redis.Redis.from_url(base).config_get("databases")["databases"])
    except Exception:
        databases = 16
    config._relay_run_dir = tempfile.mkdtemp(prefix="relay-tests-")
    for spec in specs:
        n = int(spec.id.removeprefix("gw"))
        url = _shift_redis_db(base, n)
        if int(url.rsplit("/", 1)[1]) >= databases:
            raise pytest.UsageError(
                f"{len(specs)} xdist workers need Redis databases past {databases - 1}: lower REDIS_URL's number"
            )
        spec.env["REDIS_URL"] = url
        broker = os.environ.get("CELERY_BROKER_URL")
        if broker and broker != base and broker.startswith("redis"):
            spec.env["CELERY_BROKER_URL"] = _shift_redis_db(broker, n)
        else:
            spec.env["CELERY_BROKER_URL"] = url
        if os.environ.get("RELAY_BATCH_PAYLOAD_DIR"):
            spec.env["RELAY_BATCH_PAYLOAD_DIR"] = os.path.join(os.environ["RELAY_BATCH_PAYLOAD_DIR"], spec.id)
            os.makedirs(spec.env["RELAY_BATCH_PAYLOAD_DIR"], exist_ok=True)
        spec.env["RELAY_TESTS_RUN_DIR"] = config._relay_run_dir


def pytest_unconfigure(config):
    import shutil

    if getattr(config, "_relay_run_dir", None):
        shutil.rmtree(config._relay_run_dir, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Passwords made in this process (pytest-django's admin_user, the admin tests' staff users) are hashed
    with MD5, as Django's testing docs advise: the production hasher (PBKDF2, ~0.25 CPU-s a password) cost
    a second of CPU per ~4 admin tests. Nothing here checks a hasher; the processes the suite starts
    (gunicorn, the workers, embedded mode) keep relay.settings' own."""
    from django.conf import settings

    if settings.configured:
        settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


# A test marked `alone` (it restarts PostgreSQL, which every worker uses) runs while no other xdist worker
# runs a test: each test holds a shared lock, an `alone` test the exclusive one (a gate first, so the
# shared holders cannot starve it). The others drop their connections to the restarted server after it.


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import fcntl

    where = os.environ.get("RELAY_TESTS_RUN_DIR")
    if not where or not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    exclusive = alone(item)
    with open(os.path.join(where, "gate"), "a+") as gate, open(os.path.join(where, "tests"), "a+") as tests:
        fcntl.flock(gate, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(tests, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)
        restarts = os.path.join(where, "restarts")
        seen = os.path.getsize(restarts) if os.path.exists(restarts) else 0
        if seen != getattr(item.config, "_relay_restarts_seen", 0):
            from django.db import connections

            connections.close_all()
        item.config._relay_restarts_seen = seen
        try:
            yield
        finally:
            if exclusive:
                with open(restarts, "a") as f:
                    f.write("x")
                item.config._relay_restarts_seen = os.path.getsize(restarts)


def alone(item) -> bool:
    return item.get_closest_marker("alone") is not None


# --- tiers -----------------------------------------------------------------------------------------------
# unit: no process, no database, no Redis (`make test-fast`); integration: the database, Redis, a live
# server or items run in process; e2e: real processes (worker fleets, gunicorn, the launcher). A test's
# tier is its module's or its own marker, else what its fixtures say.

E2E_FIXTURES = {"worker", "workers", "web"}
# Modules that start processes of their own (mkdocs, Chromium, the embedded launcher, gunicorn).
E2E_MODULES = {"test_docs", "test_pages_browser", "test_leaks_web"}
DB_FIXTURES = {"db", "transactional_db", "live_server", "django_db_setup", "catalog", "db_url"}
TIERS = ("unit", "integration", "e2e")


def _module_name(item) -> str:
    module = getattr(item, "module", None)
    return module.__name__.rsplit(".", 1)[-1] if module else ""


def _tier(item) -> str:
    return next((tier for tier in TIERS if item.get_closest_marker(tier)), "unit")


# --- scheduling over xdist workers (`--dist loadgroup`, with the scheduler below) ----------------------
# A module goes to one worker whole (its module-scoped worker fleet, web server or browser starts once),
# except those whose tests each start their own fleet: their tests are spread one by one. The longest
# work goes first, so that the long poles run while the rest fills the other workers. The longest test
# of all goes with a few quick unit tests behind it: xdist hands a worker more work once it has 2 tests
# or fewer pending (and a worker keeps its last test until more comes), so a lone long test would have
# another module queued behind it on its worker. A test that must run alone goes first in that group:
# every other worker waits while it runs, so it had better not wait for the longest test to end.
SPREAD_MODULES = {"test_batch_real_world"}
LONG_POLE = "test_a_rate_limited_provider_is_paced_not_failed"
# Seconds, measured: the tests far longer than their tier's usual (a tier's usual is TIER_SECONDS).
LONG_TESTS = {
    LONG_POLE: 14,  # 100 items at 10/s
    # A fleet killed and Redis flushed twice (tests/test_batch_durability.py).
    "test_a_worker_killed_and_redis_flushed_mid_batch_lose_nothing_and_never_rerun_completed_items": 15,
    "test_work_resumes_promptly_after_a_postgresql_restart": 10,
    # With the retries and the 8-thread check run beside the frozen worker (tests/test_batch_real_world.py).
    "test_a_worker_frozen_inside_its_finishing_transaction_stalls_nothing": 14,
    "test_a_call_with_a_cancel_is_watched_while_the_watchdog_sleeps_to_a_far_deadline": 3,
    # The embedded tier's first test starts its whole stack (SQLite, redis-server, gunicorn, Celery).
    "test_the_stack_keeps_to_its_own_sqlite_redis_and_state_directory": 12,
    # Only where the LiteLLM venv exists (tests/test_litellm_peer.py; CI's clean checkout skips them).
    "test_litellm_sdk_streams_through_the_relay_and_usage_is_recorded": 35,
    "test_litellm_proxy_forwards_files_and_batches_under_either_prefix": 45,
    # Five kinds' provider jobs, one fleet kill and Redis flush (tests/test_cloud_batches_e2e.py).
    "test_every_kinds_job_survives_the_fleet_killed_and_redis_flushed_mid_job": 25,
    "test_a_postgresql_restart_mid_job_loses_nothing": 8,
    # Two tenants through the real process set, one attacking (bench/noisy_core.py).
    "test_no_tenant_can_slow_bench_steer_or_dodge_the_bill_for_another": 30,
}
TIER_SECONDS = {"unit": 0.02, "integration": 0.1, "e2e": 2.0}


POLE_TAIL = 5  # quick tests behind the longest one


def _group(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    if mark:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    module = _module_name(item)
    if getattr(item, "originalname", item.name) == LONG_POLE or alone(item):
        return "long-pole"
    return item.nodeid if module in SPREAD_MODULES or not module else module


@pytest.hookimpl(hookwrapper=True)
def pytest_collection_modifyitems(config, items):
    """Before the other plugins (pytest-django's ordering, `-m`): each test's tier. After them: whole
    groups by their estimated time, longest first, each group's own order kept (pytest-django's: a
    transactional test's reset leaves what `migrate` left, for whatever runs next)."""
    for item in items:
        if any(item.get_closest_marker(tier) for tier in TIERS):
            continue
        fixtures = set(item.fixturenames)
        if fixtures & E2E_FIXTURES or _module_name(item) in E2E_MODULES:
            item.add_marker(pytest.mark.e2e)
        elif item.get_closest_marker("django_db") or fixtures & DB_FIXTURES:
            item.add_marker(pytest.mark.integration)
        else:
            item.add_marker(pytest.mark.unit)
    yield
    groups = {item.nodeid: _group(item) for item in items}
    if "long-pole" in groups.values():
        quick = [i for i in items if _tier(i) == "unit" and getattr(i, "originalname", i.name) not in LONG_TESTS]
        for item in quick[:POLE_TAIL]:
            groups[item.nodeid] = "long-pole"
    weight: dict = {}
    for item in items:
        name = getattr(item, "originalname", item.name)
        weight[groups[item.nodeid]] = weight.get(groups[item.nodeid], 0) + LONG_TESTS.get(
            name, TIER_SECONDS[_tier(item)]
        )
    first_seen: dict = {}
    for i, item in enumerate(items):
        first_seen.setdefault(groups[item.nodeid], i)
    items.sort(key=lambda item: (-weight[groups[item.nodeid]], first_seen[groups[item.nodeid]], not alone(item)))
    where = os.environ.get("RELAY_TESTS_RUN_DIR")
    if where and os.environ.get("PYTEST_XDIST_WORKER"):  # for the scheduler, in the controller
        import json

        with open(os.path.join(where, f"groups.{os.getpid()}"), "w") as f:
            json.dump(groups, f)
        os.replace(os.path.join(where, f"groups.{os.getpid()}"), os.path.join(where, "groups.json"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` by the groups above. xdist's own cannot tell groups under pytest 9 (it renames
    `item._nodeid`, which pytest 9 no longer reads), so the scheduler reads the groups the workers wrote."""
    if config.getvalue("dist") != "loadgroup":
        return None
    import json

    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups: dict | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                with open(os.path.join(config._relay_run_dir, "groups.json")) as f:
                    self.groups = json.load(f)
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup):
    """pytest-django's, plus: a drain run in this process left the bookkeeper thread's connection open
    (batches.worker.bookkeeper: kept up to CONN_MAX_AGE, as a worker keeps it); close it before the
    test database is dropped."""
    yield
    from batches.worker import bookkeeper

    bookkeeper.close_bookkeeper()
    from django.db import connection

    s = connection.settings_dict
    if s.get("POOLER"):  # the pooler tier: PgBouncer keeps server connections to the test DB; DROP needs them gone
        import psycopg2

        admin = psycopg2.connect(host=s["HOST"], port=s["PORT"], user=s["USER"], dbname="pgbouncer")
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute(f"KILL {s['NAME']}")
            cur.execute(f"RESUME {s['NAME']}")
        admin.close()


@pytest.fixture(scope="session")
def upstream():
    server = DemoUpstream().start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _clean_redis(request):
    if request.node.get_closest_marker("unit"):  # the unit tier does not touch Redis
        yield
        return
    from core.redis import get_redis

    r = get_redis()
    r.flushdb()
    yield


@pytest.fixture(autouse=True)
def _forget_secrets():
    """The scrubber remembers every host-key value the process sent (core/scrub.py) and rebuilds its matcher
    over all of them when one is added: across a worker's ~800 tests, each with keys of its own, every
    rebuild compiled the keys of every earlier test (90% of test_host_kind_vertex's CPU). Each test starts
    with none remembered; the catalog's keys are read again on first use."""
    from core import scrub

    scrub.forget_all()
    yield


@pytest.fixture
def fake(upstream):
    upstream.reset()
    return upstream


@pytest.fixture(scope="module")
def worker_env():
    """Extra environment for the module's worker processes; a test module overrides it when it needs some."""
    return {}


class _SharedFleet:
    """One fleet for the tests whose `worker` runs with the default environment: a fleet takes seconds of
    both cores to boot, so it is started once per xdist worker rather than once per module, and kept from
    one module that asks for it to the next. It runs only where a module's own fleet ran: from a module's
    first test that asks for `worker` to the module's end. Elsewhere it is frozen (SIGSTOP, `freeze`), never
    beside a test that needs the database and Redis to itself (a running fleet would claim the items and
    tasks of in-process tests, and double the slots of tests that count them), nor beside a fleet a test or
    a module starts itself (frozen rather than stopped: a boot costs ~6 CPU-seconds, and about 25 tests and
    modules start fleets of their own, each followed by a module that wants this one back). Between tests
    it is what a module's own fleet was between its tests: the database emptied under it, its broker
    flushed (`_clean_redis`)."""

    APP = "relay-tests-shared-fleet"  # its PostgreSQL sessions' application_name (libpq reads PGAPPNAME)

    def __init__(self):
        self.fleet = None
        self.module = None  # the module whose test took it last
        self.frozen_at = None  # PostgreSQL restarts seen when it was frozen (None: running)

    def take(self, db_url: str, module: str, restarts: int):
        from tests.workers import Worker

        if self.frozen_at is not None and self.frozen_at != restarts:
            self.stop()  # PostgreSQL restarted while it was frozen: a new one rather than reconnects mid-test
        if self.fleet is not None and self.frozen_at is not None:
            self._signal(signal.SIGCONT)
            self.frozen_at = None
        if self.fleet is None or not self.fleet.alive():  # a test that killed it leaves the next one a new one
            self.stop()
            self.fleet = Worker(db_url, "shared", extra_env={"PGAPPNAME": self.APP})
        self.module = module
        return self.fleet

    def freeze(self, db_url: str, restarts: int) -> None:
        """SIGSTOP every process of the fleet at a point where it holds nothing another process could want:
        no PostgreSQL session of its own in a transaction (or a statement), no BRPOP of its own waiting in
        Redis (the next message pushed would go to a process that cannot run it). A process stopped in the
        middle of either is let go on a moment and stopped again; a fleet that never settles is stopped."""
        if self.fleet is None or self.frozen_at is not None:
            return
        import psycopg2
        import redis
        from django.conf import settings

        broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
        db = broker.connection_pool.connection_kwargs.get("db", 0)
        pg = psycopg2.connect(db_url)
        pg.autocommit = True
        try:
            for _ in range(100):
                self._signal(signal.SIGSTOP)
                # Twice, a moment apart: a command sent just before the stop may still be on its way in, and
                # the second look must find nothing to let go.
                if self._settled(pg, broker, db) is not None:
                    time.sleep(0.05)
                    if self._settled(pg, broker, db) == 0:
                        self.frozen_at = restarts
                        self.module = None
                        return
                self._signal(signal.SIGCONT)
                time.sleep(0.05)
        finally:
            pg.close()
            broker.close()
        self.stop()

    def _settled(self, pg, broker, db: int) -> int | None:
        """None while a PostgreSQL session of the fleet is in a transaction or a statement; else how many
        of its commands waited in Redis (BRPOP, BLPOP): each is answered "nothing" at once, as at its
        timeout, so the process polls again once thawed. Between tests only the fleet blocks in Redis."""
        with pg.cursor() as cur:
            sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND state <> 'idle'"
            cur.execute(sql, [self.APP])
            if cur.fetchone()[0]:
                return None
        blocked = [c for c in broker.client_list() if int(c.get("db", -1)) == db and "b" in c.get("flags", "")]
        for client in blocked:
            broker.client_unblock(int(client["id"]))
        return len(blocked)

    def _signal(self, sig: int) -> None:
        for proc in self.fleet.procs.values():
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self.module = None
        self.frozen_at = None
        if self.fleet is not None:
            self.fleet.stop()  # SIGCONT first: a frozen process cannot act on SIGTERM
            self.fleet = None


_shared_fleet = _SharedFleet()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before a test's fixtures, for a test that does not ask for `worker`: the shared fleet is frozen when the
    test starts fleets of its own, or belongs to a module that has not taken it (a unit test, which touches
    neither the database nor Redis, leaves it as it is)."""
    names = item.fixturenames
    if "worker" in names or _shared_fleet.fleet is None:
        return
    if "workers" in names or (_module_name(item) != _shared_fleet.module and not item.get_closest_marker("unit")):
        from django.db import connection

        from tests.workers import database_url

        _shared_fleet.freeze(database_url(connection.settings_dict), _restarts_seen(item.config))


def _restarts_seen(config) -> int:
    return getattr(config, "_relay_restarts_seen", 0)


@pytest.fixture(scope="session")
def _shared_fleet_session(django_db_setup):
    """Stops the shared fleet at the session's end, before the test database is dropped."""
    yield _shared_fleet
    _shared_fleet.stop()


@pytest.fixture(scope="module")
def _module_fleet(request, django_db_setup, worker_env, _shared_fleet_session):
    """A module's own fleet when it sets an environment of its own (`worker_env`), else None."""
    from django.db import connection

    from tests.workers import Worker, database_url

    if not worker_env:
        yield None
        return
    # Never two running fleets on one broker: the shared one is frozen (it takes nothing while stopped, and
    # is thawed for the next module that asks for it rather than booted again).
    _shared_fleet_session.freeze(database_url(connection.settings_dict), _restarts_seen(request.config))
    name = request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")
    w = Worker(database_url(connection.settings_dict), name, extra_env=worker_env)
    yield w
    w.stop()


@pytest.fixture
def worker(request, _module_fleet, _shared_fleet_session):
    """The relay's background processes (item worker, control worker, webhook lane, beat): the module's own
    fleet when it sets an environment (`worker_env`), else the shared one."""
    if _module_fleet is not None:
        return _module_fleet
    from django.db import connection

    from tests.workers import database_url

    return _shared_fleet_session.take(
        database_url(connection.settings_dict), _module_name(request.node), _restarts_seen(request.config)
    )


@pytest.fixture
def db_url(django_db_setup):
    from django.db import connection

    from tests.workers import database_url

    return database_url(connection.settings_dict)


@pytest.fixture
def workers(db_url):
    """Start fleets of background processes in a test; each is stopped at its end."""
    from tests.workers import Worker

    started = []

    def start(name, extra_env=None):
        w = Worker(db_url, name, extra_env=extra_env)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


@pytest.fixture
def catalog(db, fake):
    """A small catalog on the fake upstream, with a service-account key."""
    return factories.make_catalog(fake.url)


# --- resetting the database after a transactional test -----------------------------------------------
# Django ends a transactional test with `flush`: TRUNCATE of every table, then post_migrate recreates
# the content types and permissions (~0.2-0.3 s a test). Here only the tables the test wrote to are
# emptied (DELETE, one transaction), and the tables that held rows right after migrate (content types,
# permissions) and the domains' checks (post_migrate syncs them) are compared with their state before
# the first transactional test: a test that changed one of them gets Django's full flush instead. So
# each transactional test still starts from the database `migrate` left.


class _Baseline:
    """One database's state after set-up: its tables, the rows of those that had any, the domains' checks."""

    def __init__(self, connection):
        tables = sorted(connection.introspection.django_table_names(only_existing=True, include_views=False))
        assert all(re.fullmatch(r"\w+", t) for t in tables), tables  # written into the SQL below as literals
        with connection.cursor() as cursor:
            cursor.execute(" UNION ALL ".join(f"SELECT '{t}' WHERE EXISTS (SELECT 1 FROM \"{t}\")" for t in tables))
            self.seeded = {row[0] for row in cursor.fetchall()}
        probes = [f"SELECT '{t}', NULL WHERE EXISTS (SELECT 1 FROM \"{t}\")" for t in tables if t not in self.seeded]
        probes += [
            f"SELECT '{t}', (SELECT md5(coalesce(string_agg(r::text, ',' ORDER BY r::text), '')) FROM \"{t}\" r)"
            for t in sorted(self.seeded)
        ]
        probes.append(
            "SELECT ' domains', (SELECT md5(coalesce(string_agg(conname || pg_get_constraintdef(oid), ','"
            " ORDER BY conname), '')) FROM pg_constraint WHERE contypid <> 0)"
        )
        self.sql = " UNION ALL ".join(probes)
        self.fingerprints = {}
        self.fingerprints = self.probe(connection)[1]

    def probe(self, connection) -> tuple[list[str], dict]:
        """(tables written to since set-up, fingerprints of the seeded tables and the domains)."""
        with connection.cursor() as cursor:
            cursor.execute(self.sql)
            rows = cursor.fetchall()
        return [t for t, digest in rows if digest is None], {t: d for t, d in rows if d is not None}

    def reset(self, connection) -> bool:
        """Empty what the test wrote; False (nothing done) when it changed what set-up left."""
        from django.db import transaction

        with transaction.atomic(using=connection.alias):
            written, fingerprints = self.probe(connection)
            if fingerprints != self.fingerprints:
                return False
            if written:
                with connection.cursor() as cursor:
                    # Django's foreign keys are deferrable: checked at commit, when every table is empty.
                    cursor.execute("SET CONSTRAINTS ALL DEFERRED")
                    cursor.execute("; ".join(f'DELETE FROM "{t}"' for t in written))
        return True


_baselines: dict = {}


def _fast_transactional_reset():
    """Transactional tests end with their tables emptied while a real worker process may still be
    polling (claim, heartbeat, sweep); a deadlock with such a transaction makes PostgreSQL abort the
    reset: it is retried."""
    import time

    from django.core.management.base import CommandError
    from django.db import DatabaseError, InterfaceError, connections
    from django.test.testcases import TransactionTestCase

    original_setup = TransactionTestCase._fixture_setup.__func__  # a classmethod
    original_teardown = TransactionTestCase._fixture_teardown

    def plain(self) -> bool:
        return self.available_apps is None and not self.serialized_rollback and not self.reset_sequences

    def fixture_setup(self):
        if plain(self):
            for name in self._databases_names(include_mirrors=False):
                connection = connections[name]
                if connection.vendor == "postgresql" and connection.settings_dict["NAME"] not in _baselines:
                    _baselines[connection.settings_dict["NAME"]] = _Baseline(connection)
        return original_setup(self)

    def retrying(step):
        deadline = time.monotonic() + 30
        while True:
            try:
                return step()
            except (CommandError, DatabaseError, InterfaceError):
                if time.monotonic() > deadline:
                    raise
                for connection in connections.all(initialized_only=True):
                    connection.close_if_unusable_or_obsolete()  # a broken one (PostgreSQL restarted) reconnects
                time.sleep(0.1)

    def fixture_teardown(self):
        if not plain(self):
            return retrying(lambda: original_teardown(self))
        for name in self._databases_names(include_mirrors=False):
            connection = connections[name]
            baseline = _baselines.get(connection.settings_dict["NAME"])
            if baseline is None or not retrying(lambda c=connection, b=baseline: b.reset(c)):
                # Not seen at set-up, or set-up's rows changed: Django's flush, and a new baseline.
                retrying(lambda: original_teardown(self))
                _baselines.pop(connection.settings_dict["NAME"], None)

    TransactionTestCase._fixture_setup = classmethod(fixture_setup)
    TransactionTestCase._fixture_teardown = fixture_teardown


_fast_transactional_reset()


# --- where a run's time goes -------------------------------------------------------------------------
# TEST_TIMELINE=FILE: each xdist worker appends a line per test (worker, start, end, node id): which tests
# ran beside which, and what the last minutes of a run wait on.


_timeline_started: dict = {}


def pytest_runtest_logstart(nodeid, location):
    if os.environ.get("TEST_TIMELINE"):
        _timeline_started[nodeid] = time.time()


def pytest_runtest_logfinish(nodeid, location):
    path = os.environ.get("TEST_TIMELINE")
    if path and nodeid in _timeline_started:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(path, "a") as f:
            f.write(f"{worker} {_timeline_started.pop(nodeid):.2f} {time.time():.2f} {nodeid}\n")
