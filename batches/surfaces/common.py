"""What the three batch surfaces share at their edges, written once: the batch-access gate, the owner's
batches of a surface, the `limit` of a list, the final items of a batch counted per kind, its items read a page
at a time for results, a failure's message without the relay's prefixes, the waiting and
retrying that the OpenAI and Anthropic surfaces apply to every batch, and a batch's retries
(`retry_of` / `retried_by`, batches/surfaces/retry.py)."""

import json
import logging
import uuid
from collections.abc import Callable, Iterator

from django.conf import settings
from django.db.models import Count, Field, IntegerField, OuterRef, Q, Subquery, Sum

from batches import storage
from batches.errors import no_batch_access
from batches.models import Batch, Item, ItemState
from batches.provider.models import JobStatus, ProviderJob
from core.auth import Principal
from core.errors import RelayError, quoted
from core.http import ascii_int
from policies.models import Policy

log = logging.getLogger(__name__)

# Items of a batch read per query when its results are written or streamed.
RESULT_PAGE = 1000
RESULT_FIELDS = ("id", "idx", "custom_id", "state", "result_ref", "status_code", "error", "error_code", "error_body")
# What the worker puts in front of an item's failure message (batches/worker/execute.py).
_FAILURE_PREFIXES = ("batch item: ", "batch: ")


def check_access(principal: Principal) -> None:
    """404 unless the credential's policy grants batch access (OpenAI: 404 without Batch API access); raised
    in OpenAI's envelope, which each surface's view re-shapes into its own."""
    policy = (
        Policy.objects.filter(pk=principal.policy_id).only("batch_enabled").first() if principal.policy_id else None
    )
    if policy is None or not policy.batch_enabled:
        raise no_batch_access()


def owned(principal: Principal, surface: str):
    """The caller's batches of one surface: another owner's, or another surface's, are not found."""
    return Batch.objects.filter(owner_hash=principal.owner_hash, surface=surface)


def parse_limit(raw: str | None, *, default: int, maximum: int, refuse: Callable[[str, str], RelayError]) -> int:
    """A list's `limit`: ASCII digits only (not "", "+5", " 5", "5_0" or other scripts' digits), from 1
    to `maximum`; `refuse(problem, code)` makes the surface's own error."""
    if raw is None:
        return default
    limit = ascii_int(raw)
    if limit is None:
        raise refuse(f"expected an integer, but got {quoted(raw)} instead", "invalid_type")
    if limit < 1:
        raise refuse(
            f"integer below minimum value. Expected a value >= 1, but got {limit} instead", "integer_below_min_value"
        )
    if limit > maximum:
        raise refuse(
            f"integer above maximum value. Expected a value <= {maximum}, but got {limit} instead",
            "integer_above_max_value",
        )
    return limit


def counts(batch: Batch) -> dict:
    """How many of the batch's items are in each state: from its row once it ended (Batch.ended_counts)."""
    if batch.ended_counts is not None:
        return dict(batch.ended_counts)
    rows = Item.objects.filter(batch=batch).values_list("state").annotate(n=Count("id")).order_by()
    return {state: n for state, n in rows}


def item_counts(batches: list) -> dict:
    """{batch id: {state: items}} of these batches (the admin's batches list and the console's batches in flight):
    an ended batch's from its row, the others' in one grouped read of the (batch, state) index, so a page costs
    what its running batches hold, not what a million ended items would."""
    out: dict = {b.pk: dict(b.ended_counts) for b in batches if b.ended_counts is not None}
    running = [b.pk for b in batches if b.ended_counts is None]
    if not running:
        return out
    rows = Item.objects.filter(batch_id__in=running).values_list("batch_id", "state").annotate(n=Count("pk"))
    for batch_id, state, n in rows.order_by():
        out.setdefault(batch_id, {})[state] = n
    return out


def count_items(qs, kinds: dict[str, Q]):
    """Annotate batches with how many of their items match each kind (`n` per name): a correlated
    subquery per kind on the items' (batch, state) index, so a page of batches is one statement. Also the
    provider's own counts of its running jobs (`at_provider_done`, `at_provider_failed`): records it finished
    whose results are not written yet (`provider_progress`)."""
    annotations = {}
    for name, condition in kinds.items():
        items = Item.objects.filter(condition, batch_id=OuterRef("pk")).order_by().values("batch_id")
        annotations[name] = Subquery(items.annotate(c=Count("*")).values("c"), output_field=IntegerField())
    running = ProviderJob.objects.filter(batch_id=OuterRef("pk"), status=JobStatus.RUNNING).order_by()
    for name, column in (("at_provider_done", "completed"), ("at_provider_failed", "failed")):
        total = running.values("batch_id").annotate(v=Sum(column)).values("v")
        annotations[name] = Subquery(total, output_field=IntegerField())
    return qs.annotate(**annotations)


def provider_progress(batch: Batch) -> tuple[int, int]:
    """(finished, failed) by the provider's counts of the batch's running jobs: request counts move while
    a provider job runs, before its results are written to the items."""
    if hasattr(batch, "at_provider_done"):
        return batch.at_provider_done or 0, batch.at_provider_failed or 0
    totals = ProviderJob.objects.filter(batch_id=batch.pk, status=JobStatus.RUNNING).aggregate(
        done=Sum("completed"), failed=Sum("failed")
    )
    return totals["done"] or 0, totals["failed"] or 0


def result_rows(batch: Batch) -> Iterator[dict]:
    """The batch's items in input order (RESULT_FIELDS), one page in memory at a time. A completed item's row
    also carries its stored result as `stored` (read it with `stored_json`): a page's results are read
    together (storage.read_many: on s3 one GET per group object of neighbouring results, not one per result;
    in the database one query)."""
    last = -1
    while True:
        page = list(
            Item.objects.filter(batch_id=batch.pk, idx__gt=last).order_by("idx").values(*RESULT_FIELDS)[:RESULT_PAGE]
        )
        if not page:
            return
        done = [row for row in page if row["state"] == ItemState.COMPLETED]
        for row, stored in zip(done, storage.read_many([row["result_ref"] for row in done]), strict=True):
            row["stored"] = stored
        yield from page
        last = page[-1]["idx"]


def stored_json(row: dict):
    """A completed item's result (result_rows' `stored`) parsed; raises storage.PayloadMissing when it could not
    be read and ValueError when it is not JSON."""
    stored = row["stored"]
    if isinstance(stored, storage.PayloadMissing):
        raise stored
    return json.loads(stored)


def jsonl(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def failure_message(error: str) -> str:
    """An item's failure as a tenant reads it: without the relay's `batch item: ` / `batch: ` prefix."""
    for prefix in _FAILURE_PREFIXES:
        if error.startswith(prefix):
            return error[len(prefix) :]
    return error or "The request failed."


def json_or(text: str, fallback):
    """`text` parsed as JSON, or `fallback` (given the text) when it is not JSON."""
    try:
        return json.loads(text) if text else fallback(text)
    except ValueError:
        return fallback(text)


def waiting_and_retrying() -> dict:
    """A batch of the OpenAI or Anthropic surface waits out a busy provider and retries what is
    transient (docs/decisions/0007-busy-provider-waits.md); the native surface opts in per batch."""
    return {"max_attempts": settings.RELAY_BATCH_MAX_ATTEMPTS, "retry_transient": True, "wait_for_capacity": True}


# --- retries (batches/surfaces/retry.py) -----------------------------------------------------------


class _ChildIds(Subquery):
    """The ids of the batches made from each row by retry_failed, oldest first, as one column of the
    row's own statement: an array on PostgreSQL, a JSON array on SQLite (embedded mode)."""

    template = "ARRAY(%(subquery)s)"

    def __init__(self):
        children = Batch.objects.filter(retry_of=OuterRef("pk")).order_by("id").values("id")
        super().__init__(children, output_field=Field())  # no converter: the value is read in retried_by()

    def as_sqlite(self, compiler, connection, **extra):
        return self.as_sql(compiler, connection, template="(SELECT json_group_array(id) FROM (%(subquery)s))")


def with_retried_by(qs):
    """Annotate batches with `retried_by_ids`, in the same statement (a detail GET stays one query)."""
    return qs.annotate(retried_by_ids=_ChildIds())


def retried_by(batch: Batch) -> list[str]:
    """The public ids of the batches that re-ran this one's failed records, oldest first."""
    if hasattr(batch, "retried_by_ids"):
        raw = batch.retried_by_ids
        ids = json.loads(raw) if isinstance(raw, str) else (raw or [])
    else:
        ids = list(Batch.objects.filter(retry_of_id=batch.pk).order_by("id").values_list("id", flat=True))
    return [
        Batch(id=pk if isinstance(pk, uuid.UUID) else uuid.UUID(str(pk)), surface=batch.surface).public_id for pk in ids
    ]
