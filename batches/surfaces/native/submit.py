"""The native surface's writes: a batch submitted whole (spooled) or stored while its body is read."""

import logging
from collections.abc import Callable

import uuid6
from django.conf import settings
from django.db import connection, transaction

from batches import bulk, dispatch, ingest, storage
from batches.models import Batch, Shape
from core import auth
from core.errors import RelayError, quoted

log = logging.getLogger(__name__)


def submit_native(principal: auth.Principal, raw_stream) -> Batch:
    """Parse a native body from a stream and store it (POST /v1/batches parses in batches.intake instead)."""
    with ingest.read_submission(raw_stream, ingest.body_limit(), settings.RELAY_BATCH_MAX_ITEMS) as submission:
        return store_native(principal, submission)


def store_native(principal: auth.Principal, submission: ingest.Submission, *, retry_of: Batch | None = None) -> Batch:
    """Store every item and its batch in one transaction; wake workers after commit.

    The body was parsed once, as a stream (ingest.read_submission); its items
    come back from the spool. Bad input → RelayError(400) and nothing is stored.
    `retry_of`: the batch whose failed records this one re-runs (batches/surfaces/retry.py).
    """
    retry = _native_checks(submission.top, submission.count)
    batch_id = uuid6.uuid7()
    writer = storage.input_writer(str(batch_id))
    try:
        with transaction.atomic():
            # Each element is appended to the input file as its row is formatted (batches/bulk.py).
            rows = ((idx, writer.add(idx, data), "") for idx, data in enumerate(submission.elements()))
            bulk.copy_new_items(batch_id, rows, max_attempts=retry["max_attempts"], stream=not writer.uses_db)
            writer.close()
            batch = _create_native(
                principal, batch_id, submission.top["shape"], submission.count, retry, retry_of=retry_of
            )
    except BaseException:
        writer.discard()
        raise
    return batch


def can_stream_native(head: dict) -> bool:
    """Whether a native body can be stored as it is read (store_native_streaming), judged by the
    top-level keys before `requests` (batches.intake has checked that none is the OpenAI surface's):
    a known shape, a valid `retry` or none, inputs stored outside the database (the COPY reads rows
    while the parse writes them; a payload store in the database would need the connection meanwhile:
    a directory's file, or an s3 object spooled and sent as multipart parts as it grows), and
    PostgreSQL: the transaction stays open while the body arrives, and SQLite (embedded mode) would
    hold its one write lock that long, stalling every worker's finish behind a slow upload."""
    if head.get("shape") not in Shape.values or storage.backend() == "db" or connection.vendor != "postgresql":
        return False
    try:
        _retry_options(head.get("retry"))
    except RelayError:
        return False  # the spooled path answers it, after the whole body is read, as before
    return True


class _Replay(Exception):
    """The body's keys after `requests` changed what the streamed store assumed: undo it, replay."""


def store_native_streaming(
    principal: auth.Principal, reader: ingest.SubmissionReader, head: dict, on_parsed: Callable[[], None]
) -> Batch | ingest.Submission:
    """Store a native batch while its body is parsed: each element goes to the input file and the
    items' COPY as soon as it is read, so PostgreSQL inserts rows while the web worker parses the
    next ones (store_native, after the spool, runs the two one after the other).

    Judged from `head`, the keys before `requests` (can_stream_native). Everything happens in one
    transaction that commits only after the whole body is parsed and checked, so a bad element, an
    oversized body or a failed check stores nothing, as in store_native. If keys after `requests`
    differ from `head` (a `retry` or `shape` sent last, an OpenAI key making the body ambiguous),
    nothing is kept and the parsed body comes back as a Submission for the usual path, read from
    the input file the elements were written to. `on_parsed` runs once the body is parsed, before the
    batch's own checks (the view answers those in the native error shape).
    """
    retry = _retry_options(head.get("retry"))
    batch_id = uuid6.uuid7()
    writer = storage.input_writer(str(batch_id))
    try:
        with transaction.atomic():
            _allow_the_upload()
            rows = ((idx, writer.add(idx, data), "") for idx, data in enumerate(reader.elements()))
            bulk.copy_new_items(batch_id, rows, max_attempts=retry["max_attempts"], stream=True)
            top = reader.top
            if _without_requests(top) != _without_requests(head):
                raise _Replay
            on_parsed()
            _native_checks(top, reader.count)
            writer.close()
            batch = _create_native(principal, batch_id, top["shape"], reader.count, retry)
    except _Replay:
        try:
            spool = writer.read_back()
        finally:
            writer.discard()
        return ingest.Submission(reader.top, reader.count, spool, reader.sha256)
    except BaseException:
        writer.discard()
        raise
    return batch


def _allow_the_upload() -> None:
    """The COPY lasts as long as the body takes to arrive, which the edge bounds (gateway.edge: a 408
    past RELAY_BODY_READ_SECONDS + size / RELAY_BODY_MIN_RATE). This transaction's statements get that
    bound for the largest body on top of RELAY_DB_STATEMENT_TIMEOUT_MS, so a slow but legal upload is
    cut by the edge's 408, never by the database's timeout halfway through."""
    upload_ms = 1000 * (settings.RELAY_BODY_READ_SECONDS + ingest.body_limit() / settings.RELAY_BODY_MIN_RATE)
    with connection.cursor() as cursor:
        cursor.execute(f"SET LOCAL statement_timeout = {int(upload_ms) + settings.RELAY_DB_STATEMENT_TIMEOUT_MS}")


def _without_requests(top: dict) -> dict:
    return {k: v for k, v in top.items() if k != "requests"}


def _native_checks(top: dict, seen: int) -> dict:
    """The native contract's checks of a parsed body of `seen` elements (decision 0003); answers its
    retry options."""
    max_items = settings.RELAY_BATCH_MAX_ITEMS
    shape = top.get("shape")
    if shape in (None, ""):
        raise RelayError(400, "invalid_request", "shape is required")
    if shape not in Shape.values:
        raise RelayError(400, "invalid_request", f"unknown shape {quoted(shape)}: use one of {', '.join(Shape.values)}")
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
    return _retry_options(top.get("retry"))


def _create_native(
    principal: auth.Principal, batch_id, shape: str, total: int, retry: dict, *, retry_of: Batch | None = None
) -> Batch:
    """The batch row of items just copied, in the caller's transaction; workers are woken after commit."""
    batch = Batch.objects.create(
        id=batch_id,
        inbound_shape=shape,
        total_items=total,
        retry_of=retry_of,
        **retry,
        **Batch.attribution(principal),
    )
    transaction.on_commit(dispatch.wake_workers)
    return batch


RETRY_KEYS = {"max_attempts", "wait_for_capacity"}
RETRY_MAX_ATTEMPTS = 100


def _retry_options(value) -> dict:
    """The native batch's opt-in to waiting and retrying (`"retry": {"max_attempts", "wait_for_capacity"}`).

    Without it a native batch keeps the native contract's (decision 0003) behaviour: an item fails at once
    (no wait for capacity, no retry of a transient failure); only a worker lost
    mid-item is rescued, up to 3 attempts, as before.
    """
    if value is None:
        return {"max_attempts": 3, "retry_transient": False, "wait_for_capacity": False}
    if not isinstance(value, dict):
        raise RelayError(
            400, "invalid_request", 'retry must be an object: {"max_attempts": 5, "wait_for_capacity": true}'
        )
    unknown = sorted(set(value) - RETRY_KEYS)
    if unknown:
        raise RelayError(
            400, "invalid_request", f"retry: unknown field {quoted(unknown[0])}; use max_attempts, wait_for_capacity"
        )
    attempts = value.get("max_attempts", settings.RELAY_BATCH_MAX_ATTEMPTS)
    if isinstance(attempts, bool) or not isinstance(attempts, int) or not 1 <= attempts <= RETRY_MAX_ATTEMPTS:
        raise RelayError(
            400, "invalid_request", f"retry.max_attempts must be an integer from 1 to {RETRY_MAX_ATTEMPTS}"
        )
    wait = value.get("wait_for_capacity", True)
    if not isinstance(wait, bool):
        raise RelayError(400, "invalid_request", "retry.wait_for_capacity must be true or false")
    return {"max_attempts": attempts, "retry_transient": attempts > 1, "wait_for_capacity": wait}
