"""Batch reads: ownership, progress and results (streamed); the OpenAI surface's batches and files."""

import json
import re
import uuid
from collections.abc import Iterator

from django.db import connection
from django.db.models import Count, IntegerField, OuterRef, Q, Subquery, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from batches import storage
from batches.errors import invalid, not_found
from batches.models import Attempt, Batch, File, FilePurpose, Item, ItemState, Surface
from relay.auth import Principal
from relay.dbfunctions import UUIDText
from relay.errors import RelayError
from usage.models import UsageEvent


def batch_for_owner(batch_id: str, principal: Principal) -> Batch:
    """The native batch if this caller submitted it; 404 otherwise, so existence is not leaked.

    Ids belong to a surface: a native batch is addressed by its UUID, an
    OpenAI-surface batch only by its batch_<hex> id (openai_batch_for_owner).
    """
    batch = None
    try:
        batch = Batch.objects.filter(pk=batch_id, owner_hash=principal.owner_hash, surface=Surface.NATIVE).first()
    except Exception:  # a malformed id is simply not found
        batch = None
    if batch is None:
        raise RelayError(404, "", "batch not found")
    return batch


def counts(batch: Batch) -> dict:
    rows = Item.objects.filter(batch=batch).values_list("state").annotate(n=Count("id")).order_by()
    return {state: n for state, n in rows}


def iter_status_json(batch: Batch) -> Iterator[bytes]:
    """The spec's status object; its `items` list (one entry per item, 50,000 at most)
    is streamed in chunks so polling a large batch costs constant memory."""
    head = {
        "ID": str(batch.id),
        "RelayKeyHash": batch.owner_hash,
        "PolicyID": str(batch.policy_id or ""),
        "InboundShape": batch.inbound_shape,
        "Status": batch.status,
        "TotalItems": batch.total_items,
        "CreatedAt": _iso(batch.created_at),
        "CompletedAt": _iso(batch.completed_at),
        "ProjectID": str(batch.project_id or ""),
        "TeamID": str(batch.team_id or ""),
        "PrincipalKind": batch.principal_kind,
        "PrincipalID": str(batch.principal_id),
        "CredentialKind": batch.credential_kind,
        "CredentialID": batch.credential_id,
        "counts": counts(batch),
        # The batch's opt-in to waiting and retrying, as submitted; null keeps spec 000's fail-at-once.
        "retry": (
            {"max_attempts": batch.max_attempts, "wait_for_capacity": batch.wait_for_capacity}
            if batch.retry_transient or batch.wait_for_capacity
            else None
        ),
    }
    yield json.dumps(head)[:-1].encode() + b', "items": ['
    # Raw rows from a server-side cursor, 5,000 a time: no ORM row handling per item.
    item = Item._meta
    sql = f'SELECT "idx", "state" FROM "{item.db_table}" WHERE "{item.get_field("batch").column}" = %s ORDER BY "idx"'
    first = True
    with connection.chunked_cursor() as cursor:
        cursor.execute(sql, [Batch._meta.pk.get_db_prep_value(batch.pk, connection)])
        while rows := cursor.fetchmany(5000):
            text = ", ".join([f'{{"idx": {idx}, "state": "{state}"}}' for idx, state in rows])
            yield (text if first else ", " + text).encode()
            first = False
    yield b"]}"


# Rows fetched from the server-side cursor at a time, and the size of each chunk handed to the server.
RESULTS_ROWS = 2000
WRITE_CHUNK = 256 * 1024
_DECODER = json.JSONDecoder()


def iter_results_json(batch: Batch) -> Iterator[bytes]:
    """`{"results": [...]}` in item order, in constant memory for any size.

    Raw rows from a server-side cursor (no model instances), the stored bodies
    of each page read at once (storage.read_many), and output handed on in
    WRITE_CHUNK pieces rather than one write per item.
    """
    item, attempt = Item._meta, Attempt._meta
    sql = (
        f'SELECT i."idx", i."state", i."result_ref", i."error", i."error_body", i."status_code", '
        f'(SELECT COUNT(*) FROM "{attempt.db_table}" a WHERE a."{attempt.get_field("item").column}" = i."id") '
        f'FROM "{item.db_table}" i WHERE i."{item.get_field("batch").column}" = %s ORDER BY i."idx"'
    )
    out = [b'{"results":[']
    size, first = 0, True
    completed = ItemState.COMPLETED
    with connection.chunked_cursor() as cursor:
        cursor.execute(sql, [Batch._meta.pk.get_db_prep_value(batch.pk, connection)])
        while rows := cursor.fetchmany(RESULTS_ROWS):
            refs = [row[2] for row in rows if row[1] == completed and row[2]]
            bodies = iter(storage.read_many(refs)) if refs else iter(())
            for idx, state, result_ref, error, error_body, status_code, n_attempts in rows:
                piece = (
                    (b'{"idx":' if first else b',{"idx":')
                    + str(idx).encode()
                    + b',"state":'
                    + (_STATES.get(state) or json.dumps(state).encode())
                )
                first = False
                if state == completed and result_ref:
                    body = next(bodies)
                    if isinstance(body, storage.PayloadMissing):
                        piece += b',"error":' + json.dumps(f"batch: load result: {body}").encode()
                    elif _is_json(body):  # only valid JSON is spliced in verbatim
                        piece += b',"response":' + body
                    else:
                        piece += b',"error":' + json.dumps(f"batch: load result: {_json_error(body)}").encode()
                elif error:
                    piece += b',"error":' + json.dumps(error).encode()
                    if status_code:
                        piece += b',"status_code":' + str(status_code).encode()
                    if error_body:
                        piece += b',"error_body":' + _error_body_json(error_body)
                if n_attempts:
                    # Tries that reached a provider (retries and 429 waits included); each is in the attempt history.
                    piece += b',"attempts":' + str(n_attempts).encode()
                out.append(piece + b"}")
                size += len(piece)
                if size >= WRITE_CHUNK:
                    yield b"".join(out)
                    out, size = [], 0
    out.append(b"]}")
    yield b"".join(out)


_STATES = {state: json.dumps(state).encode() for state in ItemState.values}


def _is_json(body: bytes) -> bool:
    """Whether `body` is one JSON document (what json.loads accepts), checked the fast way first."""
    try:
        text = body.decode()
        _, end = _DECODER.raw_decode(text)
        if end == len(text):
            return True
    except (UnicodeDecodeError, ValueError):
        pass
    try:  # leading/trailing whitespace, another encoding, …: json.loads decides, as before
        json.loads(body)
    except ValueError:
        return False
    return True


def _json_error(body: bytes) -> str:
    try:
        json.loads(body)
    except ValueError as exc:
        return str(exc)
    return "not JSON"


def _error_body_json(text: str) -> bytes:
    """The upstream's error body as JSON when it is JSON, else as a string."""
    try:
        return json.dumps(json.loads(text)).encode()
    except ValueError:
        return json.dumps(text).encode()


def _iso(dt):
    return dt.isoformat().replace("+00:00", "Z") if dt else None


# --- the OpenAI surface -------------------------------------------------------------------

_PUBLIC_ID = re.compile(r"^(batch_|file-)([0-9a-f]{32})$")


def parse_public_id(value: str, prefix: str) -> uuid.UUID | None:
    """batch_<hex> / file-<hex> → the row's UUID; None for anything else."""
    match = _PUBLIC_ID.match(value or "")
    if match is None or match.group(1) != prefix:
        return None
    return uuid.UUID(hex=match.group(2))


def is_openai_batch_id(value: str) -> bool:
    """Whether an id is in the OpenAI surface's form (well-formed or not): it is answered in that surface's shape."""
    return value.startswith("batch_")


def openai_batch_for_owner(public_id: str, principal: Principal, *, progress: bool = False) -> Batch:
    """The OpenAI-surface batch if this caller created it (404 otherwise); with its counts and usage
    in the same query when `progress` (for showing it, not for changing it)."""
    pk = parse_public_id(public_id, "batch_")
    qs = Batch.objects.filter(pk=pk, owner_hash=principal.owner_hash, surface=Surface.OPENAI)
    batch = (with_progress(qs) if progress else qs).first() if pk is not None else None
    if batch is None:
        raise not_found(f"No batch found with id '{public_id}'.")
    return batch


def _page_params(after: str | None, limit_raw: str | None, *, prefix: str, default: int, maximum: int):
    if limit_raw in (None, ""):
        limit = default
    else:
        try:
            limit = int(limit_raw)
        except ValueError:
            raise invalid(
                f"Invalid 'limit': expected an integer, but got {limit_raw!r} instead.",
                param="limit",
                code="invalid_type",
            ) from None
        if limit < 1:
            raise invalid(
                f"Invalid 'limit': integer below minimum value. Expected a value >= 1, but got {limit} instead.",
                param="limit",
                code="integer_below_min_value",
            )
        if limit > maximum:
            raise invalid(
                f"Invalid 'limit': integer above maximum value. Expected a value <= {maximum}, "
                f"but got {limit} instead.",
                param="limit",
                code="integer_above_max_value",
            )
    cursor = None
    if after:
        cursor = parse_public_id(after, prefix)
        if cursor is None:
            raise invalid(f"Invalid 'after': {after!r} is not a {prefix}… id.", param="after")
    return cursor, limit


def openai_batches_page(principal: Principal, after: str | None, limit: str | None) -> tuple[list[Batch], bool]:
    """The owner's OpenAI batches, newest first, after the cursor: (page, has_more).

    Ids are UUIDv7, so id order is creation order and `after` is a keyset
    cursor: a page is one index range scan however many batches there are.
    Each row carries its counts and usage totals (`with_progress`), so a page
    of batch objects is one query, not two more per batch.
    """
    cursor, n = _page_params(after, limit, prefix="batch_", default=20, maximum=100)
    qs = Batch.objects.filter(owner_hash=principal.owner_hash, surface=Surface.OPENAI).order_by("-id")
    if cursor is not None:
        qs = qs.filter(id__lt=cursor)
    rows = list(with_progress(qs)[: n + 1])
    return rows[:n], len(rows) > n


_COUNTED = (ItemState.COMPLETED, ItemState.DISCARDED, ItemState.CANCELLED)
_USAGE_SUMS = {
    "usage_input": "input_tokens",
    "usage_cache_read": "cache_read_tokens",
    "usage_cache_write": "cache_write_tokens",
    "usage_output": "output_tokens",
}


def with_progress(qs):
    """Annotate batches with their item counts per final state and their usage totals.

    Each is a correlated subquery on an index (items by batch and state, events
    by batch id), so the whole page is one statement whatever its size.
    """
    annotations = {}
    for state in _COUNTED:
        items = Item.objects.filter(batch_id=OuterRef("pk"), state=state).order_by()
        annotations[f"n_{state}"] = Subquery(
            items.values("batch_id").annotate(c=Count("*")).values("c"), output_field=IntegerField()
        )
    events = UsageEvent.objects.filter(batch_id=UUIDText(OuterRef("pk"))).order_by()
    by_batch = events.values("batch_id")
    annotations["usage_n"] = Subquery(by_batch.annotate(v=Count("*")).values("v"), output_field=IntegerField())
    for name, column in _USAGE_SUMS.items():
        annotations[name] = Subquery(by_batch.annotate(v=Sum(column)).values("v"), output_field=IntegerField())
    annotations["usage_cost"] = Subquery(
        by_batch.annotate(v=Sum(Coalesce("billed_cost_nano_usd", "cost_nano_usd"))).values("v"),
        output_field=IntegerField(),
    )
    return qs.annotate(**annotations)


def request_counts(batch: Batch) -> dict:
    """OpenAI's {total, completed, failed}: cancelled and expired records count as failed."""
    if hasattr(batch, "n_completed"):
        states = {state: getattr(batch, f"n_{state}") or 0 for state in _COUNTED}
    else:
        states = counts(batch)
    return {
        "total": batch.total_items,
        "completed": states.get(ItemState.COMPLETED, 0),
        "failed": states.get(ItemState.DISCARDED, 0) + states.get(ItemState.CANCELLED, 0),
    }


def usage(batch: Batch) -> dict | None:
    """Token and cost totals of the batch's usage events; None before any item has one.

    cost_nano_usd is what the caller pays: each event's discounted price
    (billed_cost_nano_usd), or its cost where no discount applies. Unpriced
    events add tokens but no cost.
    """
    if hasattr(batch, "usage_n"):
        totals = {
            "n": batch.usage_n or 0,
            **{name[len("usage_") :]: getattr(batch, name) or 0 for name in _USAGE_SUMS},
            "cost": batch.usage_cost or 0,
        }
    else:
        totals = UsageEvent.objects.filter(batch_id=str(batch.id)).aggregate(
            n=Count("id"),
            input=Coalesce(Sum("input_tokens"), 0),
            cache_read=Coalesce(Sum("cache_read_tokens"), 0),
            cache_write=Coalesce(Sum("cache_write_tokens"), 0),
            output=Coalesce(Sum("output_tokens"), 0),
            cost=Coalesce(Sum(Coalesce("billed_cost_nano_usd", "cost_nano_usd")), 0),
        )
    if not totals["n"]:
        return None
    # OpenAI's input_tokens include cached ones (cached_tokens is a detail of it).
    input_tokens = totals["input"] + totals["cache_read"] + totals["cache_write"]
    return {
        "input_tokens": input_tokens,
        "output_tokens": totals["output"],
        "total_tokens": input_tokens + totals["output"],
        "input_tokens_details": {"cached_tokens": totals["cache_read"]},
        # Reasoning tokens are counted inside output_tokens; the relay does not meter them apart.
        "output_tokens_details": {"reasoning_tokens": 0},
        "cost_nano_usd": totals["cost"],
    }


def live_files(principal: Principal):
    """The caller's files that have not expired: one past its `expires_at` is gone from the API at once,
    even before the retention sweep removes its row and bytes."""
    now = timezone.now()
    return File.objects.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now), owner_hash=principal.owner_hash)


def file_for_owner(public_id: str, principal: Principal) -> File:
    pk = parse_public_id(public_id, "file-")
    file = live_files(principal).filter(pk=pk).first() if pk is not None else None
    if file is None:
        raise not_found(f"No such File object: {public_id}")
    return file


def files_page(principal: Principal, params) -> tuple[list[File], bool]:
    """GET /v1/files: `after`, `limit` (1–10,000, default 10,000), `order` (asc|desc, default desc), `purpose`."""
    cursor, n = _page_params(params.get("after"), params.get("limit"), prefix="file-", default=10_000, maximum=10_000)
    order = params.get("order") or "desc"
    if order not in ("asc", "desc"):
        raise invalid(f"Invalid value for 'order': {order!r}. Use 'asc' or 'desc'.", param="order")
    qs = live_files(principal)
    purpose = params.get("purpose")
    if purpose:
        if purpose not in FilePurpose.values:
            raise invalid(
                f"Invalid value for 'purpose': {purpose!r}. Use one of {', '.join(FilePurpose.values)}.",
                param="purpose",
            )
        qs = qs.filter(purpose=purpose)
    if cursor is not None:
        qs = qs.filter(id__lt=cursor) if order == "desc" else qs.filter(id__gt=cursor)
    rows = list(qs.order_by("-id" if order == "desc" else "id")[: n + 1])
    return rows[:n], len(rows) > n
