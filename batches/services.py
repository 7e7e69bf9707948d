"""Batch writes: submit, claim, run, finish, heartbeat, cancel, sweep, wake-ups.

Execution model (design.md §4): an item is a row; a worker *claims* it with a
conditional UPDATE (FOR UPDATE SKIP LOCKED on PostgreSQL), runs it through the
same pipeline as a live request, and finishes it with a write fenced on
(state, lease owner, attempt), in the same transaction as its usage event.
Celery messages carry no state: a wake-up only says "claim and run work".
"""

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import uuid6
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, F, Q
from django.utils import timezone

from batches import bulk, ingest, openai_batches, storage
from batches.models import CLAIMABLE_STATUSES, Batch, BatchStatus, Item, ItemState, Shape, Surface
from batches.tools import config as tools_config
from batches.tools.loop import run_tool_loop
from relay import auth, catalog, pipeline
from relay.errors import RelayError
from usage.services import record_event

log = logging.getLogger(__name__)

HARD_BODY_CAP = 64 * 1024 * 1024
SHAPE_PATH = {
    Shape.OPENAI: "/v1/chat/completions",
    Shape.OPENAI_RESPONSES: "/v1/responses",
    Shape.ANTHROPIC: "/v1/messages",
}


def body_limit() -> int:
    return min(settings.RELAY_MAX_REQUEST_BYTES, HARD_BODY_CAP)


# --- submit -------------------------------------------------------------------


def submit_native(principal: auth.Principal, raw_stream) -> Batch:
    """Parse a native body from a stream and store it (POST /v1/batches parses in batches.intake instead)."""
    with ingest.read_submission(raw_stream, body_limit(), settings.RELAY_BATCH_MAX_ITEMS) as submission:
        return store_native(principal, submission)


def store_native(principal: auth.Principal, submission: ingest.Submission) -> Batch:
    """Store every item and its batch in one transaction; wake workers after commit.

    The body was parsed once, as a stream (ingest.read_submission); its items
    come back from the spool. Bad input → RelayError(400) and nothing is stored.
    """
    top, seen = submission.top, submission.count
    max_items = settings.RELAY_BATCH_MAX_ITEMS
    shape = top.get("shape")
    if shape in (None, ""):
        raise RelayError(400, "invalid_request", "shape is required")
    if shape not in Shape.values:
        raise RelayError(400, "invalid_request", f"unknown shape {shape!r}: use one of {', '.join(Shape.values)}")
    if "requests" not in top:
        raise RelayError(400, "invalid_request", "requests is required")
    if not seen:
        raise RelayError(400, "invalid_request", "requests must be non-empty")
    if seen > max_items:
        raise RelayError(
            400,
            "too_many_items",
            f"batch: too many items: {seen} items, at most {max_items} per batch (RELAY_BATCH_MAX_ITEMS)",
        )
    batch_id = uuid6.uuid7()
    writer = storage.input_writer(str(batch_id))
    try:
        with transaction.atomic():
            pending: list[dict] = []
            for idx, data in enumerate(submission.elements()):
                ref = writer.add(idx, data)
                pending.append(dict(id=uuid6.uuid7(), batch_id=batch_id, idx=idx, state="available", input_ref=ref))
                if len(pending) >= 5000:
                    bulk.insert_items(pending)  # COPY on PostgreSQL
                    pending.clear()
            bulk.insert_items(pending)
            writer.close()
            batch = Batch.objects.create(
                id=batch_id,
                inbound_shape=shape,
                total_items=seen,
                **Batch.attribution(principal),
            )
            transaction.on_commit(top_up_wakeups)
    except BaseException:
        writer.discard()
        raise
    return batch


# --- wake-ups -------------------------------------------------------------------


def top_up_wakeups() -> int:
    """Keep at most RELAY_BATCH_WAKEUP_WINDOW wake-ups queued while work is available.

    Redis never holds one message per item: which item runs is decided at
    claim time. A lost wake-up only costs latency until the next sweep.
    """
    from batches import tasks
    from relay.redis import get_redis

    if not Item.objects.filter(state=ItemState.AVAILABLE).exists():
        return 0
    try:
        queued = get_redis().llen("batch") if settings.CELERY_BROKER_URL.startswith("redis") else 0
    except Exception:  # the broker is down: the sweeper will try again
        log.warning("could not read the batch queue length", exc_info=True)
        return 0
    missing = max(0, settings.RELAY_BATCH_WAKEUP_WINDOW - queued)
    for _ in range(missing):
        tasks.run_items.apply_async(queue="batch")
    return missing


# --- claim -------------------------------------------------------------------------


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


def claim(owner: str) -> Item | None:
    """Claim the next item, fairly: the active batch with the fewest running items first."""
    running = dict(
        Item.objects.filter(state=ItemState.RUNNING).values_list("batch_id").annotate(n=Count("id")).order_by()
    )
    active = list(Batch.objects.filter(status__in=CLAIMABLE_STATUSES).values_list("id", "created_at", "status"))
    active.sort(key=lambda b: (running.get(b[0], 0), b[1]))
    for batch_id, _, status in active[:20]:
        item = _claim_in_batch(batch_id, owner)
        if item is not None:
            if status == BatchStatus.QUEUED:
                Batch.objects.filter(pk=batch_id, status=BatchStatus.QUEUED).update(status=BatchStatus.RUNNING)
            return item
    return None


# PostgreSQL: one autocommitted statement; SKIP LOCKED makes concurrent claimers
# pass over each other's row instead of queueing on it.
_CLAIM_SQL = """
UPDATE batches_item SET state = 'running', attempt = attempt + 1, lease_owner = %s,
       lease_expires_at = %s, started_at = %s
WHERE id = (SELECT id FROM batches_item WHERE batch_id = %s AND state = 'available'
            ORDER BY idx LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING *
"""


def _claim_in_batch(batch_id, owner: str) -> Item | None:
    now = timezone.now()
    lease = now + timezone.timedelta(seconds=settings.RELAY_BATCH_LEASE_SECONDS)
    if connection.vendor == "postgresql":
        return next(iter(Item.objects.raw(_CLAIM_SQL, [owner, lease, now, batch_id])), None)
    # SQLite (embedded mode) serialises writers; the conditional UPDATE is the claim.
    item = Item.objects.filter(batch_id=batch_id, state=ItemState.AVAILABLE).order_by("idx").first()
    if item is None:
        return None
    updated = Item.objects.filter(pk=item.pk, state=ItemState.AVAILABLE).update(
        state=ItemState.RUNNING, attempt=item.attempt + 1, lease_owner=owner, lease_expires_at=lease, started_at=now
    )
    if not updated:
        return None
    item.state, item.lease_owner, item.lease_expires_at = ItemState.RUNNING, owner, lease
    item.attempt += 1
    return item


# --- run ----------------------------------------------------------------------------


class Heartbeat:
    """Renews the item's lease and reads the batch's cancel flag every few seconds.

    Cancel goes through the database, so a cancel received by any replica
    reaches the item wherever it runs. Losing the lease (the sweeper gave the
    item to someone else) stops the call too. The beats come from one thread
    per worker process (`_Beater`) with one long-lived database connection,
    not a thread and a fresh connection per item.
    """

    def __init__(self, item: Item):
        self.item = item
        self.stop_reason: str | None = None

    def __enter__(self):
        _beater().register(self)
        return self

    def __exit__(self, *exc):
        _beater().unregister(self)

    def should_stop(self) -> bool:
        return self.stop_reason is not None

    def beat(self) -> None:
        lease = timezone.now() + timezone.timedelta(seconds=settings.RELAY_BATCH_LEASE_SECONDS)
        renewed = Item.objects.filter(
            pk=self.item.pk, state=ItemState.RUNNING, lease_owner=self.item.lease_owner, attempt=self.item.attempt
        ).update(lease_expires_at=lease)
        if not renewed:
            self.stop_reason = "lease_lost"
        elif Batch.objects.filter(pk=self.item.batch_id, cancel_requested_at__isnull=False).exists():
            self.stop_reason = "cancelled"


class _Beater:
    """The process's heartbeat thread: beats every registered item each interval."""

    def __init__(self):
        self.lock = threading.Lock()
        self.beats: set[Heartbeat] = set()
        self.pid = os.getpid()
        threading.Thread(target=self._run, name="batch-heartbeat", daemon=True).start()

    def register(self, hb: Heartbeat) -> None:
        with self.lock:
            self.beats.add(hb)

    def unregister(self, hb: Heartbeat) -> None:
        with self.lock:
            self.beats.discard(hb)

    def _run(self) -> None:
        while True:
            time.sleep(settings.RELAY_BATCH_HEARTBEAT_SECONDS)
            with self.lock:
                current = [hb for hb in self.beats if not hb.should_stop()]
            if not current:
                # Idle: give the connection back rather than hold it between items.
                connection.close()
                continue
            for hb in current:
                try:
                    hb.beat()
                except Exception:  # a failed beat is retried next interval; the lease has slack
                    log.warning("heartbeat failed for item %s", hb.item.pk, exc_info=True)
                    connection.close_if_unusable_or_obsolete()


_beater_instance: _Beater | None = None
_beater_lock = threading.Lock()


def _beater() -> _Beater:
    """One per process; a prefork child gets its own (threads do not survive fork)."""
    global _beater_instance
    with _beater_lock:
        if _beater_instance is None or _beater_instance.pid != os.getpid():
            _beater_instance = _Beater()
        return _beater_instance


_batch_cache: dict = {}


def _batch(batch_id) -> Batch:
    """The batch of an item. Only fields fixed at submit are read through this
    cache (attribution, shape, endpoint, policy id, discount); state and the
    cancel flag are always read from the database."""
    batch = _batch_cache.get(batch_id)
    if batch is None:
        if len(_batch_cache) >= 256:
            _batch_cache.clear()
        batch = _batch_cache[batch_id] = Batch.objects.get(pk=batch_id)
    return batch


def run_item(item: Item) -> None:
    """Run one claimed item to a final state. Never raises for item-level failures."""
    started = time.monotonic()
    batch = _batch(item.batch_id)
    principal = auth.Principal.from_dict(batch.principal)
    deadline = started + settings.RELAY_BATCH_ITEM_DEADLINE_SECONDS
    with Heartbeat(item) as hb:
        run = _execute(batch, item, principal, deadline, hb)
    outcome, failure = run.outcome, run.failure
    if hb.stop_reason == "lease_lost":
        log.warning("item %s lost its lease; dropping this attempt's result", item.pk)
        return
    if hb.stop_reason == "cancelled" and (failure or (outcome and not outcome.ok)):
        _finish(item, ItemState.CANCELLED, error="batch: cancelled", outcome=outcome, events=run.events)
        return
    if failure is not None:
        _finish(item, ItemState.DISCARDED, error=failure, outcome=outcome, error_code=run.error_code, events=run.events)
        return
    if outcome.ok:
        ref = storage.write_result(str(batch.id), str(item.pk), outcome.body)
        _finish(item, ItemState.COMPLETED, outcome=outcome, result_ref=ref, events=run.events)
        return
    error_body = outcome.body[: pipeline.ERROR_BODY_LIMIT].decode("utf-8", errors="replace")
    if outcome.origin == "upstream":
        message = f"batch item: upstream status {outcome.status}"
    else:
        message = f"batch item: {outcome.error.message}" if outcome.error else "batch item: failed"
        error_body = ""
    _finish(item, ItemState.DISCARDED, error=message, outcome=outcome, error_body=error_body, events=run.events)


@dataclass
class _Run:
    """What executing an item came to.

    `events`: the usage events of every model invocation when there were
    several (tool calling); None means "the outcome's own event, if any".
    """

    outcome: pipeline.Outcome | None = None
    failure: str | None = None
    error_code: str = ""
    events: list[dict] | None = None


def _execute(batch: Batch, item: Item, principal, deadline: float, hb: Heartbeat) -> _Run:
    try:
        auth.recheck(principal)
    except RelayError as exc:  # AuthError, or the token's project is gone
        return _Run(failure=f"batch: credential no longer valid: {exc.message}")
    policy = catalog.policy(batch.policy_id) if batch.policy_id else None
    if policy is None or not policy.enabled:
        return _Run(failure="batch: policy_unavailable")
    try:
        body = json.loads(storage.read(item.input_ref))
    except storage.PayloadMissing as exc:
        return _Run(failure=f"batch: load input: {exc}")
    except ValueError as exc:
        return _Run(failure=f"batch: load input: stored item is not JSON: {exc}")
    if not isinstance(body, dict):
        return _Run(failure="batch: parse model: item is not a JSON object")
    if body.get("stream") is True:
        return _Run(
            failure="batch: stream is not supported in batch items; the response is stored whole (unset stream)"
        )
    path = batch.endpoint or SHAPE_PATH[batch.inbound_shape]  # an OpenAI batch calls its endpoint

    def invoke(model_body: dict, round_no: int) -> pipeline.Outcome:
        return pipeline.dispatch(
            pipeline.Call(
                path=path,
                body=model_body,
                principal=principal,
                source="batch",
                # One usage event per model invocation: the item's id, then id:1, id:2 … per tool round.
                request_id=str(item.pk) if round_no == 0 else f"{item.pk}:{round_no}",
                deadline=deadline,
                cancel=hb.should_stop,
                batch_id=str(batch.id),
                required_adapter=batch.inbound_shape,
                policy=policy,
            )
        )

    if batch.surface == Surface.OPENAI:
        return _execute_openai_record(body, item, path, invoke, deadline, hb)
    return _checked(invoke(body, 0))


def _execute_openai_record(body: dict, item: Item, path: str, invoke, deadline: float, hb: Heartbeat) -> _Run:
    """An OpenAI record: the relay-owned `openrelay` key never reaches the model;
    a chat record with `openrelay.tool_config` runs the tool loop (issue 6)."""
    try:
        model_body, tool_config = tools_config.extract(body)
    except tools_config.ToolError as exc:  # validation catches these first; re-checked for safety
        return _Run(failure=f"batch: {exc.code}: {exc.message}", error_code=exc.code)
    if tool_config is None or path != "/v1/chat/completions":
        return _checked(invoke(model_body, 0))
    result = run_tool_loop(body, tool_config, item.custom_id, invoke, deadline=deadline, cancel=hb.should_stop)
    events = [o.event for o in result.invocations]
    if result.error is not None:
        return _Run(
            outcome=None,
            failure=f"batch: {result.error.code}: {result.error.message}",
            error_code=result.error.code,
            events=events,
        )
    run = _checked(result.outcome)
    run.events = events
    return run


def _checked(outcome: pipeline.Outcome) -> _Run:
    if outcome.error is not None and outcome.error.code == "timeout":
        limit = settings.RELAY_BATCH_ITEM_DEADLINE_SECONDS
        return _Run(outcome=outcome, failure=f"batch: item ran longer than {limit:g} seconds", error_code="timeout")
    return _Run(outcome=outcome)


def _finish(
    item: Item,
    state: str,
    *,
    error: str = "",
    outcome=None,
    result_ref: str = "",
    error_body: str = "",
    error_code: str = "",
    events: list[dict] | None = None,
) -> bool:
    """Fenced final write + usage event in one transaction. False: the lease was lost."""
    with transaction.atomic():
        updated = Item.objects.filter(
            pk=item.pk, state=ItemState.RUNNING, lease_owner=item.lease_owner, attempt=item.attempt
        ).update(
            state=state,
            finished_at=timezone.now(),
            lease_expires_at=None,
            result_ref=result_ref,
            status_code=outcome.status if outcome is not None and outcome.origin == "upstream" else None,
            error=error[:1000],
            error_code=error_code,
            error_body=error_body,
        )
        if not updated:
            return False
        if events is None:
            events = [outcome.event] if outcome is not None else []
        if not events:
            record_event(**_event_without_dispatch(item, error), fetch=False)
        percent = _batch(item.batch_id).discount_percent  # fixed at create
        for i, event in enumerate(events):
            event = dict(event)
            if i == len(events) - 1 and error and not event.get("error_kind"):
                # The item failed after its last invocation answered (a tool failure, say).
                event["error_kind"] = error_code or "batch_item_failed"
                event["error_message"] = error[:500]
            record_event(**openai_batches.with_batch_price(event, percent), fetch=False)
        _maybe_complete(item.batch_id)
    return True


def _event_without_dispatch(item: Item, error: str) -> dict:
    """The usage event of an item that failed before reaching the pipeline."""
    kind = (
        "credential_invalid" if "credential" in error else "policy_unavailable" if "policy" in error else "invalid_item"
    )
    return {
        **_batch(item.batch_id).event_attribution(),
        "request_id": str(item.pk),
        "status": 0,
        "error_kind": kind,
        "error_message": error[:500],
    }


def _maybe_complete(batch_id) -> None:
    """Stamp the batch once every item is final (completed, or cancelled if it was cancelled)."""
    if Item.objects.filter(batch_id=batch_id, state__in=[ItemState.AVAILABLE, ItemState.RUNNING]).exists():
        return
    from batches import openai_batches

    if openai_batches.items_done(batch_id):  # an OpenAI batch finalizes into output/error files
        return
    now = timezone.now()
    Batch.objects.filter(pk=batch_id, completed_at__isnull=True, status=BatchStatus.CANCELLED).update(completed_at=now)
    Batch.objects.filter(pk=batch_id, completed_at__isnull=True).exclude(status=BatchStatus.CANCELLED).update(
        status=BatchStatus.COMPLETED, completed_at=now
    )


# --- cancel -----------------------------------------------------------------------


def cancel(batch: Batch) -> None:
    """Pending items become cancelled now; running ones stop at their next heartbeat, on every replica."""
    if batch.surface == Surface.OPENAI:
        from batches import openai_batches

        openai_batches.cancel(batch)  # cancelling → cancelled, with its results written
        return
    now = timezone.now()
    with transaction.atomic():
        Batch.objects.filter(pk=batch.pk, cancel_requested_at__isnull=True).update(cancel_requested_at=now)
        Batch.objects.filter(pk=batch.pk).exclude(status=BatchStatus.COMPLETED).update(status=BatchStatus.CANCELLED)
        Item.objects.filter(batch_id=batch.pk, state=ItemState.AVAILABLE).update(
            state=ItemState.CANCELLED, finished_at=now, error="batch: cancelled"
        )
        _maybe_complete(batch.pk)


# --- sweeper -----------------------------------------------------------------------


def sweep() -> dict:
    """Rescue expired leases, then top up wake-ups. Idempotent; any replica may run it."""
    now = timezone.now()
    expired = Item.objects.filter(state=ItemState.RUNNING, lease_expires_at__lt=now)
    retry = expired.filter(attempt__lt=F("max_attempts"))
    rescued = retry.update(state=ItemState.AVAILABLE, lease_owner="", lease_expires_at=None)
    exhausted_ids = list(
        Item.objects.filter(state=ItemState.RUNNING, lease_expires_at__lt=now).values_list("id", "batch_id")
    )
    for item_id, batch_id in exhausted_ids:
        with transaction.atomic():
            done = Item.objects.filter(pk=item_id, state=ItemState.RUNNING, lease_expires_at__lt=now).update(
                state=ItemState.DISCARDED,
                finished_at=now,
                lease_owner="",
                lease_expires_at=None,
                error="batch: worker lost the item on every attempt",
            )
            if done:
                record_event(**_event_without_dispatch(Item(pk=item_id, batch_id=batch_id), "batch: worker lost"))
                _maybe_complete(batch_id)
    # Cancelled batches whose running items died: nothing will finish them but us.
    Item.objects.filter(state=ItemState.AVAILABLE, batch__cancel_requested_at__isnull=False).update(
        state=ItemState.CANCELLED, finished_at=now, error="batch: cancelled"
    )
    for batch_id in (
        Batch.objects.filter(
            surface=Surface.NATIVE, completed_at__isnull=True, status__in=[BatchStatus.CANCELLED, BatchStatus.RUNNING]
        )
        .filter(~Q(items__state__in=[ItemState.AVAILABLE, ItemState.RUNNING]))
        .values_list("id", flat=True)
        .distinct()
    ):
        _maybe_complete(batch_id)
    from batches import openai_batches

    openai_batches.sweep()  # expiry, and OpenAI batches whose validate/finalize message was lost
    woken = top_up_wakeups()
    return {"rescued": rescued, "discarded": len(exhausted_ids), "woken": woken}


# --- the worker loop ------------------------------------------------------------------


def drain(max_items: int = 50, max_seconds: float = 120.0) -> int:
    """Claim and run items until none is claimable or the budget is used; then hand over.

    One Celery task runs this loop in one of the worker's 8 slots. When the
    budget ends with work left, it queues a wake-up so the slot is reused
    without waiting for the sweeper.
    """
    owner = f"{worker_id()}:{uuid.uuid4().hex[:8]}"
    started, done = time.monotonic(), 0
    while done < max_items and time.monotonic() - started < max_seconds:
        item = claim(owner)
        if item is None:
            return done
        run_item(item)
        done += 1
    top_up_wakeups()
    return done
