"""Test set-up: real PostgreSQL and Redis (started by scripts/services.sh), a fake
upstream on loopback that speaks the providers' wire formats. Nothing of ours
is mocked."""

import os

if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
    raise RuntimeError("The suite runs against PostgreSQL: use `make test` (it sets DATABASE_URL).")

import pytest  # noqa: E402

from relay.demo_upstream import DemoUpstream  # noqa: E402
from tests import factories  # noqa: E402


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup):
    """pytest-django's, plus: a drain run in this process left the bookkeeper thread's connection open
    (batches.services: kept up to CONN_MAX_AGE, as a worker keeps it); close it before the test
    database is dropped."""
    yield
    from batches import services

    services.close_bookkeeper()


@pytest.fixture(scope="session")
def upstream():
    server = DemoUpstream().start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _clean_redis():
    from relay.redis import get_redis

    r = get_redis()
    r.flushdb()
    yield


@pytest.fixture
def fake(upstream):
    upstream.reset()
    return upstream


@pytest.fixture(scope="module")
def worker_env():
    """Extra environment for the module's worker processes; a test module overrides it when it needs some."""
    return {}


@pytest.fixture(scope="module")
def worker(request, django_db_setup, django_db_blocker, worker_env):
    """The relay's background processes (item worker, control worker, beat) for a test module."""
    from django.db import connection

    from tests.workers import Worker, database_url

    name = request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")
    w = Worker(database_url(connection.settings_dict), name, extra_env=worker_env)
    yield w
    w.stop()


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


def _retrying_fixture_teardown():
    """Transactional tests end with TRUNCATE while a real worker process may still
    be polling (claim, heartbeat, sweep). TRUNCATE's lock order can deadlock with
    such a transaction, and PostgreSQL then aborts the TRUNCATE; retry it."""
    import time

    from django.core.management.base import CommandError
    from django.test.testcases import TransactionTestCase

    original = TransactionTestCase._fixture_teardown

    def teardown(self):
        for attempt in range(5):
            try:
                return original(self)
            except CommandError:
                if attempt == 4:
                    raise
                time.sleep(0.5)

    TransactionTestCase._fixture_teardown = teardown


_retrying_fixture_teardown()
