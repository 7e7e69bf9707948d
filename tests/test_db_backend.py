"""core/db/postgresql: the health check is skipped only for a connection that just answered."""

import pytest
from django.db import connection, connections

pytestmark = pytest.mark.django_db(transaction=True)

if connection.vendor != "postgresql":  # pragma: no cover - the suite runs on PostgreSQL
    pytest.skip("PostgreSQL backend only", allow_module_level=True)


def _kill_this_connection() -> None:
    """Terminate this connection's server process from another connection (what a restart does)."""
    pid = connection.connection.info.backend_pid
    other = connections.create_connection("default")
    try:
        with other.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", [pid])
    finally:
        other.close()


def _new_request() -> None:
    """What Django does at the start of a request or a Celery task, then at its first query."""
    connection.close_if_unusable_or_obsolete()
    connection.close_if_health_check_failed()


def _select_1(monkeypatch) -> list:
    checks = []
    wrapper = type(connections["default"])
    real = wrapper.is_usable
    monkeypatch.setattr(wrapper, "is_usable", lambda self: checks.append(1) or real(self))
    return checks


def test_a_connection_that_just_answered_is_not_checked(settings, monkeypatch):
    settings.RELAY_DB_HEALTH_CHECK_IDLE_S = 60
    checks = _select_1(monkeypatch)
    with connection.cursor() as cur:
        cur.execute("SELECT 1")
    _new_request()
    assert checks == []


def test_an_idle_connection_broken_by_the_server_is_replaced(settings, monkeypatch):
    settings.RELAY_DB_HEALTH_CHECK_IDLE_S = 0  # every connection counts as idle
    checks = _select_1(monkeypatch)
    with connection.cursor() as cur:
        cur.execute("SELECT 1")
    before = connection.connection.info.backend_pid
    _kill_this_connection()
    _new_request()
    assert checks == [1]
    with connection.cursor() as cur:
        cur.execute("SELECT 2")
        assert cur.fetchone() == (2,)
    assert connection.connection.info.backend_pid != before
