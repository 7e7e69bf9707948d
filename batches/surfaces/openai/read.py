"""The OpenAI-compatible surface's reads: a batch (its owner's only) with its counts and usage, the
list of batches, and the Files API's files."""

import re
import uuid

from django.db.models import Count, IntegerField, OuterRef, Q, Subquery, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from batches.errors import invalid, not_found
from batches.models import Batch, File, FilePurpose, ItemState, Surface
from batches.surfaces import common
from core.auth import Principal
from core.dbfunctions import UUIDText
from core.errors import clipped, quoted
from usage.models import UsageEvent

# Ids are matched in full (fullmatch: `$` would also take a trailing newline, so `…%0A` addressed the batch).
_PUBLIC_ID = re.compile(r"(batch_|file-)([0-9a-f]{32})")


def parse_public_id(value: str, prefix: str) -> uuid.UUID | None:
    """batch_<hex> / file-<hex> → the row's UUID; None for anything else."""
    match = _PUBLIC_ID.fullmatch(value or "")
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
    qs = common.owned(principal, Surface.OPENAI).filter(pk=pk)
    batch = (with_progress(qs) if progress else qs).first() if pk is not None else None
    if batch is None:
        raise not_found(f"No batch found with id '{clipped(public_id)}'.")
    return batch


def _page_params(after: str | None, limit_raw: str | None, *, prefix: str, default: int, maximum: int):
    limit = common.parse_limit(
        limit_raw,
        default=default,
        maximum=maximum,
        refuse=lambda problem, code: invalid(f"Invalid 'limit': {problem}.", param="limit", code=code),
    )
    cursor = None
    if after:
        cursor = parse_public_id(after, prefix)
        if cursor is None:
            raise invalid(f"Invalid 'after': {quoted(after)} is not a {prefix}… id.", param="after")
    return cursor, limit


def openai_batches_page(principal: Principal, after: str | None, limit: str | None) -> tuple[list[Batch], bool]:
    """The owner's OpenAI batches, newest first, after the cursor: (page, has_more).

    Ids are UUIDv7, so id order is creation order and `after` is a keyset
    cursor: a page is one index range scan however many batches there are.
    Each row carries its counts and usage totals (`with_progress`), so a page
    of batch objects is one query, not two more per batch.
    """
    cursor, n = _page_params(after, limit, prefix="batch_", default=20, maximum=100)
    qs = common.owned(principal, Surface.OPENAI).order_by("-id")
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
    events = UsageEvent.objects.filter(batch_id=UUIDText(OuterRef("pk"))).order_by()
    by_batch = events.values("batch_id")
    annotations["usage_n"] = Subquery(by_batch.annotate(v=Count("*")).values("v"), output_field=IntegerField())
    for name, column in _USAGE_SUMS.items():
        annotations[name] = Subquery(by_batch.annotate(v=Sum(column)).values("v"), output_field=IntegerField())
    annotations["usage_cost"] = Subquery(
        by_batch.annotate(v=Sum(Coalesce("billed_cost_nano_usd", "cost_nano_usd"))).values("v"),
        output_field=IntegerField(),
    )
    counted = common.count_items(qs, {f"n_{state}": Q(state=state) for state in _COUNTED}).annotate(**annotations)
    return common.with_retried_by(counted)


def request_counts(batch: Batch) -> dict:
    """OpenAI's {total, completed, failed}: cancelled and expired records count as failed. Once retention
    has begun removing an ended batch's items (batches/retention.py), from the counts frozen on its row:
    the same terms, so the same numbers as before."""
    if batch.frozen_counts is not None:
        frozen = batch.frozen_counts
        states = {state: frozen.get(state, 0) for state in _COUNTED}
        done, failed = frozen.get("provider_done", 0), frozen.get("provider_failed", 0)
    elif hasattr(batch, "n_completed"):
        states = {state: getattr(batch, f"n_{state}") or 0 for state in _COUNTED}
        done, failed = common.provider_progress(batch)  # a provider job's records finished, not yet written
    else:
        states = common.counts(batch)
        done, failed = common.provider_progress(batch)
    return {
        "total": batch.total_items,
        "completed": states.get(ItemState.COMPLETED, 0) + done,
        "failed": states.get(ItemState.DISCARDED, 0) + states.get(ItemState.CANCELLED, 0) + failed,
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
        raise not_found(f"No such File object: {clipped(public_id)}")
    return file


def files_page(principal: Principal, params) -> tuple[list[File], bool]:
    """GET /v1/files: `after`, `limit` (1–10,000, default 10,000), `order` (asc|desc, default desc), `purpose`."""
    cursor, n = _page_params(params.get("after"), params.get("limit"), prefix="file-", default=10_000, maximum=10_000)
    order = params.get("order") or "desc"
    if order not in ("asc", "desc"):
        raise invalid(f"Invalid value for 'order': {quoted(order)}. Use 'asc' or 'desc'.", param="order")
    qs = live_files(principal)
    purpose = params.get("purpose")
    if purpose:
        if purpose not in FilePurpose.values:
            raise invalid(
                f"Invalid value for 'purpose': {quoted(purpose)}. Use one of {', '.join(FilePurpose.values)}.",
                param="purpose",
            )
        qs = qs.filter(purpose=purpose)
    if cursor is not None:
        qs = qs.filter(id__lt=cursor) if order == "desc" else qs.filter(id__gt=cursor)
    rows = list(qs.order_by("-id" if order == "desc" else "id")[: n + 1])
    return rows[:n], len(rows) > n
