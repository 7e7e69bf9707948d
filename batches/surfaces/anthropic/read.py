"""The Anthropic-compatible surface's reads: a batch (its owner's only), the list, the results
streamed from the items; and cancel and delete, which answer with the batch as it is now.

Statuses map onto Anthropic's `processing_status`:

    in_progress → in_progress     cancelling → canceling     completed | expired | cancelled → ended

Archived batches: Anthropic keeps results for 29 days after creation, then the batch "may still be viewed,
but its results will no longer be available for download". Retention does the same here
(RELAY_ANTHROPIC_RESULTS_RETENTION_SECONDS, batches/retention.py `prune_items`): it freezes the request
counts on the row and removes the items. From then on the batch shows the frozen counts (the same numbers)
and `archived_at` (when they were frozen, `Batch.frozen_at`); `results_url` stays as it was (Anthropic's
reference does not say it is cleared, and with it the SDK's `results()` reaches the results endpoint,
which names the archive, instead of failing with "Has it finished processing?"); and the results
endpoint answers 404 not_found_error, code `results_archived` (`check_results`).
"""

import logging
import re
import uuid
from collections.abc import Iterator
from datetime import UTC

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from batches import storage
from batches.errors import AnthropicError, error_type
from batches.errors import invalid_anthropic as invalid
from batches.lifecycle import states, stop
from batches.models import Batch, ItemState, Surface
from batches.outcomes import Code
from batches.surfaces import common
from core.auth import Principal
from core.errors import clipped, quoted

log = logging.getLogger(__name__)

# Matched in full (fullmatch): with `$`, "…\n" passed, and DELETE …/msgbatch_<hex>%0A deleted the batch.
_PUBLIC_ID = re.compile(r"msgbatch_([0-9a-f]{32})")
LIST_DEFAULT, LIST_MAX = 20, 1000


def parse_id(value: str) -> uuid.UUID | None:
    match = _PUBLIC_ID.fullmatch(value) if isinstance(value, str) else None
    return uuid.UUID(hex=match.group(1)) if match else None


def batch_for_owner(public_id: str, principal: Principal, *, counts: bool = False) -> Batch:
    """The Anthropic-surface batch if this caller created it; 404 for anyone else (and any other id)."""
    pk = parse_id(public_id)
    qs = common.owned(principal, Surface.ANTHROPIC).filter(pk=pk)
    batch = (with_counts(qs) if counts else qs).first() if pk is not None else None
    if batch is None:
        raise AnthropicError(404, f"No message batch found with id '{clipped(public_id)}'.")
    return batch


def shown(batch_id) -> Batch:
    """The batch with its counts, as the API shows it."""
    return with_counts(Batch.objects.filter(pk=batch_id)).get()


def as_created(batch: Batch) -> Batch:
    """The batch a create answers: as it was created (in_progress, every request processing), as
    Anthropic answers. Read back after the commit, the workers the commit woke may already have
    ended a small batch, and a create would answer `ended`."""
    batch.n_succeeded = batch.n_errored = batch.n_stopped = batch.n_expired = 0
    batch.retried_by_ids = []  # just made: nothing has retried it yet
    return batch


def batches_page(principal: Principal, params) -> tuple[list[Batch], bool]:
    """GET /v1/messages/batches: newest first; `after_id` pages to older batches, `before_id` to newer
    ones; `limit` 1–1000 (default 20). Keyset on the UUIDv7 id: one index range scan per page."""
    before, after = params.get("before_id"), params.get("after_id")
    if before and after:
        raise invalid("Only one of before_id and after_id may be given.")
    limit = common.parse_limit(
        params.get("limit"),
        default=LIST_DEFAULT,
        maximum=LIST_MAX,
        refuse=lambda problem, _: invalid(f"limit: {problem}"),
    )
    qs = with_counts(common.owned(principal, Surface.ANTHROPIC))
    cursor_raw = before or after
    if cursor_raw:
        cursor = parse_id(cursor_raw)
        if cursor is None:
            name = "before_id" if before else "after_id"
            raise invalid(f"{name}: {quoted(cursor_raw)} is not a message batch id (msgbatch_…)")
        if before:
            rows = list(qs.filter(id__gt=cursor).order_by("id")[: limit + 1])
            return list(reversed(rows[:limit])), len(rows) > limit
        qs = qs.filter(id__lt=cursor)
    rows = list(qs.order_by("-id")[: limit + 1])
    return rows[:limit], len(rows) > limit


def with_counts(qs):
    """Annotate batches with their final items per kind (and their retries)."""
    return common.count_items(
        common.with_retried_by(qs),
        {
            "n_succeeded": Q(state=ItemState.COMPLETED),
            "n_errored": Q(state=ItemState.DISCARDED),
            "n_stopped": Q(state=ItemState.CANCELLED),
            "n_expired": Q(state=ItemState.CANCELLED, error_code=Code.BATCH_EXPIRED),
        },
    )


def stopped_by_expiry(batch: Batch) -> bool:
    """Whether a request stopped without its own code (at a heartbeat) was stopped by the window closing."""
    if batch.expired_at is None:
        return False
    return batch.cancelling_at is None or batch.expired_at <= batch.cancelling_at


def request_counts(batch: Batch) -> dict:
    """processing / succeeded / errored / canceled / expired; live (they always sum to the total). Once
    retention has archived the batch's results, from the counts frozen on its row: the same terms, so the
    same numbers as before."""
    if batch.frozen_counts is not None:
        frozen = batch.frozen_counts
        succeeded, errored = frozen.get(ItemState.COMPLETED, 0), frozen.get(ItemState.DISCARDED, 0)
        stopped, expired = frozen.get(ItemState.CANCELLED, 0), frozen.get("cancelled_expired", 0)
        done, failed = frozen.get("provider_done", 0), frozen.get("provider_failed", 0)
    else:
        if not hasattr(batch, "n_succeeded"):
            batch = shown(batch.pk)
        succeeded, errored = batch.n_succeeded or 0, batch.n_errored or 0
        stopped, expired = batch.n_stopped or 0, batch.n_expired or 0
        done, failed = common.provider_progress(batch)  # a provider job's records finished, not yet written
    if stopped_by_expiry(batch):
        expired = stopped
    succeeded, errored = succeeded + done, errored + failed
    return {
        "processing": batch.total_items - succeeded - errored - stopped,
        "succeeded": succeeded,
        "errored": errored,
        "canceled": stopped - expired,
        "expired": expired,
    }


def _ts(dt) -> str | None:
    return dt.astimezone(UTC).isoformat().replace("+00:00", "Z") if dt else None


def processing_status(batch: Batch) -> str:
    return states.ANTHROPIC_PROCESSING_STATUS[batch.status]


def serialize(batch: Batch, base_url: str) -> dict:
    """The message_batch object. `base_url` is where this surface is served (…/v1/messages/batches/),
    so `results_url` points back at the prefix the caller used."""
    ended = batch.status in states.ANTHROPIC_ENDED
    return {
        "id": batch.public_id,
        "type": "message_batch",
        "processing_status": processing_status(batch),
        "request_counts": request_counts(batch),
        "ended_at": _ts(batch.completed_at) if ended else None,
        "created_at": _ts(batch.created_at),
        "expires_at": _ts(batch.expires_at),
        "archived_at": _ts(batch.frozen_at),  # set by retention: the results are no longer kept
        "cancel_initiated_at": _ts(batch.cancelling_at),
        "results_url": f"{base_url}{batch.public_id}/results" if ended else None,
        # Re-run what failed (batches/surfaces/retry.py): the batch this one re-runs, and its own retries.
        "retry_of": batch.retry_of_public_id,
        "retried_by": common.retried_by(batch),
    }


def page(rows: list[Batch], has_more: bool, base_url: str) -> dict:
    data = [serialize(b, base_url) for b in rows]
    return {
        "data": data,
        "has_more": has_more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


# --- cancel, delete -----------------------------------------------------------------------------


def cancel(batch: Batch) -> Batch:
    """in_progress → cancelling (then cancelled once nothing runs); an ended or cancelling batch is
    returned as it is (cancel is idempotent)."""
    stop.cancel_anthropic(batch.pk)
    return shown(batch.pk)


def delete(batch: Batch) -> None:
    """Delete an ended batch: its row, items, attempts and stored payloads (usage events stay)."""
    if batch.status not in states.ANTHROPIC_ENDED:
        raise invalid(
            f"Message batch {batch.public_id} is still {processing_status(batch)}: only an ended batch can be "
            "deleted; cancel it first."
        )
    with transaction.atomic():
        # Payloads go once this commits (batches.retention's post_delete receiver).
        Batch.objects.filter(pk=batch.pk, status__in=states.ANTHROPIC_ENDED).delete()


# --- results ------------------------------------------------------------------------------------

# How a relay-side failure code is typed in an errored result (anything else is an api_error).
_CODE_ERROR_TYPES = {
    Code.MODEL_NOT_FOUND: "not_found_error",
    Code.NO_HOST_BINDING: "not_found_error",
    Code.MODEL_NOT_ALLOWED: "permission_error",
    Code.NO_POLICY: "permission_error",
    Code.POLICY_DISABLED: "permission_error",
    Code.POLICY_UNAVAILABLE: "permission_error",
    Code.PROJECT_UNAVAILABLE: "permission_error",
    Code.CREDENTIAL_INVALID: "authentication_error",
    Code.RATE_LIMIT_EXCEEDED: "rate_limit_error",
    Code.TIMEOUT: "timeout_error",
    Code.INVALID_REQUEST: "invalid_request_error",
    Code.INVALID_ITEM: "invalid_request_error",
    Code.CROSS_SHAPE_DISPATCH: "invalid_request_error",
    Code.STREAMING_UNSUPPORTED: "invalid_request_error",
    Code.REQUEST_TOO_LARGE: "request_too_large",
}


def check_results(batch: Batch) -> None:
    """Refuse a results download (before it streams) of a batch still processing (400, as Anthropic)
    or archived by retention (404: the results are gone for good, the batch is still there)."""
    if batch.status not in states.ANTHROPIC_ENDED:
        raise invalid(
            f"Message batch {batch.public_id} is still {processing_status(batch)}: "
            "its results are available once processing_status is 'ended'."
        )
    if batch.frozen_counts is not None:
        raise AnthropicError(404, archived_message(batch), code="results_archived")


def archived_message(batch: Batch) -> str:
    keep = settings.RELAY_ANTHROPIC_RESULTS_RETENTION_SECONDS
    kept = f" (results are kept for {_span(keep)} after a batch is created)" if keep > 0 else ""
    return (
        f"The results of message batch {batch.public_id} were archived at {_ts(batch.frozen_at)}{kept} and are "
        "no longer available for download; the batch itself, with its request_counts, can still be retrieved."
    )


def _span(seconds: int) -> str:
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds % size == 0:
            n = seconds // size
            return f"{n} {unit}{'s' if n != 1 else ''}"
    return f"{seconds} seconds"


class ResultsCutShort(Exception):
    """Retention archived the batch while its results were streaming (the items went under the stream)."""


def iter_results(batch: Batch) -> Iterator[bytes]:
    """One JSONL line per request, in input order, one page of items in memory at a time.

    Every request has its line (an Anthropic batch's items are all stored at create): a stream that read
    fewer raced retention removing them, and raises rather than end as a short file that looks whole (the
    client sees a broken transfer, and on a retry the 404 of an archived batch)."""
    by_expiry = stopped_by_expiry(batch)
    sent = 0
    for row in common.result_rows(batch):
        yield common.jsonl({"custom_id": row["custom_id"], "result": _result(row, by_expiry)})
        sent += 1
    if sent != batch.total_items:
        log.warning(
            "batch %s: results stream cut short (%d of %d): archived meanwhile",
            batch.public_id,
            sent,
            batch.total_items,
        )
        raise ResultsCutShort(batch.public_id)


def _result(row: dict, by_expiry: bool) -> dict:
    state = row["state"]
    if state == ItemState.COMPLETED:
        try:
            return {"type": "succeeded", "message": common.stored_json(row)}
        except (storage.PayloadMissing, ValueError) as exc:
            return _errored("api_error", f"the stored result could not be read: {exc}", "result_unavailable")
    if state == ItemState.CANCELLED:
        expired = by_expiry or row["error_code"] == Code.BATCH_EXPIRED
        return {"type": "expired" if expired else "canceled"}
    if state != ItemState.DISCARDED:
        return _errored("api_error", "the request has not finished", "")  # never asked: results need an ended batch
    if row["error_code"] == Code.UPSTREAM_ERROR:
        # The upstream's own error, kept as it answered (bounded), in Anthropic's ErrorResponse shape.
        body = common.json_or(row["error_body"], lambda _: None)
        if isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict):
            return {"type": "errored", "error": body}
        message = row["error_body"] or common.failure_message(row["error"])
        return _errored(error_type(row["status_code"] or 500), message, Code.UPSTREAM_ERROR)
    code = row["error_code"] or Code.RELAY_ERROR
    return _errored(_CODE_ERROR_TYPES.get(code, "api_error"), common.failure_message(row["error"]), code)


def _errored(kind: str, message: str, code: str) -> dict:
    error = {"type": kind, "message": message}
    if code:
        error["code"] = code  # the relay's failure code (batches.outcomes.Code), beside Anthropic's type
    return {"type": "errored", "error": {"type": "error", "error": error}}
