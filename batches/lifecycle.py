"""The one home of batch and item state: every change of `Batch.status` or `Item.state` is made here.

Other modules ask this one; they never write `status`/`state` themselves
(inserting new rows aside: a batch is created in its first status, items in
`available`, or `discarded` for a record validation refused). The moves:

Relay-native batch (spec 000)::

    queued ──first claim──▶ running ──last item final──▶ completed
       └──────────┴──cancel──▶ cancelled (completed_at once its last running item stops)

OpenAI-surface batch (spec 003)::

    validating ──▶ in_progress ──▶ finalizing ──▶ completed | expired
        │  └──▶ failed               ▲
        ├──────────┴──window closed──┘
        └──────────┴──cancel──▶ cancelling ──▶ cancelled

Anthropic-surface batch (Message Batches)::

    in_progress ──last item final──▶ completed | expired   (expired once the window closed: expired_at)
        └──cancel──▶ cancelling ──last item final──▶ cancelled

Item::

    available ──claim──▶ running ──finish──▶ completed | discarded | cancelled
        │                   └──lease expired / wait / retry──▶ available
        └──cancel / expiry──▶ cancelled

A move is one conditional UPDATE whose WHERE names the statuses the table
allows it from, so two processes racing for the same move cannot both make
it, and a move the table does not allow is refused before it reaches SQL.

Completion is checked *after* the finishing transaction commits
(`complete_if_done` on commit): whichever of several items finishing together
commits last sees every other one final, so a batch is finalized at once
without a lock on its row and without waiting for the sweeper.

Work is handed to Celery by task name (`hand_off`, `wake_workers`), never by
importing `batches.tasks`, so nothing in `batches/` imports in a circle.
"""

import hashlib
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from contextlib import contextmanager

from django.conf import settings
from django.db import OperationalError, connection, models, transaction
from django.db.models import Count, Exists, F, OuterRef, Q
from django.utils import timezone

from batches.models import (
    ANTHROPIC_STATUS_STAMP,
    CLAIMABLE_STATUSES,
    OPENAI_STATUS_STAMP,
    PENDING_STATES,
    Batch,
    BatchStatus,
    Item,
    ItemState,
    Surface,
)
from batches.outcomes import Code
from relay.errors import RelayError

log = logging.getLogger(__name__)

S, St = BatchStatus, ItemState

# --- queues -------------------------------------------------------------------------------------

# Item work: one wake-up message runs items in one of a worker's 8 slots.
ITEM_QUEUE = "batch"
# Control work (sweeping, validation, finalization): never takes an item slot.
CONTROL_QUEUE = "control"

# --- the transition tables ----------------------------------------------------------------------

NATIVE_TRANSITIONS: dict[str, frozenset] = {
    S.QUEUED: frozenset({S.RUNNING, S.COMPLETED, S.CANCELLED}),
    S.RUNNING: frozenset({S.COMPLETED, S.CANCELLED}),
    S.COMPLETED: frozenset(),
    S.CANCELLED: frozenset(),
}
OPENAI_TRANSITIONS: dict[str, frozenset] = {
    S.VALIDATING: frozenset({S.IN_PROGRESS, S.FAILED, S.CANCELLING, S.FINALIZING}),
    S.IN_PROGRESS: frozenset({S.FINALIZING, S.CANCELLING}),
    S.FINALIZING: frozenset({S.COMPLETED, S.EXPIRED}),
    S.CANCELLING: frozenset({S.CANCELLED}),
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.EXPIRED: frozenset(),
    S.CANCELLED: frozenset(),
}
# No validation or finalizing step: items are stored at create and results are read from them.
ANTHROPIC_TRANSITIONS: dict[str, frozenset] = {
    S.IN_PROGRESS: frozenset({S.COMPLETED, S.EXPIRED, S.CANCELLING}),
    S.CANCELLING: frozenset({S.CANCELLED}),
    S.COMPLETED: frozenset(),
    S.EXPIRED: frozenset(),
    S.CANCELLED: frozenset(),
}
TRANSITIONS = {
    Surface.NATIVE: NATIVE_TRANSITIONS,
    Surface.OPENAI: OPENAI_TRANSITIONS,
    Surface.ANTHROPIC: ANTHROPIC_TRANSITIONS,
}

ITEM_TRANSITIONS: dict[str, frozenset] = {
    St.AVAILABLE: frozenset({St.RUNNING, St.CANCELLED}),
    St.RUNNING: frozenset({St.AVAILABLE, St.COMPLETED, St.DISCARDED, St.CANCELLED}),
    St.COMPLETED: frozenset(),
    St.DISCARDED: frozenset(),
    St.CANCELLED: frozenset(),
}

# --- named groups -------------------------------------------------------------------------------

# Statuses with work still to come, per surface (a native batch that is `cancelled`
# may still have running items; it is done once completed_at is set).
OPEN = {
    Surface.NATIVE: (S.QUEUED, S.RUNNING),
    Surface.OPENAI: (S.VALIDATING, S.IN_PROGRESS, S.FINALIZING, S.CANCELLING),
    Surface.ANTHROPIC: (S.IN_PROGRESS, S.CANCELLING),
}
TERMINAL = (S.COMPLETED, S.CANCELLED, S.FAILED, S.EXPIRED)
# Batches whose available items a worker may claim (a validating OpenAI batch has no
# items yet; a cancelling or finalizing one starts no new work). Defined in models,
# where an index condition needs it.
CLAIMABLE = CLAIMABLE_STATUSES

# OpenAI batches that cancel or expiry may still stop.
OPENAI_STOPPABLE = (S.VALIDATING, S.IN_PROGRESS)
NATIVE_STAMP = {S.COMPLETED: "completed_at"}
STAMPS = {Surface.NATIVE: NATIVE_STAMP, Surface.OPENAI: OPENAI_STATUS_STAMP, Surface.ANTHROPIC: ANTHROPIC_STATUS_STAMP}
# Anthropic's processing_status of each status: `ended` once every request has a result.
ANTHROPIC_PROCESSING_STATUS = {
    S.IN_PROGRESS: "in_progress",
    S.CANCELLING: "canceling",
    S.COMPLETED: "ended",
    S.EXPIRED: "ended",
    S.CANCELLED: "ended",
}
ANTHROPIC_ENDED = (S.COMPLETED, S.EXPIRED, S.CANCELLED)

CANCELLED_ERROR = "batch: cancelled"
EXPIRED_ERROR = "batch: the completion window ended before this request ran"
_STOP_MESSAGES = {Code.BATCH_CANCELLED: CANCELLED_ERROR, Code.BATCH_EXPIRED: EXPIRED_ERROR}


class IllegalTransition(Exception):
    """A move the transition table does not allow (a programming error, never a client's)."""


def sources(surface: str, to: str, frm: Iterable[str] | None = None) -> list[str]:
    """The statuses a batch of `surface` may move to `to` from (limited to `frm` when given)."""
    allowed = [s for s, targets in TRANSITIONS[surface].items() if to in targets]
    if frm is not None:
        wanted = set(frm)
        allowed = [s for s in allowed if s in wanted]
    if not allowed:
        raise IllegalTransition(f"{surface} batch: no move to {to!r} from {sorted(frm) if frm else 'anywhere'}")
    return allowed


def move(batch_id, surface: str, to: str, *, frm: Iterable[str] | None = None, **fields) -> bool:
    """Move a batch to `to` if it is in a status the table allows (and `frm` names). True if it moved.

    The status's timestamp is stamped unless the caller passes it (OpenAI:
    in_progress_at, finalizing_at, …; native: completed_at; Anthropic: cancelling_at, completed_at).
    """
    allowed = sources(surface, to, frm)
    stamp = STAMPS[surface].get(to)
    if stamp and stamp not in fields:
        fields[stamp] = timezone.now()
    return Batch.objects.filter(pk=batch_id, surface=surface, status__in=allowed).update(status=to, **fields) > 0


# Validation and finalization do file work between statements while they hold their batch's row:
# the session-wide idle-in-transaction timeout (meant for a frozen process) would kill a large one.
LONG_TRANSACTION_IDLE_MS = 10 * 60 * 1000


def allow_long_transaction() -> None:
    """Inside a control job's transaction: let it idle between statements for up to 10 minutes."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL idle_in_transaction_session_timeout = {LONG_TRANSACTION_IDLE_MS}")


def lock(batch_id, surface: str, statuses: Iterable[str]) -> Batch | None:
    """The batch, row-locked, if it is in one of `statuses`; None if not, or if another process holds it.

    Call inside a transaction. SKIP LOCKED: control work never waits on a row
    another process holds; the holder is doing the same job, or the next sweep retries.
    """
    qs = Batch.objects.filter(pk=batch_id, surface=surface, status__in=list(statuses))
    if connection.vendor == "postgresql":
        qs = qs.select_for_update(skip_locked=True)
    return qs.first()


# --- item moves ---------------------------------------------------------------------------------


def cancel_pending_items(batch_id, code: str = Code.BATCH_CANCELLED) -> int:
    """available → cancelled for one batch (cancel or expiry); running items stop at their heartbeat."""
    return Item.objects.filter(batch_id=batch_id, state=St.AVAILABLE).update(
        state=St.CANCELLED, finished_at=timezone.now(), error=_STOP_MESSAGES[code], error_code=code
    )


# Claims, on PostgreSQL. Every scan is index-backed and reads only live rows of the batch it looks at,
# so a claim costs the same at the 50,000th item of a batch as at the first, with or without vacuum:
# - the running items of a batch: the partial index item_running (a few entries per batch: the slots);
# - its next available item: the partial index item_available on (batch, idx), in idx order (the
#   `not_before` test is a filter on the rows that index returns; only items waiting out a backoff
#   are passed over).
_CLAIMABLE_SQL = ", ".join(f"'{s}'" for s in CLAIMABLE)
# Batches that may run now, fairest first: fewest running items (an index-only count over the partial
# index item_running: the few running rows of that batch), then the oldest.
_FAIR_ORDER = f"""
    SELECT b.id FROM batches_batch b
    WHERE b.status IN ({_CLAIMABLE_SQL}) AND (b.not_before IS NULL OR b.not_before <= %(now)s)
    ORDER BY (SELECT count(*) FROM batches_item r WHERE r.batch_id = b.id AND r.state = 'running'), b.created_at"""
# available → running for the batch's next item (partial index item_available on (batch, idx), in idx
# order; the not_before test filters the rows it returns, so only items waiting out a backoff are
# passed over). `idx >= floor`: the drain's last claim in that batch, so the scan starts past the index
# entries of items already claimed, which stay in the index until a vacuum; the first claim of every
# drain, and the fallback below, have no floor, so an item released behind it is never left behind.
# A native batch's first claim also moves it queued → running (a no-op after that).
_CLAIM_TEMPLATE = """
WITH pick AS MATERIALIZED ({pick}),
claimed AS (
    UPDATE batches_item SET state = 'running', attempt = attempt + 1, lease_owner = %(owner)s,
           lease_expires_at = %(lease)s, started_at = %(now)s, not_before = NULL
    WHERE id = (
        SELECT id FROM batches_item
        WHERE batch_id = (SELECT id FROM pick)
          AND idx >= (SELECT CASE WHEN id = %(floor_batch)s THEN %(floor)s ELSE 0 END FROM pick)
          AND state = 'available' AND (not_before IS NULL OR not_before <= %(now)s)
        ORDER BY idx LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING *
),
started AS (
    UPDATE batches_batch SET status = 'running'
    WHERE id = (SELECT batch_id FROM claimed) AND surface = 'native' AND status = 'queued'
)
SELECT {pending} AS pending, claimed.*,
       CASE WHEN %(async_commit)s THEN set_config('synchronous_commit', 'off', true) END AS async_commit
FROM (SELECT 1) AS one LEFT JOIN claimed ON true
"""
# A claim on its own commits without waiting for its WAL to reach the disk (synchronous_commit off for
# its own transaction only: `async_commit`). A claim is not work: the item's finish, a synchronous
# commit, flushes the WAL up to its own record and with it the claim's. Only a PostgreSQL crash inside
# the WAL writer's delay (200 ms) after a claim can lose it; the item is then available again and runs
# once more, as after a worker killed mid-call, and the lost claim's finish is refused by its fence.
# perf of the backends in a drain: the commits' fdatasync was 17% of their CPU, two per item before.
# A claim that carries a finish in front of it (`HeldFinish`) commits synchronously, for the finish.
# `pending`: does the batch of the drain's previous item (`check`, finished by an earlier, committed
# statement) still have an item available or running? The completion check of that finish, made by the
# next claim rather than by a statement of its own; as race-free as the separate check (it reads a
# snapshot taken after that finish committed; an item this statement claims counts as pending). Always
# one row: the claimed item's columns are NULL when nothing was claimed. The usual case (the claim took
# the next item of that same batch) answers without a probe: PostgreSQL evaluates OR from the left and
# runs a sub-select only when reached, so the probes (which walk index entries of rows that left the
# state, until a vacuum) run only when the drain moves to another batch or finds nothing.
_CHECK_PENDING = """(%(check)s::uuid IS NULL OR claimed.batch_id = %(check)s::uuid
    OR EXISTS (SELECT 1 FROM batches_item WHERE batch_id = %(check)s::uuid AND state = 'running')
    OR (SELECT idx FROM batches_item WHERE batch_id = %(check)s::uuid AND state = 'available'
        ORDER BY idx LIMIT 1) IS NOT NULL)"""
# One statement in the usual case: the fairest batch and its next item.
_CLAIM_FAIREST_SQL = _CLAIM_TEMPLATE.format(pick=_FAIR_ORDER + " LIMIT 1", pending=_CHECK_PENDING)
# When the fairest batch had nothing to run now (its items all running or waiting): the next ones.
_CLAIMABLE_BATCHES_SQL = _FAIR_ORDER + " LIMIT 20"
_CLAIM_IN_BATCH_SQL = _CLAIM_TEMPLATE.format(pick="SELECT %(batch)s::uuid AS id", pending="true")


def due(now) -> Q:
    """Rows (items or batches) whose `not_before` has passed: a claim may take them."""
    return Q(not_before__isnull=True) | Q(not_before__lte=now)


def claim(owner: str, floor: tuple | None = None, check=None) -> Item | None:
    """available → running for the next item, fairly: of the batches that may run now, the one with the
    fewest running items first (then the oldest), so a small batch submitted after a huge one is not
    starved. None if nothing is claimable. `floor`: (batch id, idx) of the caller's last claim.
    `check`: a batch whose item the caller finished without checking its completion (the drain): the
    claim checks it (`complete_if_done` when nothing of it is pending), so the drain's finish and
    completion check cost no statement of their own.

    PostgreSQL: one statement in the usual case (pick the batch, take its next item with SKIP LOCKED, start
    a queued native batch, check `check`'s completion); when that finds nothing, one more to list the
    batches in the same order and one claim (without floor) per batch tried. Its cost does not grow with
    the table.
    """
    now = timezone.now()
    if connection.vendor != "postgresql":
        if check is not None:
            complete_if_done(check)
        return _claim_embedded(owner, now)
    lease = now + timezone.timedelta(seconds=settings.RELAY_BATCH_LEASE_SECONDS)
    params = {"owner": owner, "now": now, "lease": lease, "floor_batch": None, "floor": 0, "check": check}
    if floor is not None:
        params["floor_batch"], params["floor"] = floor
    front = getattr(_held, "front", None)
    item, pending = _claim_one(_CLAIM_FAIREST_SQL, params)
    if front is not None and front.sent and check is not None and (item is None or item.batch_id != check):
        # The finish in front shared this claim's snapshot, which predates its own commit and any other
        # process's finish committing beside it: `pending` may be stale for `check`. Checked again now
        # that both committed (a claim in the same batch needs no check: its item is pending).
        pending = False
    if not pending:
        complete_if_done(check)
    if item is not None:
        return item
    params["floor_batch"], params["floor"] = None, 0
    with connection.cursor() as cursor:
        cursor.execute(_CLAIMABLE_BATCHES_SQL, params)
        batches = [row[0] for row in cursor.fetchall()]
    for batch_id in batches:
        item, _ = _claim_one(_CLAIM_IN_BATCH_SQL, {**params, "batch": batch_id})
        if item is not None:
            return item
    return None


# The claim statements as server-side prepared statements, one per database connection: PostgreSQL
# plans the CTE once per connection (a generic plan after five runs) instead of at every claim, where the
# planning cost several times the execution (~0.3 ms against ~0.05 ms, measured on the benchmark's table).
_PARAM_TYPES = {
    "owner": "text",
    "now": "timestamptz",
    "lease": "timestamptz",
    "floor_batch": "uuid",
    "floor": "integer",
    "check": "uuid",
    "batch": "uuid",
    "async_commit": "boolean",
}
_prepared_on: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DB-API connection → names


def _prepared(name: str, sql: str) -> tuple[str, str, str, tuple[str, ...]]:
    """(PREPARE, EXECUTE, the EXECUTE with positional %s, their parameters' names) of a statement written
    with %(name)s parameters (those of _PARAM_TYPES). The positional form goes behind a held finish."""
    used = [n for n in _PARAM_TYPES if f"%({n})s" in sql]
    body = sql
    for i, n in enumerate(used, 1):
        body = body.replace(f"%({n})s", f"${i}")
    types = ", ".join(_PARAM_TYPES[n] for n in used)
    return (
        f"PREPARE {name}({types}) AS {body}",
        f"EXECUTE {name}({', '.join(f'%({n})s' for n in used)})",
        f"EXECUTE {name}({', '.join(['%s'] * len(used))})",
        tuple(used),
    )


_CLAIM_STATEMENTS = {
    _CLAIM_FAIREST_SQL: ("relay_claim_fairest", *_prepared("relay_claim_fairest", _CLAIM_FAIREST_SQL)),
    _CLAIM_IN_BATCH_SQL: ("relay_claim_in_batch", *_prepared("relay_claim_in_batch", _CLAIM_IN_BATCH_SQL)),
}
_item_columns: tuple | None = None


# A claim statement is planned once per connection, generically, with sorts disabled while it is
# planned. Otherwise, on stale statistics (no ANALYZE since the batch's rows were written: autovacuum
# off, as on this machine and in CI), the planner reads every available item of the batch through
# item_batch_state and sorts them, at every claim (EXPLAIN ANALYZE, 50,000-item batch with 45,000
# available: 44,993 rows and an external sort spilling to disk), instead of walking item_available in
# idx order to the first one. The session keeps plan_cache_mode = force_generic_plan so that this plan
# is the one used (the setting concerns prepared statements only, and these are the only ones the relay
# makes); an ANALYZE of the table makes PostgreSQL plan it again, then with statistics that show the
# batch's size.
_PLAN_PARAMS = dict.fromkeys(_PARAM_TYPES) | {"owner": "", "floor": 0}


def _prepare(cursor, prepared: set, name: str, prepare: str, execute: str) -> None:
    cursor.execute(prepare)  # PREPARE is not undone by a rollback: once per connection
    cursor.execute("SET plan_cache_mode = force_generic_plan")
    # jit off too: the planner decides JIT from the plan's cost, which a disabled sort inflates (the fair
    # order's sort of the batches stays: ~500 ms of LLVM compilation per execution otherwise).
    cursor.execute("SET enable_sort = off")
    cursor.execute("SET jit = off")
    try:
        cursor.execute("EXPLAIN " + execute, _PLAN_PARAMS)  # builds and keeps the generic plan
    finally:
        cursor.execute("RESET enable_sort")
        cursor.execute("RESET jit")
    prepared.add(name)


def warm_up() -> None:
    """Connect, and prepare the claim statements on that connection (a worker process's start)."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        prepared = _prepared_on.setdefault(connection.connection, set())
        for name, prepare, execute, _, _ in _CLAIM_STATEMENTS.values():
            if name not in prepared:
                _prepare(cursor, prepared, name, prepare, execute)


def _claim_one(sql: str, params: dict) -> tuple[Item | None, bool]:
    """Run a claim statement: (the claimed item or None, `pending`). The row becomes an Item through
    `Model.from_db` (what a queryset does per row), without a RawQuerySet's per-query set-up. A finish
    held for this thread's next claim (`in_front_of_claim`) goes first, in the same round trip and
    transaction: a query string of two statements, one implicit transaction, committed synchronously."""
    global _item_columns
    name, prepare, execute, positional, used = _CLAIM_STATEMENTS[sql]
    front = getattr(_held, "front", None)
    with connection.cursor() as cursor:
        prepared = _prepared_on.setdefault(connection.connection, set())
        if name not in prepared:
            _prepare(cursor, prepared, name, prepare, execute)
        if front is None or front.sent:
            cursor.execute(execute, {**params, "async_commit": True})
        else:
            if front.name not in prepared:
                cursor.execute(front.prepare)
                prepared.add(front.name)
            values = {**params, "async_commit": False}
            cursor.execute(f"{front.execute};\n{positional}", [*front.params, *(values[n] for n in used)])
            front.sent = True  # committed: autocommit ends the implicit transaction with the query string
        row = cursor.fetchone()
        if _item_columns is None:
            names = [col[0] for col in cursor.description]
            fields = Item._meta.concrete_fields
            _item_columns = (tuple(f.attname for f in fields), tuple(names.index(f.column) for f in fields))
    attnames, at = _item_columns
    if row[at[0]] is None:  # the id: nothing was claimed
        return None, row[0]
    return Item.from_db(connection.alias, attnames, [row[i] for i in at]), row[0]


# Item has no field whose value needs converting on the way out of the database (as `from_db_value` would).
assert not any(hasattr(f, "from_db_value") for f in Item._meta.concrete_fields)


def claim_in_batch(batch_id, owner: str) -> Item | None:
    """available → running for this batch's next item (idx order); None if none is free now."""
    now = timezone.now()
    if connection.vendor != "postgresql":
        return _claim_embedded(owner, now, [batch_id])
    lease = now + timezone.timedelta(seconds=settings.RELAY_BATCH_LEASE_SECONDS)
    params = {"owner": owner, "now": now, "lease": lease, "batch": batch_id, "floor_batch": None, "floor": 0}
    return _claim_one(_CLAIM_IN_BATCH_SQL, params)[0]


def _claim_embedded(owner: str, now, batch_ids=None) -> Item | None:
    """SQLite (embedded mode) serialises writers, so a conditional UPDATE alone is the claim."""
    if batch_ids is None:
        running = dict(Item.objects.filter(state=St.RUNNING).values_list("batch_id").annotate(n=Count("id")).order_by())
        active = list(Batch.objects.filter(due(now), status__in=CLAIMABLE).values_list("id", "created_at"))
        active.sort(key=lambda b: (running.get(b[0], 0), b[1]))
        batch_ids = [b[0] for b in active[:20]]
    lease = now + timezone.timedelta(seconds=settings.RELAY_BATCH_LEASE_SECONDS)
    for batch_id in batch_ids:
        item = Item.objects.filter(due(now), batch_id=batch_id, state=St.AVAILABLE).order_by("idx").first()
        if item is None:
            continue
        updated = Item.objects.filter(pk=item.pk, state=St.AVAILABLE).update(
            state=St.RUNNING,
            attempt=item.attempt + 1,
            lease_owner=owner,
            lease_expires_at=lease,
            started_at=now,
            not_before=None,
        )
        if not updated:
            continue
        item.state, item.lease_owner, item.lease_expires_at, item.started_at = St.RUNNING, owner, lease, now
        item.attempt += 1
        item.not_before = None
        batch_started(batch_id)
        return item
    return None


def batch_started(batch_id) -> None:
    """A native batch's first claim: queued → running (a no-op once it runs)."""
    Batch.objects.filter(pk=batch_id, surface=Surface.NATIVE, status=S.QUEUED).update(status=S.RUNNING)


def _fenced(item: Item):
    """The item's row, only while this claim still holds it (state, lease owner, attempt)."""
    return Item.objects.filter(pk=item.pk, state=St.RUNNING, lease_owner=item.lease_owner, attempt=item.attempt)


def finish_item(item: Item, state: str, record: Callable[[], None], *, check_done: bool = True, **fields) -> bool:
    """running → `state` (final), fenced on the claim, with the usage event(s) in the same transaction.

    `record` writes the usage events and the attempt; it runs only when the
    fenced write won. False: the lease was lost (the sweeper gave the item to
    someone else) and nothing was written. The batch's completion is checked
    once this commits. Retried through a database outage (see `durably`).
    """
    if state not in ITEM_TRANSITIONS[St.RUNNING] or state == St.AVAILABLE:
        raise IllegalTransition(f"item: running → {state!r} is not a finish")

    def write() -> bool:
        with transaction.atomic():
            if not _fenced(item).update(state=state, finished_at=timezone.now(), lease_expires_at=None, **fields):
                return False
            record()
            if check_done:
                batch_id = item.batch_id
                transaction.on_commit(lambda: complete_if_done(batch_id))
        return True

    return durably(write)


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


def finish_item_at_once(
    item: Item, state: str, rows: list[tuple[str, list[str], list]], *, check_done: bool = True, **fields
) -> bool:
    """`finish_item` as one statement on PostgreSQL: the fenced running → `state` and the rows that go with
    it (the attempt, the usage events: (table, columns, values)) written by the same statement, only
    when the fenced update matched, and committed together, with no BEGIN/COMMIT round trips. Usage
    events keep their ON CONFLICT DO NOTHING (written once per request_id); other rows are plain
    INSERTs. Other databases: `finish_item` with the same rows. `check_done=False`: the caller checks the
    batch's completion itself, after this commits (the drain does it with its next claim: `claim(check=…)`).
    """
    if state not in ITEM_TRANSITIONS[St.RUNNING] or state == St.AVAILABLE:
        raise IllegalTransition(f"item: running → {state!r} is not a finish")
    if connection.vendor != "postgresql":

        def record() -> None:
            with connection.cursor() as cursor:
                for sql, params in _row_inserts(rows, ""):
                    cursor.execute(sql, params)

        return finish_item(item, state, record, check_done=check_done, **fields)
    sets = {"state": state, "finished_at": timezone.now(), "lease_expires_at": None, **fields}
    name, prepare, execute, preps = _finish_shape(tuple(sets), tuple((table, tuple(cols)) for table, cols, _ in rows))
    params = [v if prep is None else prep(v, connection) for prep, v in zip(preps, sets.values(), strict=True)]
    params += [item.pk, St.RUNNING, item.lease_owner, item.attempt]
    for _, _, values in rows:
        params += values

    def write() -> bool:
        with connection.cursor() as cursor:
            prepared = _prepared_on.setdefault(connection.connection, set())
            if name not in prepared:
                cursor.execute(prepare)  # PREPARE is not undone by a rollback: once per connection
                prepared.add(name)
            cursor.execute(execute, params)
            won = cursor.fetchone()[0] > 0
        if won and check_done:
            batch_id = item.batch_id
            transaction.on_commit(lambda: complete_if_done(batch_id))
        return won

    held = getattr(_held, "finish", None)
    if held is not None and held.execute is None and not check_done:
        held.name, held.prepare, held.execute, held.params = name, prepare, execute, params
        held.write = lambda: durably(write)
        return None
    return durably(write)


# A finish held back for the next claim (services._Bookkeeper pairs them): per thread.
_held = threading.local()


class HeldFinish:
    """A finish statement built but not yet run (`holding_finish`): it goes to PostgreSQL in front of
    this thread's next claim (`in_front_of_claim`), in one round trip and one transaction. The
    bookkeeper thread runs an item's finish and the next claim back to back; as one query string
    they cost one statement's client work, wake-ups and commit instead of two (measured with psycopg2
    on two prepared UPDATEs: 108 → 54 µs of the client's CPU and 195 → 135 µs of the backend's per pair).
    `sent`: committed with a claim. `write`: the finish alone, through `durably`, when no claim took
    it or the pair failed (the pair's transaction then wrote nothing). What the finish's fence
    matched is not reported when it went with a claim (the drain does not look at it)."""

    __slots__ = ("name", "prepare", "execute", "params", "write", "sent")

    def __init__(self):
        self.name = self.prepare = self.execute = self.params = self.write = None
        self.sent = False


@contextmanager
def holding_finish():
    """Within the block, a drain's finish on PostgreSQL (`finish_item_at_once` with check_done=False)
    is built and held, not run: the block yields the HeldFinish (its `execute` stays None when no
    finish was held)."""
    held = HeldFinish()
    _held.finish = held
    try:
        yield held
    finally:
        _held.finish = None


@contextmanager
def in_front_of_claim(held: HeldFinish):
    """Within the block, this thread's next claim statement carries `held` in front of it."""
    _held.front = held
    try:
        yield
    finally:
        _held.front = None


def _finish_shape(names: tuple[str, ...], rows: tuple[tuple[str, tuple[str, ...]], ...]):
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
    for i, (sql, values) in enumerate(_row_inserts([(t, list(c), c) for t, c in rows], " FROM fin", typed=True)):
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
        from django.apps import apps

        model = next(m for m in apps.get_models() if m._meta.db_table == table)
        by_column = {f.column: f for f in model._meta.concrete_fields}
        types = _column_types[key] = [re.sub(r"\(\d+\)$", "", by_column[c].db_type(connection)) for c in columns]
    return types


def _row_inserts(rows, source: str, typed: bool = False):
    """INSERT … SELECT <values>[ FROM fin] per row; usage events ON CONFLICT DO NOTHING. `typed`: each
    value cast to its column's type (a prepared statement's)."""
    from usage.models import UsageEvent

    qn = connection.ops.quote_name
    for table, columns, values in rows:
        cols = ", ".join(qn(c) for c in columns)
        if typed:
            marks = ", ".join(f"%s::{t}" for t in _types_of(table, columns))
        else:
            marks = ", ".join(["%s"] * len(values))
        conflict = " ON CONFLICT DO NOTHING" if table == UsageEvent._meta.db_table else ""
        yield f"INSERT INTO {qn(table)} ({cols}) SELECT {marks}{source}{conflict}", list(values)


def release_item(item: Item, not_before, record: Callable[[], None], *, counts: bool, pause_batch: bool) -> bool:
    """running → available until `not_before`, fenced on the claim: a retry (`counts`: it uses up an
    attempt) or a wait for capacity (`pause_batch`: the whole batch waits, it shares the capacity).

    `record` writes the attempt in the same transaction. A wake-up is scheduled for when the item is due.
    """

    def write() -> bool:
        with transaction.atomic():
            fields = {"state": St.AVAILABLE, "lease_owner": "", "lease_expires_at": None, "not_before": not_before}
            if counts:
                fields["retries"] = F("retries") + 1
            if not _fenced(item).update(**fields):
                return False
            record()
            flags = Batch.objects.filter(pk=item.batch_id).values_list("cancel_requested_at", "expired_at").first()
            if flags is not None and flags[0] is not None:
                # Cancelled or expired while this attempt ran: end the item now, not at the next sweep.
                cancel_pending_items(item.batch_id, Code.BATCH_EXPIRED if flags[1] else Code.BATCH_CANCELLED)
                batch_id = item.batch_id
                transaction.on_commit(lambda: complete_if_done(batch_id))
                return True
            if pause_batch:
                Batch.objects.filter(
                    Q(not_before__isnull=True) | Q(not_before__lt=not_before), pk=item.batch_id
                ).update(not_before=not_before)
        return True

    released = durably(write)
    if released:
        wake_at(not_before)
    return released


# Rows the sweeper changes are taken with SKIP LOCKED: a row held by a frozen process (a paused VM
# inside a finishing transaction) is passed over, never waited on.
_RESCUE_SQL = """
UPDATE batches_item SET state = 'available', lease_owner = '', lease_expires_at = NULL, retries = retries + 1
WHERE id IN (SELECT id FROM batches_item WHERE state = 'running' AND lease_expires_at < %s
             AND retries + 1 < max_attempts LIMIT 1000 FOR UPDATE SKIP LOCKED)
RETURNING id, batch_id, attempt, started_at
"""
_LOST_SQL = """
SELECT id, batch_id, attempt, started_at FROM batches_item
WHERE state = 'running' AND lease_expires_at < %s AND retries + 1 >= max_attempts
LIMIT 1000 FOR UPDATE SKIP LOCKED
"""


def rescue_expired_leases(now, record: Callable[[list], None]) -> int:
    """running → available for items whose lease ran out with attempts left (their worker died or froze);
    `record` writes their attempts (rows of id, batch_id, attempt, started_at) in the same transaction."""
    if connection.vendor != "postgresql":
        rows = list(
            Item.objects.filter(state=St.RUNNING, lease_expires_at__lt=now, retries__lt=F("max_attempts") - 1)
            .values_list("id", "batch_id", "attempt", "started_at")
            .order_by()[:1000]
        )
        rescued = []
        with transaction.atomic():
            for row in rows:  # SQLite serialises writers: one conditional UPDATE per row is the fence
                if Item.objects.filter(pk=row[0], state=St.RUNNING, lease_expires_at__lt=now).update(
                    state=St.AVAILABLE, lease_owner="", lease_expires_at=None, retries=F("retries") + 1
                ):
                    rescued.append(row)
            record(rescued)
        return len(rescued)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(_RESCUE_SQL, [now])
        rows = cursor.fetchall()
        record(rows)
    return len(rows)


def discard_lost_items(now, record: Callable[[object, object, int, object], None]) -> int:
    """running → discarded (worker_lost) for expired leases on their last attempt, each with its usage event
    and attempt (`record(item_id, batch_id, attempt, started_at)`), skipping rows another process holds."""
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(_LOST_SQL, [now])
                lost = cursor.fetchall()
        else:
            lost = list(
                Item.objects.filter(state=St.RUNNING, lease_expires_at__lt=now, retries__gte=F("max_attempts") - 1)
                .values_list("id", "batch_id", "attempt", "started_at")
                .order_by()[:1000]
            )
        for item_id, batch_id, attempt, started_at in lost:
            Item.objects.filter(pk=item_id).update(
                state=St.DISCARDED,
                finished_at=now,
                lease_owner="",
                lease_expires_at=None,
                error="batch: worker lost the item on every attempt",
                error_code=Code.WORKER_LOST,
            )
            record(item_id, batch_id, attempt, started_at)
        for batch_id in {row[1] for row in lost}:
            transaction.on_commit(lambda b=batch_id: complete_if_done(b))
    return len(lost)


# --- riding out a database restart ---------------------------------------------------------------

DURABLE_SECONDS = 60.0


def durably(write: Callable[[], bool], seconds: float = DURABLE_SECONDS) -> bool:
    """Run a fenced write, retrying it while the database is unreachable (a restart, a failover).

    The worker already holds the attempt's result; giving up would leave the
    item running until its lease runs out. The write is fenced on the claim,
    so a retry after a commit whose answer was lost matches nothing (False)
    and nothing is written twice.
    """
    from django.db import InterfaceError, OperationalError

    deadline, pause = time.monotonic() + seconds, 0.2
    while True:
        try:
            return write()
        except (OperationalError, InterfaceError):
            if time.monotonic() + pause > deadline:
                raise
            log.warning("database unavailable; retrying a batch write in %.1fs", pause, exc_info=True)
            connection.close()  # the next query opens a fresh connection
            time.sleep(pause)
            pause = min(pause * 2, 2.0)


# --- batch completion ---------------------------------------------------------------------------


# Index-backed whatever the table's statistics say (autovacuum may be off, as in CI): a running item
# through item_running, else the first available one through item_available in idx order. (An EXISTS
# over `state IN (...)` lets the planner pick a sequential scan that walks every finished row first.)
_PENDING_SQL = """
SELECT EXISTS (SELECT 1 FROM batches_item WHERE batch_id = %(batch)s AND state = 'running')
    OR (SELECT idx FROM batches_item WHERE batch_id = %(batch)s AND state = 'available' ORDER BY idx LIMIT 1)
       IS NOT NULL
"""


def has_pending_items(batch_id) -> bool:
    """Does the batch still have an item available or running? One indexed probe, whatever its size."""
    if connection.vendor != "postgresql":
        return Item.objects.filter(batch_id=batch_id, state__in=PENDING_STATES).exists()
    with connection.cursor() as cursor:
        cursor.execute(_PENDING_SQL, {"batch": batch_id})
        return cursor.fetchone()[0]


def complete_if_done(batch_id) -> bool:
    """Once every item is final: a native batch completes (or, cancelled, is stamped completed_at);
    an OpenAI batch moves to finalizing and its finalization is handed off; an Anthropic batch ends
    (completed, expired or cancelled: its results are read from the items). True when all are final.

    Idempotent and safe to call from anywhere, any number of times.
    """
    if has_pending_items(batch_id):
        return False
    row = Batch.objects.filter(pk=batch_id).values_list("surface", "status").first()
    if row is None:
        return True
    surface, status = row
    if surface == Surface.NATIVE:
        if status == S.CANCELLED:
            Batch.objects.filter(pk=batch_id, completed_at__isnull=True).update(completed_at=timezone.now())
        elif status in OPEN[Surface.NATIVE]:
            move(batch_id, surface, S.COMPLETED)
        return True
    if surface == Surface.ANTHROPIC:
        end_anthropic(batch_id, status)
        return True
    if status == S.IN_PROGRESS:
        move(batch_id, surface, S.FINALIZING, frm=[S.IN_PROGRESS])
        status = S.FINALIZING
    if status in (S.FINALIZING, S.CANCELLING):
        transaction.on_commit(lambda: hand_off("finalize_openai_batch", batch_id))
    return True


def unfinished_batches(limit: int = 100) -> list:
    """Open batches whose items are all final: what `complete_if_done` missed (a crash between commit and check)."""
    pending = Item.objects.filter(batch_id=OuterRef("pk"), state__in=PENDING_STATES)
    native = Q(surface=Surface.NATIVE, completed_at__isnull=True, status__in=[S.QUEUED, S.RUNNING, S.CANCELLED])
    openai = Q(surface=Surface.OPENAI, status__in=[S.IN_PROGRESS, S.FINALIZING, S.CANCELLING])
    anthropic = Q(surface=Surface.ANTHROPIC, status__in=OPEN[Surface.ANTHROPIC])
    return list(
        Batch.objects.filter(native | openai | anthropic)
        .filter(~Exists(pending))
        .values_list("id", "surface", "status", "finalizing_at", "cancelling_at")[:limit]
    )


# --- stopping a batch ---------------------------------------------------------------------------


def cancel_native(batch_id) -> None:
    """Cancel a native batch: pending items now; running ones at their next heartbeat, on every replica."""
    now = timezone.now()
    with transaction.atomic():
        Batch.objects.filter(pk=batch_id, cancel_requested_at__isnull=True).update(cancel_requested_at=now)
        move(batch_id, Surface.NATIVE, S.CANCELLED, frm=OPEN[Surface.NATIVE])
        cancel_pending_items(batch_id, Code.BATCH_CANCELLED)
    complete_if_done(batch_id)


def start_cancelling(batch_id, surface: str, frm) -> bool:
    """→ cancelling; pending items cancelled now, running ones stop at their next heartbeat (on every
    replica); cancelled once none is pending (complete_if_done). True if it moved."""
    now = timezone.now()
    try:
        with transaction.atomic():
            # Waits for a running validation (it holds the row; up to CANCEL_WAIT_MS, then BatchBusy)
            # and re-checks the status after it.
            _wait_for_row_lock(CANCEL_WAIT_MS)
            moved = move(batch_id, surface, S.CANCELLING, frm=frm, cancel_requested_at=now)
            if moved:
                cancel_pending_items(batch_id, Code.BATCH_CANCELLED)
    except OperationalError as exc:
        if getattr(exc.__cause__, "pgcode", None) == LOCK_NOT_AVAILABLE:
            raise BatchBusy() from exc
        raise
    if moved:
        complete_if_done(batch_id)
    return moved


CANCEL_WAIT_MS = 120_000


LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for lock_timeout


class BatchBusy(RelayError):
    """The batch's row stayed locked (a long validation) longer than a cancel waits for it: a clear
    503 to retry, in each surface's own envelope, rather than a 500."""

    def __init__(self):
        super().__init__(
            503,
            "batch_busy",
            "The batch is still being validated; retry the cancel shortly.",
            headers={"Retry-After": 5},
        )


def _wait_for_row_lock(ms: int) -> None:
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL lock_timeout = {int(ms)}")


def cancel_openai(batch_id) -> bool:
    """validating|in_progress → cancelling. True if it moved."""
    return start_cancelling(batch_id, Surface.OPENAI, OPENAI_STOPPABLE)


def expire_openai(batch_id, now) -> bool:
    """The window closed: validating|in_progress → finalizing (expired_at set); pending records end
    as batch_expired, running ones stop at their next heartbeat (they read the cancel flag)."""
    with transaction.atomic():
        if lock(batch_id, Surface.OPENAI, OPENAI_STOPPABLE) is None:
            return False  # finished meanwhile, or a validation holds it: the next sweep
        move(
            batch_id,
            Surface.OPENAI,
            S.FINALIZING,
            frm=OPENAI_STOPPABLE,
            finalizing_at=now,
            expired_at=now,
            cancel_requested_at=now,
        )
        cancel_pending_items(batch_id, Code.BATCH_EXPIRED)
    complete_if_done(batch_id)
    return True


def end_anthropic(batch_id, status: str) -> bool:
    """An Anthropic batch whose items are all final ends: cancelling → cancelled; in_progress → expired
    when its window closed (expired_at), else completed. Call once no item is pending."""
    if status == S.CANCELLING:
        return move(batch_id, Surface.ANTHROPIC, S.CANCELLED, frm=[S.CANCELLING])
    if status != S.IN_PROGRESS:
        return False
    expired = Batch.objects.filter(pk=batch_id, expired_at__isnull=False).exists()
    return move(batch_id, Surface.ANTHROPIC, S.EXPIRED if expired else S.COMPLETED, frm=[S.IN_PROGRESS])


def cancel_anthropic(batch_id) -> bool:
    """in_progress → cancelling. True if it moved."""
    return start_cancelling(batch_id, Surface.ANTHROPIC, [S.IN_PROGRESS])


def expire_anthropic(batch_id, now) -> bool:
    """The window closed on an in_progress Anthropic batch: expired_at is stamped (it stays in_progress,
    `processing_status` too, until its running requests stop); pending requests end as batch_expired,
    running ones stop at their next heartbeat; then it ends `expired`."""
    with transaction.atomic():
        stamped = Batch.objects.filter(
            pk=batch_id, surface=Surface.ANTHROPIC, status=S.IN_PROGRESS, expired_at__isnull=True
        ).update(expired_at=now, cancel_requested_at=now)
        if stamped:
            cancel_pending_items(batch_id, Code.BATCH_EXPIRED)
    if stamped:
        complete_if_done(batch_id)
    return bool(stamped)


def cancel_orphans() -> int:
    """Available items of batches whose cancel flag is set: a crash between the flag and the items."""
    n = 0
    flagged = (
        Item.objects.filter(state=St.AVAILABLE, batch__cancel_requested_at__isnull=False)
        .values_list("batch_id", "batch__expired_at")
        .distinct()[:100]
    )
    for batch_id, expired_at in flagged:
        n += cancel_pending_items(batch_id, Code.BATCH_EXPIRED if expired_at else Code.BATCH_CANCELLED)
        complete_if_done(batch_id)
    return n


# --- hand-offs to Celery ------------------------------------------------------------------------


def hand_off(task: str, batch_id, queue: str = CONTROL_QUEUE) -> None:
    """Send a control message (validate/finalize) by task name; if it is lost, the sweeper sends it again."""
    from relay.celery import app

    try:
        app.send_task(f"batches.tasks.{task}", args=[str(batch_id)], queue=queue)
    except Exception:  # the broker is down: the sweeper re-dispatches
        log.warning("could not hand off %s for batch %s", task, batch_id, exc_info=True)


def redispatch(task: str, batch_id) -> None:
    """At most one re-sent control message per batch per lease period, however often the sweeper runs."""
    import redis

    from relay.redis import get_redis

    try:
        key = f"batch_redispatch:{task}:{batch_id}"
        fresh = get_redis().set(key, 1, nx=True, ex=settings.RELAY_BATCH_LEASE_SECONDS)
    except redis.RedisError:
        return
    if fresh:
        hand_off(task, batch_id)


_broker_clients: dict = {}


def _broker_redis():
    """A plain client on a Redis broker, with kombu's queue key names ((client, key names of a queue)),
    or None when the broker is something else (then the broker's own connection is asked)."""
    from relay.celery import app

    url = app.conf.broker_url or ""
    pid = os.getpid()
    hit = _broker_clients.get(url)
    if hit is not None and hit[0] == pid:
        return hit[1:]
    if not url.startswith(("redis://", "rediss://")):
        return None
    import redis
    from kombu.transport.redis import PRIORITY_STEPS, Channel

    options = app.conf.broker_transport_options or {}
    prefix, steps = options.get("global_keyprefix", ""), options.get("priority_steps", PRIORITY_STEPS)

    def keys(queue: str) -> list[str]:  # kombu.transport.redis.Channel._q_for_pri over every step
        return [prefix + (f"{queue}{Channel.sep}{pri}" if pri else queue) for pri in steps]

    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    _broker_clients[url] = (pid, client, keys)
    return client, keys


def queue_length(queue: str) -> int | None:
    """Messages waiting in a broker queue (None if unreachable). On a Redis broker: one pipelined LLEN
    per priority key, what kombu's own queue_declare(passive=True) reads, without a pooled broker
    connection and channel per call (measured 3.3 ms of CPU and 6 ms per call that way; 0.08 ms so)."""
    from kombu.exceptions import ChannelError

    from relay.celery import app

    direct = _broker_redis()
    if direct is not None:
        import redis

        client, keys = direct
        try:
            pipe = client.pipeline(transaction=False)
            for key in keys(queue):
                pipe.llen(key)
            return sum(pipe.execute())
        except redis.RedisError:  # the broker is down: the sweeper will try again
            log.warning("could not read the length of queue %s", queue, exc_info=True)
            return None
    try:
        with app.connection_or_acquire() as conn:
            return conn.default_channel.queue_declare(queue=queue, passive=True).message_count
    except ChannelError:  # no such queue yet: nothing is waiting in it
        return 0
    except Exception:  # the broker is down: the sweeper will try again
        log.warning("could not read the length of queue %s", queue, exc_info=True)
        return None


# A batch that may run now with an item that may run now (indexed, as _PENDING_SQL).
_CLAIMABLE_WORK_SQL = f"""
SELECT EXISTS (
    SELECT 1 FROM batches_batch b
    WHERE b.status IN ({_CLAIMABLE_SQL}) AND (b.not_before IS NULL OR b.not_before <= %(now)s)
      AND (SELECT idx FROM batches_item i WHERE i.batch_id = b.id AND i.state = 'available'
           AND (i.not_before IS NULL OR i.not_before <= %(now)s) ORDER BY idx LIMIT 1) IS NOT NULL
)
"""


def has_claimable_work() -> bool:
    """Is any item claimable now (its batch may run, it is available and due)?"""
    now = timezone.now()
    if connection.vendor != "postgresql":
        return Item.objects.filter(due(now), state=St.AVAILABLE).exists()
    with connection.cursor() as cursor:
        cursor.execute(_CLAIMABLE_WORK_SQL, {"now": now})
        return cursor.fetchone()[0]


def wake_workers(known_work: bool = False) -> int:
    """Keep at most RELAY_BATCH_WAKEUP_WINDOW wake-ups queued while work is available (`known_work`: the
    caller just saw some, skip the check).

    Redis never holds one message per item: which item runs is decided at
    claim time. A lost wake-up only costs latency until the next sweep. The
    window bounds what one top-up queues, not the work in flight: every drain
    that finds work passes a wake-up on (`pass_on`), so in-flight work grows to
    every slot that consumes the queue, however many workers there are.
    """
    from relay.celery import app

    if not known_work and not has_claimable_work():
        return 0
    queued = queue_length(ITEM_QUEUE)
    if queued is None:
        return 0
    missing = max(0, settings.RELAY_BATCH_WAKEUP_WINDOW - queued)
    for _ in range(missing):
        app.send_task("batches.tasks.run_items", queue=ITEM_QUEUE)
    return missing


# Wake-ups a drain passes on: two, so idle slots fill in a doubling chain (3 hops for 8 slots, not 8).
# Measured (scale-out, 3 workers, 24 slots, 16 wake-ups queued by the submit): every slot busy 0.21-0.30 s
# after the 202 with one.
PASS_ON = 2


def pass_on() -> bool:
    """A drain found work: queue PASS_ON more wake-ups unless one is already waiting, so idle slots of any
    worker join in. Slots fill until a wake-up stays queued (every consuming slot is busy); when the work
    runs out, the few surplus wake-ups find nothing and end. True if they were sent."""
    from relay.celery import app

    if queue_length(ITEM_QUEUE) != 0:  # one is waiting (or the broker is down: the sweeper wakes them)
        return False
    try:
        for _ in range(PASS_ON):
            app.send_task("batches.tasks.run_items", queue=ITEM_QUEUE)
    except Exception:
        log.warning("could not pass a wake-up on", exc_info=True)
        return False
    return True


def wake_at(when) -> None:
    """Wake the workers when `when` comes (an item's backoff or a batch's wait ends), not at the next sweep.

    One delayed message per 100 ms slot however many items become due in it
    (deduplicated in Redis); the sweeper covers a lost one.
    """
    import redis

    from relay.celery import app
    from relay.redis import get_redis

    delay = max(0.0, (when - timezone.now()).total_seconds())
    slot = int(when.timestamp() * 10)
    try:
        if not get_redis().set(f"relay:wake_at:{slot}", 1, nx=True, ex=int(delay) + 60):
            return
    except redis.RedisError:
        return
    try:
        app.send_task("batches.tasks.wake", countdown=delay, queue=CONTROL_QUEUE)
    except Exception:  # the broker is down: the sweeper wakes them
        log.warning("could not schedule a wake-up", exc_info=True)
