"""Django's PostgreSQL backend with a health check that costs nothing on a busy connection.

`CONN_HEALTH_CHECKS` makes Django send `SELECT 1` before the first query of every
request (and of every Celery task), so a connection broken while it sat idle (PostgreSQL
restarted) is replaced instead of failing that request. On a busy process that check is
one round trip of the three a live request made (decision 0011). This backend skips it when
the connection answered a query less than `RELAY_DB_HEALTH_CHECK_IDLE_S` (1 s) ago: a
connection that just worked is as good a proof as `SELECT 1`, and a restart that breaks a
connection in use fails the statements in flight whether or not they were checked.
Django's own error path is unchanged: after an error the connection is tested for real
and closed when broken. An idle connection is checked exactly as before.
"""

import time

from django.conf import settings
from django.db.backends.postgresql import base
from django.db.backends.utils import CursorWrapper


class _Timed:
    """Notes when the connection last answered a statement."""

    def execute(self, sql, params=None):
        result = super().execute(sql, params)
        self.db.answered_at = time.monotonic()
        return result

    def executemany(self, sql, param_list):
        result = super().executemany(sql, param_list)
        self.db.answered_at = time.monotonic()
        return result


class _TimedCursor(_Timed, CursorWrapper):
    pass


class _TimedDebugCursor(_Timed, base.CursorDebugWrapper):
    pass


class DatabaseWrapper(base.DatabaseWrapper):
    answered_at = float("-inf")

    def make_cursor(self, cursor):
        return _TimedCursor(cursor, self)

    def make_debug_cursor(self, cursor):
        return _TimedDebugCursor(cursor, self)

    def connect(self):
        super().connect()
        self.answered_at = time.monotonic()  # a new connection has just been established

    def close_if_health_check_failed(self):
        if (
            self.connection is not None
            and self.health_check_enabled
            and not self.health_check_done
            and time.monotonic() - self.answered_at < getattr(settings, "RELAY_DB_HEALTH_CHECK_IDLE_S", 1.0)
        ):
            self.health_check_done = True
            return
        super().close_if_health_check_failed()
