"""Re-run what failed: a new batch of the parent's surface holding only the parent's failed and
expired records, with the same bodies (read back from the payload store), the same custom_ids, the
same options and the same owner (docs/api/native.md, openai.md and anthropic.md, "Re-run what failed").

The new batch goes through its surface's own create service (the surface object's `create`,
batches/surfaces/registry.py), so it is validated, placed and dispatched like any batch a client
submits; this module only rebuilds the submission from the parent, in the form its surface object
says (`retry_element`, `retry_top`). What counts as failed is each surface's own vocabulary, as its
results show it:

    native     items `discarded` (and any stopped by an expiry: native batches have none today)
    OpenAI     the error file's records but the cancelled ones: `discarded`, and `expired`
               (stopped by batch_expired, or every stopped record of an expired batch)
    Anthropic  results `errored` and `expired` (not `canceled`)

Cancelled records are left out on purpose: cancelling was the caller's choice. Nothing is written
before the whole submission is rebuilt, and the child is made in one transaction that also holds
the parent's row, so a failure anywhere leaves nothing behind and a parent deleted meanwhile waits.
"""

import hashlib
import logging
import tempfile
from dataclasses import dataclass, field

from django.db import transaction
from django.db.models import Q

from batches import ingest, storage
from batches.models import PENDING_STATES, Batch, Item, ItemState
from batches.outcomes import Code
from batches.surfaces import registry
from batches.surfaces.registry import BatchSurface
from core.auth import Principal
from core.errors import RelayError

log = logging.getLogger(__name__)

# Failed records read (and their bodies fetched) per query.
PAGE = 1000
_SPOOL_MEMORY = 4 * 1024 * 1024


@dataclass
class Retried:
    """The new batch, and for each of its items (in order) the parent's item index it re-runs."""

    batch: Batch
    parent_idx: list[int] = field(default_factory=list)


def retry_failed(parent: Batch, principal: Principal) -> Retried:
    """A new batch of `parent`'s surface re-running its failed and expired records, created by
    `principal` (the caller, who owns `parent`; the admin passes the parent's own submitter).

    Errors, in the surface's envelope: the parent has not ended (409 native, 400 otherwise), has
    nothing failed (400 nothing_to_retry), or its stored bodies are gone (410 payloads_unavailable: also
    when retention has removed its records);
    a principal other than the parent's (another project's token of the same user) is a 400. Any of
    them, or the create service's own, leaves nothing written.
    """
    surface = registry.get(parent.surface)
    if (principal.principal_kind, principal.principal_id, principal.project_id) != (
        parent.principal_kind,
        parent.principal_id,
        parent.project_id,
    ):
        raise surface.error(
            400,
            "principal_mismatch",
            f"Batch {parent.public_id} was submitted for another project; retry it with a credential of that "
            "project, so its retry is billed and limited like it.",
        )
    with transaction.atomic():
        # Held until the child is committed: a parent deleted meanwhile (retention, DELETE) waits.
        locked = Batch.objects.select_for_update(no_key=True).filter(pk=parent.pk).first()
        if locked is None:
            raise surface.error(404, "", f"No batch found with id '{parent.public_id}'.")
        _check_ended(locked, surface)
        _check_kept(locked, surface)
        submission, parent_idx = _rebuild(locked, surface)
        with submission:
            child = surface.create(principal, submission, retry_of=locked)
    log.info("batch %s: retry of %s with %d records", child.public_id, locked.public_id, len(parent_idx))
    return Retried(child, parent_idx)


def _check_ended(parent: Batch, surface: BatchSurface) -> None:
    pending = Item.objects.filter(batch_id=parent.pk, state__in=PENDING_STATES).exists()
    if not surface.ended(parent) or pending:
        raise surface.error(
            surface.not_ended_status,
            "batch_not_finished",
            f"Batch {parent.public_id} {surface.still(parent)}: only a finished batch's failed and expired "
            "records can be retried; wait until it ends.",
        )


def _check_kept(parent: Batch, surface: BatchSurface) -> None:
    """Retention removes an ended OpenAI or Anthropic batch's items, bodies included (batches/retention.py):
    from the moment its counts are frozen (the row lock above orders this against that), nothing is left
    to re-run. Refused as when the bodies are missing, naming the reason."""
    if parent.frozen_counts is None:
        return
    log.info("batch %s: retry refused, its records were removed by retention", parent.public_id)
    raise surface.error(410, "payloads_unavailable", surface.removed_message(parent))


def _failed(parent: Batch, surface: BatchSurface) -> Q:
    condition = Q(state=ItemState.DISCARDED) | Q(state=ItemState.CANCELLED, error_code=Code.BATCH_EXPIRED)
    if surface.expired_by_batch(parent):
        condition |= Q(state=ItemState.CANCELLED)
    return condition


def _rebuild(parent: Batch, surface: BatchSurface) -> tuple[ingest.Submission, list[int]]:
    """The parent's failed records as a parsed submission body (ingest.Submission), their bodies read
    from the payload store a page at a time; and their indexes in the parent."""
    spool = tempfile.SpooledTemporaryFile(max_size=_SPOOL_MEMORY)  # noqa: SIM115 - the Submission closes it
    digest = hashlib.sha256()
    parent_idx: list[int] = []
    failed = Item.objects.filter(_failed(parent, surface), batch_id=parent.pk).order_by("idx")
    last = -1
    try:
        while page := list(failed.filter(idx__gt=last).values_list("idx", "custom_id", "input_ref")[:PAGE]):
            bodies = storage.read_many([ref for _, _, ref in page])
            for (idx, custom_id, _), body in zip(page, bodies, strict=True):
                if isinstance(body, storage.PayloadMissing):
                    raise _gone(parent, surface, idx, body)
                line = surface.retry_element(parent, custom_id, body) + b"\n"
                spool.write(line)
                digest.update(line)
                parent_idx.append(idx)
            last = page[-1][0]
    except BaseException:
        spool.close()
        raise
    if not parent_idx:
        spool.close()
        raise surface.error(400, "nothing_to_retry", surface.nothing_to_retry_message(parent))
    return ingest.Submission(
        surface.retry_top(parent, len(parent_idx)), len(parent_idx), spool, digest.hexdigest()
    ), parent_idx


def _gone(parent: Batch, surface: BatchSurface, idx: int, exc: storage.PayloadMissing) -> RelayError:
    log.warning("batch %s: retry refused, the body of item %d is missing: %s", parent.public_id, idx, exc)
    return surface.error(
        410,
        "payloads_unavailable",
        f"The stored request bodies of batch {parent.public_id} are no longer available (removed by retention, "
        "or the payload store is not reachable from this replica): its failed records cannot be retried. "
        "Submit them again as a new batch.",
    )
