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

Behind a transaction-mode pooler with the timeouts set per transaction (settings: RELAY_DB_TIMEOUTS =
`transaction`, the default with DATABASE_POOLER), every transaction starts with them as `SET LOCAL`
(docs/pooler.md): sent in front of its first statement, in the same query string and round trip, so
they cost no round trip of their own. An autocommit statement is a transaction of its own, so each
one carries them (a query string of several statements runs as one implicit transaction, in which
SET LOCAL holds). In a transaction they go once, with its first statement, and Django's transaction
ends (commit, rollback, a change of autocommit) rearm them. A direct connection (no such setting)
takes the classes of before, unchanged.
"""

import re
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


# Statements PostgreSQL refuses inside a transaction block, which the multi-statement string of the
# timeouts would make them: they go alone (and so without the timeouts; migrations and operators only).
_OUTSIDE_A_TRANSACTION = re.compile(
    r"\s*(CREATE\s+DATABASE|DROP\s+DATABASE|ALTER\s+SYSTEM|VACUUM|CREATE\s+TABLESPACE|DROP\s+TABLESPACE"
    r"|(CREATE|DROP)\s+(UNIQUE\s+)?INDEX\s+CONCURRENTLY|REINDEX\b.*\bCONCURRENTLY"
    r"|(CREATE|DROP)\s+SUBSCRIPTION|ALTER\s+SUBSCRIPTION)",
    re.IGNORECASE | re.DOTALL,
)
_FIRST_WORDS = ("CREATE", "DROP", "ALTER", "VACUUM", "REINDEX")


class _TimeoutsPerTransaction:
    """Puts the connection's `SET LOCAL` timeouts in front of the first statement of each transaction."""

    def _run(self, run, sql, params):
        db = self.db
        if not isinstance(sql, str):  # psycopg2's sql.Composed: the relay sends none
            return run(sql, params)
        if db.autocommit:
            if sql[:64].lstrip()[:7].upper().startswith(_FIRST_WORDS) and _OUTSIDE_A_TRANSACTION.match(sql):
                return run(sql, params)
            return run(db.timeouts_sql + sql, params)
        if db.timeouts_sent:
            return run(sql, params)
        result = run(db.timeouts_sql + sql, params)
        db.timeouts_sent = True  # only once sent: a statement refused before it left is no start
        return result

    def _execute(self, sql, params, *ignored_wrapper_args):
        return self._run(super()._execute, sql, params)

    def _executemany(self, sql, param_list, *ignored_wrapper_args):
        return self._run(super()._executemany, sql, param_list)

    def copy_expert(self, sql, file, size=8192):
        # libpq runs a COPY that follows other statements in one query string as it runs it alone.
        return self._run(lambda s, _: self.cursor.copy_expert(s, file, size), sql, None)


class _PooledCursor(_TimeoutsPerTransaction, _TimedCursor):
    pass


class _PooledDebugCursor(_TimeoutsPerTransaction, _TimedDebugCursor):
    pass


class DatabaseWrapper(base.DatabaseWrapper):
    answered_at = float("-inf")

    def __new__(cls, settings_dict, *args, **kwargs):
        if cls is DatabaseWrapper and settings_dict.get("TIMEOUTS_PER_TRANSACTION"):
            cls = TimeoutsPerTransactionWrapper
        return super().__new__(cls)

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


class TimeoutsPerTransactionWrapper(DatabaseWrapper):
    """The connection of a database whose timeouts go as SET LOCAL in each transaction (settings:
    TIMEOUTS_PER_TRANSACTION, behind a transaction-mode pooler)."""

    timeouts_sent = False  # in the transaction now open

    def __init__(self, settings_dict, alias="default"):
        super().__init__(settings_dict, alias)
        # Whole numbers (settings reads them with env.int): nothing here can break the statement.
        self.timeouts_sql = "".join(
            f"SET LOCAL {name} = {int(ms)}; " for name, ms in settings_dict["TIMEOUTS_PER_TRANSACTION"].items()
        )

    def make_cursor(self, cursor):
        return _PooledCursor(cursor, self)

    def make_debug_cursor(self, cursor):
        return _PooledDebugCursor(cursor, self)

    # A transaction's end ends its SET LOCALs: the next transaction sends them again.
    def connect(self):
        self.timeouts_sent = False
        super().connect()

    def _commit(self):
        self.timeouts_sent = False
        return super()._commit()

    def _rollback(self):
        self.timeouts_sent = False
        return super()._rollback()

    def _set_autocommit(self, autocommit):
        self.timeouts_sent = False
        return super()._set_autocommit(autocommit)

    def _close(self):
        self.timeouts_sent = False
        return super()._close()
