"""The Anthropic-compatible batch surface (Message Batches): create, retrieve, list, results, delete, expiry.

Same Batch and Item rows and the same execution path as the other surfaces
(batches/services.py: claim, run_item, finish, heartbeat, sweep); each request's
`params` is an item whose body goes to `/v1/messages` on an `anthropic` binding,
as a live call would. Unlike the OpenAI surface there is no background
validation and no output file: the requests are checked and stored as items in
the create call (Anthropic answers a malformed batch with a 400), and the
results are read from the items when asked for, streamed as JSONL.

How a batch moves (cancel, expiry, ending) lives in batches/lifecycle.py; this
module maps its statuses onto Anthropic's `processing_status`:

    in_progress → in_progress     cancelling → canceling     completed | expired | cancelled → ended

Errors are in Anthropic's envelope: {"type": "error", "error": {"type", "message"}}.
"""

import json
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, timedelta

import uuid6
from django.conf import settings
from django.db import transaction
from django.db.models import Count, IntegerField, OuterRef, Q, Subquery
from django.utils import timezone

from batches import bulk, ingest, lifecycle, openai_batches, storage
from batches.models import Batch, BatchStatus, Item, ItemState, Shape, Surface
from batches.outcomes import Code
from relay.auth import Principal
from relay.errors import RelayError

ID_PREFIX = "msgbatch_"
_PUBLIC_ID = re.compile(r"^msgbatch_([0-9a-f]{32})$")
# Anthropic's rule for a request's custom_id.
CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
REQUEST_KEYS = {"custom_id", "params"}
LIST_DEFAULT, LIST_MAX = 20, 1000
PAGE = 1000


# --- errors -------------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class AnthropicError(RelayError):
    """Anthropic's envelope: {"type": "error", "error": {"type", "message"}} (the SDK maps the status)."""

    def __init__(self, status: int, message: str, *, headers: dict | None = None):
        super().__init__(status, "", message, type=error_type(status), headers=headers)

    def body(self) -> dict:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}

    @classmethod
    def of(cls, exc: RelayError) -> "AnthropicError":
        if isinstance(exc, AnthropicError):
            return exc
        # A batch body over the limit is 400 on the other batch surfaces; Anthropic answers 413.
        status = 413 if exc.code == "request_too_large" else exc.status
        message = f"{exc.param}: {exc.message}" if exc.param and exc.param not in exc.message else exc.message
        return cls(status, message, headers=exc.headers)


def invalid(message: str) -> AnthropicError:
    return AnthropicError(400, message)


def check_access(principal: Principal) -> None:
    """404 unless the credential's policy grants batch access (the OpenAI surface's rule, Anthropic's envelope)."""
    openai_batches.check_access(principal)


# --- create -------------------------------------------------------------------------------------


def create(principal: Principal, submission: ingest.Submission) -> Batch:
    """POST /v1/messages/batches → an `in_progress` batch whose requests are already items.

    Every request is checked first (custom_id, params, duplicates); a bad one is
    a 400 and nothing is stored. The batch waits for capacity and retries
    transient failures like an OpenAI-surface batch, and is billed at the batch
    discount (RELAY_BATCH_DISCOUNT_PERCENT, fixed on the batch).
    """
    check_access(principal)
    top = submission.top
    unknown = sorted(set(top) - {"requests"})
    if unknown:
        raise invalid(f"{unknown[0]}: Extra inputs are not permitted")
    if "requests" not in top:
        raise invalid("requests: Field required")
    if not submission.count:
        raise invalid("requests: List should have at least 1 item after validation, not 0")
    max_items = settings.RELAY_BATCH_MAX_ITEMS
    if submission.count > max_items:
        raise invalid(
            f"requests: too many requests: {submission.count}, at most {max_items} per batch (RELAY_BATCH_MAX_ITEMS)"
        )
    batch_id = uuid6.uuid7()
    now = timezone.now()
    writer = storage.input_writer(str(batch_id))
    try:
        with transaction.atomic():
            seen: set[str] = set()

            def rows():
                for idx, element in enumerate(submission.elements()):
                    # The element was checked by relay.jsonguard when the body was read (batches.ingest).
                    custom_id, params = _request(idx, json.loads(element), seen)
                    yield idx, writer.add(idx, ingest.dumps(params)), custom_id

            bulk.copy_new_items(
                batch_id, rows(), max_attempts=settings.RELAY_BATCH_MAX_ATTEMPTS, stream=not writer.uses_db
            )
            writer.close()
            batch = Batch.objects.create(
                id=batch_id,
                surface=Surface.ANTHROPIC,
                inbound_shape=Shape.ANTHROPIC,  # items route like /v1/messages: an `anthropic` binding
                status=BatchStatus.IN_PROGRESS,
                total_items=submission.count,
                created_at=now,
                in_progress_at=now,
                expires_at=now + timedelta(seconds=settings.RELAY_BATCH_COMPLETION_WINDOW_SECONDS),
                discount_percent=settings.RELAY_BATCH_DISCOUNT_PERCENT,
                # Anthropic's users expect a batch to wait out a busy provider and retry what is transient.
                max_attempts=settings.RELAY_BATCH_MAX_ATTEMPTS,
                retry_transient=True,
                wait_for_capacity=True,
                **Batch.attribution(principal),
            )
            transaction.on_commit(lifecycle.wake_workers)
    except BaseException:
        writer.discard()
        raise
    return batch


def _request(idx: int, request, seen: set) -> tuple[str, dict]:
    where = f"requests.{idx}"
    unknown = sorted(set(request) - REQUEST_KEYS)
    if unknown:
        raise invalid(f"{where}.{unknown[0]}: Extra inputs are not permitted")
    custom_id = request.get("custom_id")
    if custom_id is None:
        raise invalid(f"{where}.custom_id: Field required")
    if not isinstance(custom_id, str) or not CUSTOM_ID.match(custom_id):
        raise invalid(f"{where}.custom_id: must be 1 to 64 characters of letters, digits, '_' and '-'")
    if custom_id in seen:
        raise invalid(f"{where}.custom_id: Duplicate custom_id {custom_id!r}; each request needs its own")
    seen.add(custom_id)
    params = request.get("params")
    if params is None:
        raise invalid(f"{where}.params: Field required")
    if not isinstance(params, dict):
        raise invalid(f"{where}.params: Input should be an object (the body of a Messages API request)")
    return custom_id, params


# --- reads --------------------------------------------------------------------------------------


def parse_id(value: str) -> uuid.UUID | None:
    match = _PUBLIC_ID.match(value or "")
    return uuid.UUID(hex=match.group(1)) if match else None


def _owned(principal: Principal):
    return Batch.objects.filter(owner_hash=principal.owner_hash, surface=Surface.ANTHROPIC)


def batch_for_owner(public_id: str, principal: Principal, *, counts: bool = False) -> Batch:
    """The Anthropic-surface batch if this caller created it; 404 for anyone else (and any other id)."""
    pk = parse_id(public_id)
    qs = _owned(principal).filter(pk=pk)
    batch = (with_counts(qs) if counts else qs).first() if pk is not None else None
    if batch is None:
        raise AnthropicError(404, f"No message batch found with id '{public_id}'.")
    return batch


def shown(batch_id) -> Batch:
    """The batch with its counts, as the API shows it."""
    return with_counts(Batch.objects.filter(pk=batch_id)).get()


def batches_page(principal: Principal, params) -> tuple[list[Batch], bool]:
    """GET /v1/messages/batches: newest first; `after_id` pages to older batches, `before_id` to newer
    ones; `limit` 1–1000 (default 20). Keyset on the UUIDv7 id: one index range scan per page."""
    before, after = params.get("before_id"), params.get("after_id")
    if before and after:
        raise invalid("Only one of before_id and after_id may be given.")
    limit_raw = params.get("limit")
    limit = LIST_DEFAULT
    if limit_raw not in (None, ""):
        try:
            limit = int(limit_raw)
        except ValueError:
            raise invalid(f"limit: Input should be a valid integer, got {limit_raw!r}") from None
        if not 1 <= limit <= LIST_MAX:
            raise invalid(f"limit: Input should be between 1 and {LIST_MAX}, got {limit}")
    qs = with_counts(_owned(principal))
    cursor_raw = before or after
    if cursor_raw:
        cursor = parse_id(cursor_raw)
        if cursor is None:
            name = "before_id" if before else "after_id"
            raise invalid(f"{name}: {cursor_raw!r} is not a message batch id (msgbatch_…)")
        if before:
            rows = list(qs.filter(id__gt=cursor).order_by("id")[: limit + 1])
            return list(reversed(rows[:limit])), len(rows) > limit
        qs = qs.filter(id__lt=cursor)
    rows = list(qs.order_by("-id")[: limit + 1])
    return rows[:limit], len(rows) > limit


def with_counts(qs):
    """Annotate batches with their final items per kind (correlated subqueries on the items' index)."""
    kinds = {
        "n_succeeded": Q(state=ItemState.COMPLETED),
        "n_errored": Q(state=ItemState.DISCARDED),
        "n_stopped": Q(state=ItemState.CANCELLED),
        "n_expired": Q(state=ItemState.CANCELLED, error_code=Code.BATCH_EXPIRED),
    }
    annotations = {}
    for name, condition in kinds.items():
        items = Item.objects.filter(condition, batch_id=OuterRef("pk")).order_by().values("batch_id")
        annotations[name] = Subquery(items.annotate(c=Count("*")).values("c"), output_field=IntegerField())
    return qs.annotate(**annotations)


def _stopped_by_expiry(batch: Batch) -> bool:
    """Whether a request stopped without its own code (at a heartbeat) was stopped by the window closing."""
    if batch.expired_at is None:
        return False
    return batch.cancelling_at is None or batch.expired_at <= batch.cancelling_at


def request_counts(batch: Batch) -> dict:
    """processing / succeeded / errored / canceled / expired; live (they always sum to the total)."""
    if not hasattr(batch, "n_succeeded"):
        batch = shown(batch.pk)
    succeeded, errored = batch.n_succeeded or 0, batch.n_errored or 0
    stopped, expired = batch.n_stopped or 0, batch.n_expired or 0
    if _stopped_by_expiry(batch):
        expired = stopped
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
    return lifecycle.ANTHROPIC_PROCESSING_STATUS[batch.status]


def serialize(batch: Batch, base_url: str) -> dict:
    """The message_batch object. `base_url` is where this surface is served (…/v1/messages/batches/),
    so `results_url` points back at the prefix the caller used."""
    ended = batch.status in lifecycle.ANTHROPIC_ENDED
    return {
        "id": batch.public_id,
        "type": "message_batch",
        "processing_status": processing_status(batch),
        "request_counts": request_counts(batch),
        "ended_at": _ts(batch.completed_at) if ended else None,
        "created_at": _ts(batch.created_at),
        "expires_at": _ts(batch.expires_at),
        "archived_at": None,  # results are kept until the batch is deleted
        "cancel_initiated_at": _ts(batch.cancelling_at),
        "results_url": f"{base_url}{batch.public_id}/results" if ended else None,
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
    lifecycle.cancel_anthropic(batch.pk)
    return shown(batch.pk)


def delete(batch: Batch) -> None:
    """Delete an ended batch: its row, items, attempts and stored payloads (usage events stay)."""
    if batch.status not in lifecycle.ANTHROPIC_ENDED:
        raise invalid(
            f"Message batch {batch.public_id} is still {processing_status(batch)}: only an ended batch can be "
            "deleted; cancel it first."
        )
    with transaction.atomic():
        # Payloads go once this commits (batches.retention's post_delete receiver).
        Batch.objects.filter(pk=batch.pk, status__in=lifecycle.ANTHROPIC_ENDED).delete()


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
_FIELDS = ("id", "idx", "custom_id", "state", "result_ref", "status_code", "error", "error_code", "error_body")
_PREFIXES = ("batch item: ", "batch: ")


def iter_results(batch: Batch) -> Iterator[bytes]:
    """One JSONL line per request, in input order, one page of items in memory at a time."""
    by_expiry = _stopped_by_expiry(batch)
    last = -1
    while True:
        rows = list(Item.objects.filter(batch_id=batch.pk, idx__gt=last).order_by("idx").values(*_FIELDS)[:PAGE])
        if not rows:
            return
        for row in rows:
            line = {"custom_id": row["custom_id"], "result": _result(row, by_expiry)}
            yield json.dumps(line, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
        last = rows[-1]["idx"]


def _result(row: dict, by_expiry: bool) -> dict:
    state = row["state"]
    if state == ItemState.COMPLETED:
        try:
            return {"type": "succeeded", "message": json.loads(storage.read(row["result_ref"]))}
        except (storage.PayloadMissing, ValueError) as exc:
            return _errored("api_error", f"the stored result could not be read: {exc}", "result_unavailable")
    if state == ItemState.CANCELLED:
        expired = by_expiry or row["error_code"] == Code.BATCH_EXPIRED
        return {"type": "expired" if expired else "canceled"}
    if state != ItemState.DISCARDED:
        return _errored("api_error", "the request has not finished", "")  # never asked: results need an ended batch
    if row["error_code"] == Code.UPSTREAM_ERROR:
        # The upstream's own error, kept as it answered (bounded), in Anthropic's ErrorResponse shape.
        body = _json_or_none(row["error_body"])
        if isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict):
            return {"type": "errored", "error": body}
        message = row["error_body"] or _message(row["error"])
        return _errored(error_type(row["status_code"] or 500), message, Code.UPSTREAM_ERROR)
    code = row["error_code"] or Code.RELAY_ERROR
    return _errored(_CODE_ERROR_TYPES.get(code, "api_error"), _message(row["error"]), code)


def _errored(kind: str, message: str, code: str) -> dict:
    error = {"type": kind, "message": message}
    if code:
        error["code"] = code  # the relay's failure code (batches.outcomes.Code), beside Anthropic's type
    return {"type": "errored", "error": {"type": "error", "error": error}}


def _json_or_none(text: str):
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def _message(error: str) -> str:
    for prefix in _PREFIXES:
        if error.startswith(prefix):
            return error[len(prefix) :]
    return error or "The request failed."


# --- the sweeper's part -------------------------------------------------------------------------


def expire_due(now) -> int:
    """Close the window of in_progress batches past expires_at (lifecycle.expire_anthropic); 100 per sweep."""
    due = Batch.objects.filter(
        surface=Surface.ANTHROPIC, status=BatchStatus.IN_PROGRESS, expired_at__isnull=True, expires_at__lte=now
    )
    return sum(lifecycle.expire_anthropic(batch_id, now) for batch_id in due.values_list("id", flat=True)[:100])
