"""How a batch ends: completion once no item is pending, cancel and expiry per surface, and the
cancelled items of a batch whose cancel outran them.

The transitions of each surface are here (only the lifecycle writes a status); which one a batch takes is
its surface object's choice (batches/surfaces/registry.py), which the loops below look up."""

import functools
import logging
import operator

from django.db import OperationalError, connection, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from batches import dispatch
from batches.errors import BatchBusy
from batches.lifecycle.states import OPEN, OPENAI_STOPPABLE, TERMINAL, S, St, lock, move
from batches.models import PENDING_STATES, Batch, Item, Surface
from batches.outcomes import Code
from batches.surfaces import registry

log = logging.getLogger(__name__)

CANCELLED_ERROR = "batch: cancelled"
EXPIRED_ERROR = "batch: the completion window ended before this request ran"
_STOP_MESSAGES = {Code.BATCH_CANCELLED: CANCELLED_ERROR, Code.BATCH_EXPIRED: EXPIRED_ERROR}


def cancel_pending_items(batch_id, code: str = Code.BATCH_CANCELLED) -> int:
    """available → cancelled for one batch (cancel or expiry); running items stop at their heartbeat; records at
    a provider stop with their jobs (batches/provider/jobs.py `cancel_jobs`, sent once this commits)."""
    if Item.objects.filter(batch_id=batch_id, state=St.DELEGATED).exists():
        transaction.on_commit(lambda: dispatch.hand_off("provider_cancel", batch_id))
    return Item.objects.filter(batch_id=batch_id, state=St.AVAILABLE).update(
        state=St.CANCELLED, finished_at=timezone.now(), error=_STOP_MESSAGES[code], error_code=code
    )


# Index-backed whatever the table's statistics say (autovacuum may be off, as in CI): a running item
# through item_running, else the first available one through item_available in idx order. (An EXISTS
# over `state IN (...)` lets the planner pick a sequential scan that walks every finished row first.)
_PENDING_SQL = """
SELECT EXISTS (SELECT 1 FROM batches_item WHERE batch_id = %(batch)s AND state = 'running')
    OR (SELECT idx FROM batches_item WHERE batch_id = %(batch)s AND state = 'available' ORDER BY idx LIMIT 1)
       IS NOT NULL
    OR EXISTS (SELECT 1 FROM batches_item WHERE batch_id = %(batch)s AND state = 'delegated')
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
    registry.get(surface).all_final(batch_id, status)
    keep_ended_counts(batch_id)
    return True


# The statuses whose batch has every item final: ended, or an OpenAI batch writing its output files.
_COUNTS_FINAL = (*TERMINAL, S.FINALIZING)


def keep_ended_counts(batch_id) -> None:
    """Its items' counts per state on the batch row, once its last item is final: they never change again (a
    retry is a new batch), so the lists read them from the row (Batch.ended_counts). One statement, once per
    batch: a grouped read of the (batch, state) index inside the UPDATE, which a second call (the sweeper's)
    finds already done."""
    pk = Batch._meta.pk.get_db_prep_value(batch_id, connection)  # a UUID as this database stores it
    statuses = ", ".join(["%s"] * len(_COUNTS_FINAL))
    agg = "json_group_object(state, n)" if connection.vendor == "sqlite" else "jsonb_object_agg(state, n)"
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE batches_batch SET ended_counts = (SELECT {agg} FROM (SELECT state, COUNT(*) AS n FROM "
            "batches_item WHERE batch_id = %s GROUP BY state) AS by_state) "
            f"WHERE id = %s AND ended_counts IS NULL AND status IN ({statuses})",
            [pk, pk, *_COUNTS_FINAL],
        )


def native_all_final(batch_id, status: str) -> None:
    if status == S.CANCELLED:
        Batch.objects.filter(pk=batch_id, completed_at__isnull=True).update(completed_at=timezone.now())
    elif status in OPEN[Surface.NATIVE]:
        move(batch_id, Surface.NATIVE, S.COMPLETED)


def openai_all_final(batch_id, status: str) -> None:
    if status == S.IN_PROGRESS:
        move(batch_id, Surface.OPENAI, S.FINALIZING, frm=[S.IN_PROGRESS])
        status = S.FINALIZING
    if status in (S.FINALIZING, S.CANCELLING):
        transaction.on_commit(lambda: dispatch.hand_off("finalize_openai_batch", batch_id))


def unfinished_batches(limit: int = 100) -> list:
    """Open batches whose items are all final: what `complete_if_done` missed (a crash between commit and check)."""
    pending = Item.objects.filter(batch_id=OuterRef("pk"), state__in=PENDING_STATES)
    unfinished = [Q(s.unfinished, surface=s.name) for s in registry.all_surfaces() if s.unfinished is not None]
    return list(
        Batch.objects.filter(functools.reduce(operator.or_, unfinished))
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


def cancel(batch: Batch) -> bool:
    """Cancel a batch of any surface (its surface object says how). Native: pending items now, running ones at
    their next heartbeat on every replica. OpenAI: cancelling → cancelled once its partial results are written;
    Anthropic: cancelling → cancelled once no request is running; False when it had already finished."""
    return registry.get(batch.surface).cancel(batch)


def cancelled_or_cancelling(batch: Batch, moved: bool) -> bool:
    """After a cancel that may have found the batch finished: `batch` read again; True if it moved or is
    cancelling or cancelled already (a cancel is idempotent)."""
    batch.refresh_from_db()
    return moved or batch.status in (S.CANCELLING, S.CANCELLED)


# Batches closed per surface per sweep: the rest wait for the next one.
EXPIRE_PER_SWEEP = 100


def expire_due(now) -> int:
    """Close the window of every open batch past its `expires_at`, surface by surface."""
    closed = 0
    for surface in registry.all_surfaces():
        if surface.expirable is None:
            continue
        due = Batch.objects.filter(surface.expirable, surface=surface.name, expires_at__lte=now)
        closed += sum(surface.expire(batch_id, now) for batch_id in due.values_list("id", flat=True)[:EXPIRE_PER_SWEEP])
    return closed


def expiring(until, limit: int = EXPIRE_PER_SWEEP) -> list:
    """(id, expires_at) of the open batches whose window closes by `until`, surface by surface: what the
    sweeper schedules an expiry for, at the moment each window closes (batches/sweeper.py)."""
    found = []
    for surface in registry.all_surfaces():
        if surface.expirable is None:
            continue
        due = Batch.objects.filter(surface.expirable, surface=surface.name, expires_at__lte=until)
        found += list(due.values_list("id", "expires_at")[:limit])
    return found


def expire_one(batch_id, now):
    """Close one batch's window if it closed by `now`: True if this closed it; its `expires_at` when that is
    still ahead (moved since it was scheduled); None when there is nothing to close (ended, expired already,
    a surface without a window) or a validation holds the row (the sweep's `expire_due` retries)."""
    row = Batch.objects.filter(pk=batch_id).values_list("surface", "expires_at").first()
    if row is None:
        return None
    name, expires_at = row
    surface = registry.get(name)
    if surface.expirable is None or expires_at is None:
        return None
    if not Batch.objects.filter(surface.expirable, pk=batch_id, surface=name).exists():
        return None
    if expires_at > now:
        return expires_at
    return surface.expire(batch_id, now) or None
