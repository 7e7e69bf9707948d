"""The sweeper: rescues items whose worker died, discards the ones lost on every attempt, ends what
nothing else will, expires batches past their window, re-sends lost control messages, then tops up
the wake-ups. Idempotent; any replica may run it, on the control queue."""

import logging

from django.conf import settings
from django.db import connection
from django.db.models import Q
from django.utils import timezone

from batches import dispatch, retrying
from batches.lifecycle import finish, stop
from batches.models import Attempt
from batches.outcomes import Code
from batches.provider import jobs as provider_jobs
from batches.provider.models import OPEN_JOB_STATUSES, JobStatus, ProviderJob
from batches.surfaces import registry
from batches.worker.execute import batch_of, event_without_dispatch
from usage import budgets
from usage.models import BudgetHold
from usage.services import record_event

log = logging.getLogger(__name__)


def sweep() -> dict:
    """Rescue expired leases, finish what nothing else will, expire OpenAI batches past their window,
    re-send lost control messages, then top up wake-ups. Idempotent; any replica may run it."""
    now = timezone.now()
    stale = now - timezone.timedelta(seconds=settings.RELAY_BATCH_LEASE_SECONDS)
    # Each step on its own: one that fails (a row held by a frozen process, a lock timeout) must
    # not skip the others, least of all the wake-ups at the end.
    rescued = _step("rescue", lambda: finish.rescue_expired_leases(now, _record_rescued))
    discarded = _step("discard", lambda: finish.discard_lost_items(now, _record_lost))
    _step("cancel orphans", stop.cancel_orphans)  # cancelled batches whose running items died
    expired = _step("expire", lambda: stop.expire_due(now))
    _step("schedule expiries", lambda: schedule_expiries(now))
    _step("lost validations", lambda: _redispatch_lost_validations(stale))
    _step("unfinished batches", lambda: _finish_unfinished(stale))
    # Provider batch mode and budgets cost a sweep nothing where they are not in use (one statement asks).
    in_use = _step("in use", lambda: _in_use(now)) or _ALL_IN_USE
    if in_use["provider_jobs"]:
        _step("provider jobs", provider_jobs.due_jobs)  # a job's lost message or run-out lease (batches/provider/)
    if in_use["budget_holds"]:
        _step("budget holds", budgets.reclaim_expired)  # reservations a dead worker never settled (usage/budgets.py)
    woken = _step("wake", dispatch.wake_workers)
    return {"rescued": rescued, "discarded": discarded, "expired": expired, "woken": woken}


_ALL_IN_USE = {"provider_jobs": True, "budget_holds": True}


def _in_use(now) -> dict:
    """Which of the sweep's feature steps have anything to look at, in one statement: provider jobs open or
    ended still naming a budget hold (provider_jobs.due_jobs), budget holds past their expiry
    (budgets.reclaim_expired). Each step finds nothing where this says False: same tables, looser filters."""
    looks = {
        "provider_jobs": ProviderJob.objects.filter(
            Q(status__in=OPEN_JOB_STATUSES)
            | Q(budget_hold__isnull=False, status__in=(JobStatus.DONE, JobStatus.RELEASED))
        ),
        "budget_holds": BudgetHold.objects.filter(expires_at__lte=now),
    }
    parts = [qs.values("pk")[:1].query.sql_with_params() for qs in looks.values()]
    with connection.cursor() as cursor:
        cursor.execute("SELECT " + ", ".join(f"EXISTS({sql})" for sql, _ in parts), [p for _, ps in parts for p in ps])
        row = cursor.fetchone()
    return dict(zip(looks, row, strict=True))


def _step(name: str, fn):
    try:
        return fn()
    except Exception:
        log.exception("sweep step %r failed; the next sweep retries it", name)
        connection.close_if_unusable_or_obsolete()
        return 0


# How far ahead a sweep schedules the windows that close: more than two sweeps, so that every window's expiry
# is scheduled by a sweep before it closes, even when one sweep is late or fails.
def expiry_horizon() -> float:
    return 3 * settings.RELAY_BATCH_SWEEP_SECONDS + 1.0


def schedule_expiries(now) -> int:
    """An expiry for each window that closes before the horizon, delivered on the control queue at the moment it
    closes (`expire_on_time`): a batch is expired at its `expires_at`, not at the first sweep after it. Each is
    sent once (dispatch.hand_off_once_at); `expire_due` above stays the fallback for a lost message."""
    until = now + timezone.timedelta(seconds=expiry_horizon())
    return sum(dispatch.hand_off_once_at("expire_batch", batch_id, at) for batch_id, at in stop.expiring(until))


def expire_on_time(batch_id) -> bool:
    """The expiry scheduled for a batch's window (`schedule_expiries`): close it now if it is due; when its
    `expires_at` moved later meanwhile, schedule it again for then. True if it closed now."""
    result = stop.expire_one(batch_id, timezone.now())
    if result is None or result is True:
        return bool(result)
    if (result - timezone.now()).total_seconds() <= expiry_horizon():
        dispatch.hand_off_once_at("expire_batch", batch_id, result)
    return False


def _redispatch_lost_validations(stale) -> int:
    # Control messages of each surface's own (an OpenAI batch's validation) lost, or their worker died.
    return sum(surface.redispatch_lost(stale) for surface in registry.all_surfaces())


def _finish_unfinished(stale) -> int:
    batches = stop.unfinished_batches()
    for batch_id, surface, status, finalizing_at, cancelling_at in batches:
        if not registry.get(surface).finishes_itself(batch_id, status, finalizing_at or cancelling_at, stale):
            stop.complete_if_done(batch_id)
    return len(batches)


_LOST = "batch: the worker running this attempt was lost (its lease ran out)"


def _lost_attempt(item_id, attempt: int, started_at, now, decision: str) -> Attempt:
    started = started_at or now
    return Attempt(
        item_id=item_id,
        number=attempt,
        started_at=started,
        finished_at=now,
        duration_ms=max(0, int((now - started).total_seconds() * 1000)),
        outcome=Code.WORKER_LOST,
        decision=decision,
        error=_LOST,
    )


def _record_rescued(rows: list) -> None:
    now = timezone.now()
    Attempt.objects.bulk_create(
        [_lost_attempt(item_id, attempt, started_at, now, retrying.RETRY) for item_id, _, attempt, started_at in rows],
        ignore_conflicts=True,  # the zombie may still write its own after rescue: first one wins
    )


def _record_lost(item_id, batch_id, attempt: int, started_at) -> None:
    error = "batch: worker lost the item on every attempt"
    record_event(**event_without_dispatch(batch_of(batch_id), item_id, Code.WORKER_LOST, error), fetch=False)
    Attempt.objects.bulk_create(
        [_lost_attempt(item_id, attempt, started_at, timezone.now(), retrying.FINISH)], ignore_conflicts=True
    )
