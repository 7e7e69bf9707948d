"""The statements the relay runs behind a transaction pooler as PL/pgSQL functions (batches/lifecycle/sql.py,
`PooledFunction`, docs/pooler.md): made once per database whoever races for it, and never remembered as made
when the transaction that made it rolls back. The claim and the finish as functions, through a real
PgBouncer, are tests/test_pooler.py's (`make test-pooler`)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection, transaction

from batches.lifecycle import sql as lsql


def _function(body: str) -> lsql.PooledFunction:
    return lsql.PooledFunction(body, ["integer"], [("n", "integer")], lsql.CLAIM_SETTINGS)


def _made(fn) -> list:
    with connection.cursor() as cursor:
        cursor.execute("SELECT array_to_string(proconfig, ',') FROM pg_proc WHERE proname = %s", [fn.name])
        return [row[0] for row in cursor.fetchall()]


@pytest.fixture
def fn():
    made = _function("SELECT $1 + 1")
    yield made
    with connection.cursor() as cursor:
        cursor.execute(f"DROP FUNCTION IF EXISTS {made.name}")


@pytest.mark.django_db(transaction=True)
def test_a_function_is_made_once_whoever_races_for_it(fn):
    start = threading.Barrier(4)

    def call(n: int) -> int:
        try:
            start.wait(10)  # all four look for it before any has made it
            with connection.cursor() as cursor:
                fn.create(cursor)
                cursor.execute(fn.call(), [n])
                return cursor.fetchone()[0]
        finally:
            connection.close()

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(call, range(4))) == [1, 2, 3, 4]
    # One function, planned under its settings (held by its SET clause, restored when it returns).
    assert _made(fn) == ["enable_sort=off,jit=off,plan_cache_mode=force_generic_plan"]
    with connection.cursor() as cursor:
        cursor.execute(fn.call(), [1])
        cursor.execute("SHOW enable_sort")
        assert cursor.fetchone()[0] == "on"


@pytest.mark.django_db(transaction=True)
def test_a_function_made_in_a_transaction_that_rolls_back_is_not_remembered(fn):
    prepared: set = set()
    with pytest.raises(RuntimeError), transaction.atomic():
        with connection.cursor() as cursor:
            lsql.ensure(cursor, prepared, "plus_one", fn)
            cursor.execute(fn.call(), [1])
        raise RuntimeError("rolled back")
    assert prepared == set() and _made(fn) == []
    with connection.cursor() as cursor:  # autocommit: made for good, and remembered
        lsql.ensure(cursor, prepared, "plus_one", fn)
        cursor.execute(fn.call(), [2])
        assert cursor.fetchone()[0] == 3
    assert prepared == {"plus_one"} and len(_made(fn)) == 1


def test_a_changed_statement_or_setting_is_a_new_function():
    base = _function("SELECT $1 + 1")
    assert base.name == _function("SELECT $1 + 1").name
    assert base.name != _function("SELECT $1 + 2").name
    other = lsql.PooledFunction("SELECT $1 + 1", ["integer"], [("n", "integer")], lsql.FINISH_SETTINGS)
    assert base.name != other.name
    assert base.call() == f"SELECT * FROM {base.name}(%s::integer)"
