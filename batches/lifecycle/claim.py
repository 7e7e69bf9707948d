"""The fair claim: available → running for the next item, fairest batch first, with SKIP LOCKED; the
claim statements prepared once per connection; a held finish sent in front of a claim (finish.py)."""

import logging

from django.conf import settings
from django.db import connection
from django.db.models import Count, Q
from django.utils import timezone

from batches.lifecycle import finish, sql, stop
from batches.lifecycle.states import CLAIMABLE, CLAIMABLE_SQL, S, St, due
from batches.models import Batch, Item, Surface

log = logging.getLogger(__name__)

# Claims, on PostgreSQL. Every scan is index-backed and reads only live rows of the batch it looks at,
# so a claim costs the same at the 50,000th item of a batch as at the first, with or without vacuum:
# - the running items of a batch: the partial index item_running (a few entries per batch: the slots);
# - its next available item: the partial index item_available on (batch, idx), in idx order (the
#   `not_before` test is a filter on the rows that index returns; only items waiting out a backoff
#   are passed over).
# Batches that may run now, fairest first: fewest running items (an index-only count over the partial
# index item_running: the few running rows of that batch), then the oldest.
_FAIR_ORDER = f"""
    SELECT b.id FROM batches_batch b
    WHERE b.status IN ({CLAIMABLE_SQL}) AND (b.not_before IS NULL OR b.not_before <= %(now)s)
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
SELECT {pending} AS pending, {columns},
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
        ORDER BY idx LIMIT 1) IS NOT NULL
    OR EXISTS (SELECT 1 FROM batches_item WHERE batch_id = %(check)s::uuid AND state = 'delegated'))"""
# One statement in the usual case: the fairest batch and its next item.
# The claimed item's columns by name (a function behind a pooler returns named, typed columns: `_RESULT`).
_ITEM_COLUMNS = [f.column for f in Item._meta.concrete_fields]
_COLUMNS = ", ".join(f'claimed."{c}"' for c in _ITEM_COLUMNS)
_RESULT = [
    ("pending", "boolean"),
    *zip(_ITEM_COLUMNS, sql.column_types(Item, _ITEM_COLUMNS), strict=True),
    ("async_commit", "text"),
]
_CLAIM_FAIREST_SQL = _CLAIM_TEMPLATE.format(pick=_FAIR_ORDER + " LIMIT 1", pending=_CHECK_PENDING, columns=_COLUMNS)
# When the fairest batch had nothing to run now (its items all running or waiting): the next ones.
_CLAIMABLE_BATCHES_SQL = _FAIR_ORDER + " LIMIT 20"
_CLAIM_IN_BATCH_SQL = _CLAIM_TEMPLATE.format(pick="SELECT %(batch)s::uuid AS id", pending="true", columns=_COLUMNS)


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
            stop.complete_if_done(check)
        return _claim_embedded(owner, now)
    lease = now + timezone.timedelta(seconds=settings.RELAY_BATCH_LEASE_SECONDS)
    params = {"owner": owner, "now": now, "lease": lease, "floor_batch": None, "floor": 0, "check": check}
    if floor is not None:
        params["floor_batch"], params["floor"] = floor
    front = getattr(finish.thread_state, "front", None)
    item, pending = _claim_one(_CLAIM_FAIREST_SQL, params)
    if front is not None and front.sent and check is not None and (item is None or item.batch_id != check):
        # The finish in front shared this claim's snapshot, which predates its own commit and any other
        # process's finish committing beside it: `pending` may be stale for `check`. Checked again now
        # that both committed (a claim in the same batch needs no check: its item is pending).
        pending = False
    if not pending:
        stop.complete_if_done(check)
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


_CLAIM_STATEMENTS = {
    _CLAIM_FAIREST_SQL: (
        "relay_claim_fairest",
        *sql.statement_forms("relay_claim_fairest", _CLAIM_FAIREST_SQL, _RESULT),
    ),
    _CLAIM_IN_BATCH_SQL: (
        "relay_claim_in_batch",
        *sql.statement_forms("relay_claim_in_batch", _CLAIM_IN_BATCH_SQL, _RESULT),
    ),
}
_item_columns: tuple | None = None


def warm_up() -> None:
    """Connect, and prepare the claim statements on that connection (a worker process's start)."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        prepared = sql.prepared_on.setdefault(connection.connection, set())
        for name, prepare, execute, _, _ in _CLAIM_STATEMENTS.values():
            if name not in prepared:
                sql.prepare(cursor, prepared, name, prepare, execute)


def _claim_one(statement: str, params: dict) -> tuple[Item | None, bool]:
    """Run a claim statement: (the claimed item or None, `pending`). The row becomes an Item through
    `Model.from_db` (what a queryset does per row), without a RawQuerySet's per-query set-up. A finish
    held for this thread's next claim (`in_front_of_claim`) goes first, in the same round trip and
    transaction: a query string of two statements, one implicit transaction, committed synchronously."""
    global _item_columns
    name, prepare, execute, positional, used = _CLAIM_STATEMENTS[statement]
    front = getattr(finish.thread_state, "front", None)
    with connection.cursor() as cursor:
        prepared = sql.prepared_on.setdefault(connection.connection, set())
        if name not in prepared:
            sql.prepare(cursor, prepared, name, prepare, execute)
        if front is None or front.sent:
            cursor.execute(execute, {**params, "async_commit": True})
        else:
            if front.name not in prepared:
                sql.ensure(cursor, prepared, front.name, front.prepare)
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


def hold(batch_id, ids, until) -> int:
    """Available items of a batch wait until `until` (a host's capacity their records need): their
    `not_before`, never made earlier than it was, so the claim passes them over until then. The state
    does not change (an item waits in `available`, design §4)."""
    return (
        Item.objects.filter(batch_id=batch_id, pk__in=list(ids), state=St.AVAILABLE)
        .filter(Q(not_before__isnull=True) | Q(not_before__lt=until))
        .update(not_before=until)
    )


def batch_started(batch_id) -> None:
    """A native batch's first claim: queued → running (a no-op once it runs)."""
    Batch.objects.filter(pk=batch_id, surface=Surface.NATIVE, status=S.QUEUED).update(status=S.RUNNING)
