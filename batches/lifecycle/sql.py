"""The relay's own SQL machinery for the hot path: server-side prepared statements (one set per
database connection, planned once), rows built without model instances, and the finish statement's
text built once per shape. PostgreSQL only; SQLite (embedded mode) takes the ORM's paths.

Behind a transaction-mode pooler (DATABASE_POOLER=transaction, docs/pooler.md) nothing is prepared: a
statement prepared on one server connection is not there for the next transaction, which the pooler may
give another. The same statements are sent whole (psycopg2 interpolates the parameters on the client),
and the claim's planner settings go with it as SET LOCAL (`POOLED` below)."""

import hashlib
import re
import weakref

from django.apps import apps
from django.conf import settings
from django.db import connection, models

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


class _SentWhole:
    """Behind a transaction pooler: every statement is sent whole, so each reads as ready on every
    connection and none is ever prepared (`name in prepared_on.setdefault(conn, …)` is always true)."""

    def __contains__(self, name) -> bool:
        return True

    def add(self, name) -> None:
        pass


class _NothingPrepared:
    ready = _SentWhole()

    def setdefault(self, conn, default=None) -> _SentWhole:
        return self.ready

    def __getitem__(self, conn) -> _SentWhole:
        return self.ready


# DB-API connection → names of the statements prepared on it.
prepared_on = _NothingPrepared() if POOLED else weakref.WeakKeyDictionary()

# Behind a pooler the claim is planned at every run, with the values it runs with (a custom plan), under
# the settings its prepared form is planned with (below: no sort where an index gives the order, no JIT).
# SET LOCAL: they end with the claim's own transaction (an implicit one: the settings, the claim and
# a finish sent in front of it are one query string).
PLAN_SETTINGS = "SET LOCAL enable_sort = off; SET LOCAL jit = off;\n"
_PARAM = re.compile(r"%\((\w+)\)s")


def statement_forms(name: str, sql: str) -> tuple[str, str, str, tuple[str, ...]]:
    """(PREPARE, EXECUTE, the EXECUTE with positional %s, their parameters' names) of a statement written
    with %(name)s parameters (those of PARAM_TYPES). The positional form goes behind a held finish.
    Behind a pooler: ("", the statement itself with its planner settings, the same with positional %s,
    the name of each %s in order)."""
    if POOLED:
        return "", PLAN_SETTINGS + sql, PLAN_SETTINGS + _PARAM.sub("%s", sql), tuple(_PARAM.findall(sql))
    used = [n for n in PARAM_TYPES if f"%({n})s" in sql]
    body = sql
    for i, n in enumerate(used, 1):
        body = body.replace(f"%({n})s", f"${i}")
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
    if POOLED:  # nothing to prepare (`statement_forms`); `prepared_on` never asks for it
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
    n = len(names) + 4
    for i, (sql, values) in enumerate(row_inserts([(t, list(c), c) for t, c in rows], " FROM fin", typed=True)):
        parts.append(f"w{i} AS ({sql})")
        n += len(values)
    statement = _finish_statement("WITH " + ",\n".join(parts) + "\nSELECT count(*) FROM fin", n)
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


def _finish_statement(sql: str, n: int) -> tuple[str, str, str]:
    """(name, PREPARE, EXECUTE) of a finish statement written with `n` %s parameters. A server-side
    prepared statement, as the claims are: the finish's text (an UPDATE and two INSERTs, ~60 columns)
    was parsed, analysed and planned at every item (perf of the PostgreSQL backends: `base_yyparse`
    and the planner among their top symbols). Its shapes are few (the fields a final state sets, the
    number of usage events; `_finish_shape` keeps each); the name is the text's digest, the same in
    every process and thread."""
    name = "relay_finish_" + hashlib.blake2b(sql.encode(), digest_size=10).hexdigest()
    pieces = sql.split("%s")
    if len(pieces) != n + 1:
        raise ValueError(f"finish statement: {len(pieces) - 1} placeholders for {n} parameters")
    if POOLED:  # sent whole, its values interpolated by psycopg2
        return name, "", sql
    body = pieces[0] + "".join(f"${i}{piece}" for i, piece in enumerate(pieces[1:], 1))
    return name, f"PREPARE {name} AS {body}", f"EXECUTE {name}({', '.join(['%s'] * n)})"


_column_types: dict = {}


def _types_of(table: str, columns: list[str]) -> list[str]:
    """The columns' types, for the casts of a prepared INSERT … SELECT (whose parameters have no column
    to take a type from). Without a length: a cast to varchar(n) would cut a longer value silently,
    where the column itself refuses it."""
    key = (table, tuple(columns))
    types = _column_types.get(key)
    if types is None:
        model = next(m for m in apps.get_models() if m._meta.db_table == table)
        by_column = {f.column: f for f in model._meta.concrete_fields}
        types = _column_types[key] = [re.sub(r"\(\d+\)$", "", by_column[c].db_type(connection)) for c in columns]
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
