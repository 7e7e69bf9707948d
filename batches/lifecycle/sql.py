"""The relay's own SQL machinery for the hot path: server-side prepared statements (one set per
database connection, planned once), rows built without model instances, and the finish statement's
text built once per shape. PostgreSQL only; SQLite (embedded mode) takes the ORM's paths.

Behind a transaction-mode pooler (DATABASE_POOLER=transaction, docs/pooler.md) nothing is prepared: a
statement prepared on one server connection is not there for the next transaction, which the pooler may
give another. Each hot statement is a PL/pgSQL function instead (`PooledFunction`), created once per
database: PostgreSQL caches a function's plans per server connection, whichever client calls it, so the
claim and the finish are planned once per server connection as their prepared forms are, and the
pooler carries nothing."""

import hashlib
import re
import weakref

from django.apps import apps
from django.conf import settings
from django.db import DatabaseError, connection, models, transaction

from batches.models import Item
from usage.models import UsageEvent

# The claim statements as server-side prepared statements, one per database connection: PostgreSQL
# plans the CTE once per connection (a generic plan after five runs) instead of at every claim, where the
# planning cost several times the execution (~0.3 ms against ~0.05 ms, measured on the benchmark's table).
PARAM_TYPES = {
    "owner": "text",
    "now": "timestamptz",
    "lease": "timestamptz",
    "floor_batch": "uuid",
    "floor": "integer",
    "check": "uuid",
    "batch": "uuid",
    "async_commit": "boolean",
}
# The claims and the finish run on the `default` database, whose settings say whether it is pooled.
POOLED = settings.DATABASES["default"].get("POOLER") == "transaction"


# DB-API connection → names of the statements ready on it: prepared (direct) or whose function was
# found or created (behind a pooler).
prepared_on = weakref.WeakKeyDictionary()

# Behind a pooler the claim's function is planned under the settings its prepared form is planned with
# (below: no sort where an index gives the order, no JIT, one generic plan): a function's SET clause
# holds them while it runs, its planning included, and restores them at its exit. The finish's, like
# the prepared finish, one generic plan (the session setting `prepare` makes on a direct connection).
CLAIM_SETTINGS = (("enable_sort", "off"), ("jit", "off"), ("plan_cache_mode", "force_generic_plan"))
FINISH_SETTINGS = (("jit", "off"), ("plan_cache_mode", "force_generic_plan"))


class PooledFunction:
    """A statement as a PL/pgSQL function: `RETURN QUERY` of the statement, its parameters typed, its
    result columns named. PL/pgSQL plans the statement at its first run on a server connection and keeps
    the plan there for every later call, from any client: behind a transaction pooler, where a prepared
    statement cannot outlive its transaction, that is the plan cache that survives (measured:
    docs/pooler.md, bench/pooler.py). The function's name is a digest of its whole definition, so a
    change to the statement, a type or a setting makes a new function, never a stale one; it is created
    once per database (`create`), by whichever process needs it first."""

    __slots__ = ("name", "ddl", "params")

    def __init__(self, body: str, params: list[str], columns: list[tuple[str, str]], settings: tuple):
        sets = " ".join(f"SET {k} = {v}" for k, v in settings)
        returns = ", ".join(f"{connection.ops.quote_name(n)} {t}" for n, t in columns)
        # use_column: a result column (an OUT variable of the function) named like a table's column (id,
        # state…) would otherwise make that name ambiguous inside the statement.
        definition = (
            f"({', '.join(params)}) RETURNS TABLE({returns}) LANGUAGE plpgsql VOLATILE {sets} AS $relay$\n"
            f"#variable_conflict use_column\nBEGIN\nRETURN QUERY {body};\nEND\n$relay$"
        )
        self.name = "relay_fn_" + hashlib.blake2b(definition.encode(), digest_size=10).hexdigest()
        self.ddl = f"CREATE FUNCTION {self.name}{definition}"
        self.params = params

    def call(self, named: tuple[str, ...] = ()) -> str:
        """The call, with a positional %s per parameter or the %(name)s parameters `named`. Each is cast
        to its parameter's type: a call resolves its function by its arguments' types, and psycopg2's
        literals have theirs (an integer is no smallint)."""
        args = [f"%({a})s" for a in named] if named else ["%s"] * len(self.params)
        return f"SELECT * FROM {self.name}({', '.join(f'{a}::{t}' for a, t in zip(args, self.params, strict=True))})"

    def create(self, cursor) -> None:
        """Create the function unless it exists. Its own transaction (or a savepoint, inside one): two
        processes creating it at once collide on pg_proc's unique name; the loser finds it made."""
        cursor.execute("SELECT to_regproc(%s) IS NOT NULL", [self.name])
        if cursor.fetchone()[0]:
            return
        try:
            with transaction.atomic():
                cursor.execute(self.ddl)
        except DatabaseError:
            cursor.execute("SELECT to_regproc(%s) IS NOT NULL", [self.name])
            if not cursor.fetchone()[0]:
                raise


def ensure(cursor, prepared: set, name: str, prepare) -> None:
    """Make statement `name` ready on this connection: PREPARE it (direct: not undone by a rollback, so
    once per connection) or find or create its function (behind a pooler). A function created inside a
    transaction that may still roll back (a test's) is not remembered: it is looked for again next time."""
    if isinstance(prepare, PooledFunction):
        prepare.create(cursor)
        if connection.in_atomic_block:
            return
    else:
        cursor.execute(prepare)
    prepared.add(name)


_PARAM = re.compile(r"%\((\w+)\)s")


def statement_forms(name: str, sql: str, columns: list[tuple[str, str]]) -> tuple:
    """(PREPARE, EXECUTE, the EXECUTE with positional %s, their parameters' names) of a statement written
    with %(name)s parameters (those of PARAM_TYPES). The positional form goes behind a held finish.
    `columns`: the statement's result, (name, type) each, for its function behind a pooler, where PREPARE
    is its `PooledFunction` and the EXECUTEs are calls of it."""
    used = [n for n in PARAM_TYPES if f"%({n})s" in sql]
    body = sql
    for i, n in enumerate(used, 1):
        body = body.replace(f"%({n})s", f"${i}")
    if POOLED:
        fn = PooledFunction(body, [PARAM_TYPES[n] for n in used], columns, CLAIM_SETTINGS)
        return fn, fn.call(tuple(used)), fn.call(), tuple(used)
    types = ", ".join(PARAM_TYPES[n] for n in used)
    return (
        f"PREPARE {name}({types}) AS {body}",
        f"EXECUTE {name}({', '.join(f'%({n})s' for n in used)})",
        f"EXECUTE {name}({', '.join(['%s'] * len(used))})",
        tuple(used),
    )


# A claim statement is planned once per connection, generically, with sorts disabled while it is
# planned. Otherwise, on stale statistics (no ANALYZE since the batch's rows were written: autovacuum
# off, as on this machine and in CI), the planner reads every available item of the batch through
# item_batch_state and sorts them, at every claim (EXPLAIN ANALYZE, 50,000-item batch with 45,000
# available: 44,993 rows and an external sort spilling to disk), instead of walking item_available in
# idx order to the first one. The session keeps plan_cache_mode = force_generic_plan so that this plan
# is the one used (the setting concerns prepared statements only, and these are the only ones the relay
# makes); an ANALYZE of the table makes PostgreSQL plan it again, then with statistics that show the
# batch's size.
PLAN_PARAMS = dict.fromkeys(PARAM_TYPES) | {"owner": "", "floor": 0}


def prepare(cursor, prepared: set, name: str, prepare: str, execute: str) -> None:
    if POOLED:  # its function, planned under CLAIM_SETTINGS at its first run on each server connection
        ensure(cursor, prepared, name, prepare)
        return
    cursor.execute(prepare)  # PREPARE is not undone by a rollback: once per connection
    cursor.execute("SET plan_cache_mode = force_generic_plan")
    # jit off too: the planner decides JIT from the plan's cost, which a disabled sort inflates (the fair
    # order's sort of the batches stays: ~500 ms of LLVM compilation per execution otherwise).
    cursor.execute("SET enable_sort = off")
    cursor.execute("SET jit = off")
    try:
        cursor.execute("EXPLAIN " + execute, PLAN_PARAMS)  # builds and keeps the generic plan
    finally:
        cursor.execute("RESET enable_sort")
        cursor.execute("RESET jit")
    prepared.add(name)


_row_columns: dict = {}
# Fields whose Python values psycopg2 adapts as they are (what get_db_prep_save returns for them on
# PostgreSQL, a UUID key included): `fields_row` passes such values through without a preparation call.
_PLAIN_FIELDS = (
    models.IntegerField,
    models.CharField,
    models.TextField,
    models.DateTimeField,
    models.BooleanField,
    models.ForeignKey,
)


def fields_row(model, fields: dict) -> tuple[str, list[str], list]:
    """A row for `finish_item_at_once`, (table, columns, values), from field values (attnames: every
    concrete field but the id, left to the database). On PostgreSQL without a model instance or a
    preparation call per field: the finish writes one Attempt per item, which as an instance and a
    get_db_prep_save per field took 6% of the worker's samples."""
    key = (model, tuple(fields))
    columns = _row_columns.get(key)
    if columns is None:
        concrete = {f.attname: f for f in model._meta.concrete_fields if not f.primary_key}
        if set(fields) != set(concrete):
            raise TypeError(f"{model.__name__}: fields {sorted(fields)} are not its columns {sorted(concrete)}")
        other = sorted(n for n in fields if not isinstance(concrete[n], _PLAIN_FIELDS))
        if other:
            raise TypeError(f"{model.__name__}: fields_row takes plain fields only, not {other}")
        columns = _row_columns[key] = [concrete[n].column for n in fields]
    if connection.vendor != "postgresql":  # SQLite: UUIDs as hex, datetimes as naive UTC text
        return (
            model._meta.db_table,
            columns,
            [model._meta.get_field(n).get_db_prep_save(v, connection) for n, v in fields.items()],
        )
    return model._meta.db_table, columns, list(fields.values())


def finish_shape(names: tuple[str, ...], rows: tuple[tuple[str, tuple[str, ...]], ...]):
    """(name, PREPARE, EXECUTE, preparations) of the finish that sets the item fields `names` and writes
    `rows` ((table, columns) each), built once per shape. The statement's text (~60 quoted columns and
    their casts) was built at every item: 80 µs of CPU each time, against 0.7 µs for this lookup
    (micro-benchmark, warm; the whole finish is ~0.9 ms of the bookkeeper's thread).
    A preparation is a field's `get_db_prep_save`, or None where the value goes to psycopg2 as it is
    (`_PLAIN_FIELDS`, as `fields_row` passes them)."""
    key = (names, rows)
    shape = _finish_shapes.get(key)
    if shape is not None:
        return shape
    qn = connection.ops.quote_name
    opts = Item._meta
    item_fields = [opts.get_field(k) for k in names]
    assign = ", ".join(f"{qn(f.column)} = %s" for f in item_fields)
    parts = [
        f"fin AS (UPDATE {qn(opts.db_table)} SET {assign} "
        "WHERE id = %s AND state = %s AND lease_owner = %s AND attempt = %s RETURNING 1)"
    ]
    types = [*_types_of(opts.db_table, [f.column for f in item_fields])]  # a copy: the lists are cached
    types += _types_of(opts.db_table, ["id", "state", "lease_owner", "attempt"])
    for i, (sql, _) in enumerate(row_inserts([(t, list(c), c) for t, c in rows], " FROM fin", typed=True)):
        parts.append(f"w{i} AS ({sql})")
        types += _types_of(*rows[i])
    statement = _finish_statement("WITH " + ",\n".join(parts) + "\nSELECT count(*) FROM fin", types)
    # DateTimeField is not passed through here: a naive datetime gets get_db_prep_save's warning and zone.
    preps = tuple(
        None if isinstance(f, _PLAIN_FIELDS) and not isinstance(f, models.DateTimeField) else f.get_db_prep_save
        for f in item_fields
    )
    shape = (*statement, preps)
    if len(_finish_shapes) < 256:  # shapes, not items: a bound that is never reached
        _finish_shapes[key] = shape
    return shape


_finish_shapes: dict = {}


def _finish_statement(sql: str, types: list[str]) -> tuple:
    """(name, PREPARE, EXECUTE) of a finish statement written with a %s parameter per type. A server-side
    prepared statement, as the claims are: the finish's text (an UPDATE and two INSERTs, ~60 columns)
    was parsed, analysed and planned at every item (perf of the PostgreSQL backends: `base_yyparse`
    and the planner among their top symbols). Its shapes are few (the fields a final state sets, the
    number of usage events; `_finish_shape` keeps each); the name is the text's digest, the same in
    every process and thread. Behind a pooler: its function (`PooledFunction`) and a call of it."""
    name = "relay_finish_" + hashlib.blake2b(sql.encode(), digest_size=10).hexdigest()
    pieces = sql.split("%s")
    n = len(types)
    if len(pieces) != n + 1:
        raise ValueError(f"finish statement: {len(pieces) - 1} placeholders for {n} parameters")
    body = pieces[0] + "".join(f"${i}{piece}" for i, piece in enumerate(pieces[1:], 1))
    if POOLED:
        fn = PooledFunction(body, types, [("finished", "bigint")], FINISH_SETTINGS)
        return name, fn, fn.call()
    return name, f"PREPARE {name} AS {body}", f"EXECUTE {name}({', '.join(['%s'] * n)})"


_column_types: dict = {}


def column_types(model, columns: list[str]) -> list[str]:
    """The types of `model`'s columns, without a length (see `_types_of`)."""
    by_column = {f.column: f for f in model._meta.concrete_fields}
    return [re.sub(r"\(\d+\)$", "", by_column[c].db_type(connection)) for c in columns]


def _types_of(table: str, columns: list[str]) -> list[str]:
    """The columns' types, for the casts of a prepared INSERT … SELECT (whose parameters have no column
    to take a type from). Without a length: a cast to varchar(n) would cut a longer value silently,
    where the column itself refuses it."""
    key = (table, tuple(columns))
    types = _column_types.get(key)
    if types is None:
        model = next(m for m in apps.get_models() if m._meta.db_table == table)
        types = _column_types[key] = column_types(model, columns)
    return types


def row_inserts(rows, source: str, typed: bool = False):
    """INSERT … SELECT <values>[ FROM fin] per row; usage events ON CONFLICT DO NOTHING. `typed`: each
    value cast to its column's type (a prepared statement's)."""
    qn = connection.ops.quote_name
    for table, columns, values in rows:
        cols = ", ".join(qn(c) for c in columns)
        if typed:
            marks = ", ".join(f"%s::{t}" for t in _types_of(table, columns))
        else:
            marks = ", ".join(["%s"] * len(values))
        conflict = " ON CONFLICT DO NOTHING" if table == UsageEvent._meta.db_table else ""
        yield f"INSERT INTO {qn(table)} ({cols}) SELECT {marks}{source}{conflict}", list(values)
