"""Writes of usage events.

An event is written once per request_id. The unique constraint is the
guard, not a read-then-write: `INSERT … ON CONFLICT DO NOTHING` never raises
on a duplicate, so it is safe under races between replicas and does not
poison a caller's transaction (a batch item records its event in the same
transaction that finishes the item).
"""

from datetime import datetime

from django.db import connections, router

from usage.models import UsageEvent
from usage.tokens import Tokens

_ERROR_MESSAGE_MAX = UsageEvent._meta.get_field("error_message").max_length
# Every column but the id, in one fixed order: the INSERT below is written once, not
# compiled by the ORM per event (that compilation was ~a tenth of a live request's CPU).
_FIELDS = [f for f in UsageEvent._meta.concrete_fields if not f.primary_key]
_NAMES = frozenset(f.attname for f in _FIELDS) | frozenset(f.name for f in _FIELDS)
_COLUMNS = [f.column for f in _FIELDS]
_SQL: dict[str, str] = {}
# Columns whose database value is the Python value itself when it is a str, an int or None: the
# per-field `get_db_prep_save` (most of an event's preparation) is skipped for them.
_PLAIN = {
    f.attname
    for f in _FIELDS
    if f.get_internal_type()
    in {
        "CharField",
        "TextField",
        "IntegerField",
        "BigIntegerField",
        "PositiveIntegerField",
        "SmallIntegerField",
        "PositiveSmallIntegerField",
        "PositiveBigIntegerField",
    }
}
_DATETIMES = frozenset(f.attname for f in _FIELDS if f.get_internal_type() == "DateTimeField")
_NO_DEFAULT = object()


def _constant_default(field):
    """The field's default as its database value, when that is the same on every database: a constant
    default (no callable) that a str, int or bool column stores as it is (a TextChoices member is its
    own value for a CharField, as `get_prep_value` returns it); else _NO_DEFAULT."""
    if not field.has_default() or callable(field.default):
        return _NO_DEFAULT
    value = field.get_default()
    if field.attname in _PLAIN and (type(value) is int or isinstance(value, str)):
        return value
    if field.get_internal_type() == "BooleanField" and type(value) is bool:
        return value
    return _NO_DEFAULT


# (attname, its default's database value or _NO_DEFAULT, whether a str/int value goes as it is, whether a
# datetime, the field), per column, worked out once: the loop below ran `get_default` and `get_db_prep_save`
# for most of the ~30 columns of every event (measured: 30 → 15 µs per event; event_row was 3% of the item
# worker's GIL samples in a drain).
_PLAN = [(f.attname, _constant_default(f), f.attname in _PLAIN, f.attname in _DATETIMES, f) for f in _FIELDS]


def _insert_sql(connection) -> str:
    sql = _SQL.get(connection.alias)
    if sql is None:
        qn = connection.ops.quote_name
        cols = ", ".join(qn(f.column) for f in _FIELDS)
        marks = ", ".join(["%s"] * len(_FIELDS))
        # ON CONFLICT DO NOTHING: PostgreSQL and SQLite (3.24+) both take it without a target.
        sql = f"INSERT INTO {qn(UsageEvent._meta.db_table)} ({cols}) VALUES ({marks}) ON CONFLICT DO NOTHING"
        _SQL[connection.alias] = sql
    return sql


def event_row(connection, *, tokens: Tokens | None = None, **fields) -> tuple[str, list[str], list]:
    """The event as (table, columns, values) ready for an INSERT, checked as `record_event` checks it: for a
    caller that writes it inside a statement of its own (a batch item's one-statement finish)."""
    if not fields.get("request_id"):
        # "" would be a real key under the unique constraint and swallow every later event.
        raise ValueError("record_event needs a request_id")
    if tokens is not None:
        fields.update(
            input_tokens=tokens.input,
            output_tokens=tokens.output,
            cache_read_tokens=tokens.cache_read,
            cache_write_tokens=tokens.cache_write,
        )
    if "error_message" in fields:
        fields["error_message"] = fields["error_message"][:_ERROR_MESSAGE_MAX]
    unknown = set(fields) - _NAMES
    if unknown:
        raise TypeError(f"UsageEvent has no field(s) {sorted(unknown)}")
    values = []
    aware_as_is = connection.vendor == "postgresql"  # an aware datetime is its own database value there
    for name, default, plain, is_datetime, f in _PLAN:
        if name in fields:
            value = fields[name]
        elif default is not _NO_DEFAULT:
            values.append(default)
            continue
        else:
            value = f.get_default()
        if plain and (value is None or type(value) in (str, int)):
            pass
        elif is_datetime and aware_as_is and type(value) is datetime and value.tzinfo is not None:
            pass
        else:
            value = f.get_db_prep_save(value, connection)
        values.append(value)
    return UsageEvent._meta.db_table, _COLUMNS, values


def record_event(*, tokens: Tokens | None = None, fetch: bool = True, **fields) -> UsageEvent | None:
    """Record the event for `fields["request_id"]`, or return the one already recorded.

    `fields` are UsageEvent fields; `tokens`, when given, fills the four token
    columns. A long upstream error body is cut to fit rather than refused.
    The request paths pass `fetch=False`: they never look at the row again, so
    they skip reading it back (one query less per request and per item).
    """
    connection = connections[router.db_for_write(UsageEvent)]
    _, _, values = event_row(connection, tokens=tokens, **fields)
    with connection.cursor() as cursor:
        cursor.execute(_insert_sql(connection), values)
    if not fetch:
        return None
    # Either ours or the first writer's; under READ COMMITTED this statement
    # sees a concurrent writer's row once its INSERT waited for it to commit.
    return UsageEvent.objects.get(request_id=fields["request_id"])


def record_events(events: list[dict]) -> None:
    """Record many events in one round trip (written once per request_id, as `record_event`): the results
    of a provider batch job, written a chunk at a time in the transaction that finishes their items."""
    if not events:
        return
    connection = connections[router.db_for_write(UsageEvent)]
    rows = [event_row(connection, **fields)[2] for fields in events]
    with connection.cursor() as cursor:
        cursor.executemany(_insert_sql(connection), rows)
