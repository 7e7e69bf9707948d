"""Re-run what failed: a new batch of the parent's surface holding only the parent's failed and
expired records, with the same bodies (read back from the payload store), the same custom_ids, the
same options and the same owner (docs/api/native.md, openai.md and anthropic.md, "Re-run what failed").

The new batch goes through its surface's own create service (native `store_native`, OpenAI
`create`, Anthropic `create`), so it is validated, placed and dispatched like any batch a client
submits; this module only rebuilds the submission from the parent. What counts as failed is each
surface's own vocabulary, as its results show it:

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
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import transaction
from django.db.models import Q

from batches import ingest, storage
from batches.errors import OpenAIError
from batches.lifecycle import states
from batches.models import PENDING_STATES, Batch, BatchStatus, Item, ItemState, OutputExpiry, Surface
from batches.outcomes import Code
from batches.surfaces.anthropic import create as anthropic_create
from batches.surfaces.anthropic import read as anthropic_read
from batches.surfaces.native import submit
from batches.surfaces.openai import create as openai_create
from relay.auth import Principal
from relay.errors import AnthropicError, RelayError

log = logging.getLogger(__name__)

# Failed records read (and their bodies fetched) per query.
PAGE = 1000
_SPOOL_MEMORY = 4 * 1024 * 1024
# A native batch's retry options when it did not opt in (batches/surfaces/native/submit.py).
_NATIVE_DEFAULT_RETRY = (3, False, False)


@dataclass
class Retried:
    """The new batch, and for each of its items (in order) the parent's item index it re-runs."""

    batch: Batch
    parent_idx: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Surface:
    error: Callable[[int, str, str], RelayError]  # (status, code, message) → the surface's own envelope
    not_ended_status: int  # what the surface answers for a request its batch's state refuses
    ended: Callable[[Batch], bool]
    still: Callable[[Batch], str]  # how the surface names a batch that has not ended, for the message
    expired_by_batch: Callable[[Batch], bool]  # every stopped record of this batch was stopped by its expiry
    element: Callable[[Batch, str, bytes], bytes]  # (parent, custom_id, stored body) → one `requests` element
    top: Callable[[Batch, int], dict]  # the body's other keys
    create: Callable[..., Batch]  # the surface's create service: (principal, submission, retry_of=parent)
    # Why a batch whose records retention removed cannot be retried, and where its failures are still told.
    removed: Callable[[Batch], str] = lambda batch: f"The records of batch {batch.public_id} were removed by retention."


def _native_ended(batch: Batch) -> bool:
    # A cancelled native batch is done once its last running item stopped (completed_at is then set).
    return batch.status == BatchStatus.COMPLETED or (
        batch.status == BatchStatus.CANCELLED and batch.completed_at is not None
    )


def _native_top(parent: Batch, count: int) -> dict:
    top = {"shape": parent.inbound_shape, "requests": count}
    if (parent.max_attempts, parent.retry_transient, parent.wait_for_capacity) != _NATIVE_DEFAULT_RETRY:
        # The options it was submitted with: retry_transient follows max_attempts > 1 (submit._retry_options).
        top["retry"] = {"max_attempts": parent.max_attempts, "wait_for_capacity": parent.wait_for_capacity}
    return top


def _openai_element(parent: Batch, custom_id: str, body: bytes) -> bytes:
    head = ingest.dumps({"custom_id": custom_id, "method": "POST", "url": parent.endpoint})
    return head[:-1] + b',"body":' + body + b"}"


def _openai_top(parent: Batch, count: int) -> dict:
    top = {"endpoint": parent.endpoint, "completion_window": parent.completion_window, "requests": count}
    if parent.metadata is not None:
        top["metadata"] = parent.metadata
    if parent.model:
        top["model"] = parent.model
    expiry = OutputExpiry.objects.filter(batch_id=parent.pk).values_list("seconds", flat=True).first()
    if expiry is not None:
        top["output_expires_after"] = {"anchor": "created_at", "seconds": expiry}
    return top


def _anthropic_element(parent: Batch, custom_id: str, body: bytes) -> bytes:
    return ingest.dumps({"custom_id": custom_id})[:-1] + b',"params":' + body + b"}"


SURFACES = {
    Surface.NATIVE: _Surface(
        error=lambda status, code, message: RelayError(status, code, message),
        not_ended_status=409,
        ended=_native_ended,
        still=lambda batch: "still running" if batch.status != BatchStatus.CANCELLED else "still stopping",
        expired_by_batch=lambda batch: False,
        element=lambda parent, custom_id, body: body,
        top=_native_top,
        create=submit.store_native,
    ),
    Surface.OPENAI: _Surface(
        error=lambda status, code, message: OpenAIError(status, code, message),
        not_ended_status=400,  # as OpenAI answers a cancel of a batch that cannot be cancelled
        ended=lambda batch: batch.status in states.TERMINAL,
        still=lambda batch: f"has status '{batch.status}'",
        expired_by_batch=lambda batch: batch.expired_at is not None,
        element=_openai_element,
        top=_openai_top,
        create=openai_create.create,
        removed=lambda batch: (
            f"The records of batch {batch.public_id} were removed by retention "
            "(RELAY_OPENAI_ITEM_RETENTION_SECONDS after it ended): its failed records cannot be retried. Its "
            "error file, while it has not expired, lists them; submit them again as a new batch."
        ),
    ),
    Surface.ANTHROPIC: _Surface(
        error=lambda status, code, message: AnthropicError(status, message, code=code),
        not_ended_status=400,  # as Anthropic answers results or delete of a batch still processing
        ended=lambda batch: batch.status in states.ANTHROPIC_ENDED,
        still=lambda batch: f"is still {anthropic_read.processing_status(batch)}",
        expired_by_batch=anthropic_read.stopped_by_expiry,
        element=_anthropic_element,
        top=lambda parent, count: {"requests": count},
        create=anthropic_create.create,
        removed=lambda batch: (
            f"{anthropic_read.archived_message(batch)} Its errored and expired requests cannot be retried "
            "from it: submit them again as a new message batch."
        ),
    ),
}
assert set(SURFACES) == set(Surface.values)


def retry_failed(parent: Batch, principal: Principal) -> Retried:
    """A new batch of `parent`'s surface re-running its failed and expired records, created by
    `principal` (the caller, who owns `parent`; the admin passes the parent's own submitter).

    Errors, in the surface's envelope: the parent has not ended (409 native, 400 otherwise), has
    nothing failed (400 nothing_to_retry), or its stored bodies are gone (410 payloads_unavailable: also
    when retention has removed its records);
    a principal other than the parent's (another project's token of the same user) is a 400. Any of
    them, or the create service's own, leaves nothing written.
    """
    rules = SURFACES[parent.surface]
    if (principal.principal_kind, principal.principal_id, principal.project_id) != (
        parent.principal_kind,
        parent.principal_id,
        parent.project_id,
    ):
        raise rules.error(
            400,
            "principal_mismatch",
            f"Batch {parent.public_id} was submitted for another project; retry it with a credential of that "
            "project, so its retry is billed and limited like it.",
        )
    with transaction.atomic():
        # Held until the child is committed: a parent deleted meanwhile (retention, DELETE) waits.
        locked = Batch.objects.select_for_update(no_key=True).filter(pk=parent.pk).first()
        if locked is None:
            raise rules.error(404, "", f"No batch found with id '{parent.public_id}'.")
        _check_ended(locked, rules)
        _check_kept(locked, rules)
        submission, parent_idx = _rebuild(locked, rules)
        with submission:
            child = rules.create(principal, submission, retry_of=locked)
    log.info("batch %s: retry of %s with %d records", child.public_id, locked.public_id, len(parent_idx))
    return Retried(child, parent_idx)


def _check_ended(parent: Batch, rules: _Surface) -> None:
    pending = Item.objects.filter(batch_id=parent.pk, state__in=PENDING_STATES).exists()
    if not rules.ended(parent) or pending:
        raise rules.error(
            rules.not_ended_status,
            "batch_not_finished",
            f"Batch {parent.public_id} {rules.still(parent)}: only a finished batch's failed and expired "
            "records can be retried; wait until it ends.",
        )


def _check_kept(parent: Batch, rules: _Surface) -> None:
    """Retention removes an ended OpenAI or Anthropic batch's items, bodies included (batches/retention.py):
    from the moment its counts are frozen (the row lock above orders this against that), nothing is left
    to re-run. Refused as when the bodies are missing, naming the reason."""
    if parent.frozen_counts is None:
        return
    log.info("batch %s: retry refused, its records were removed by retention", parent.public_id)
    raise rules.error(410, "payloads_unavailable", rules.removed(parent))


def _failed(parent: Batch, rules: _Surface) -> Q:
    condition = Q(state=ItemState.DISCARDED) | Q(state=ItemState.CANCELLED, error_code=Code.BATCH_EXPIRED)
    if rules.expired_by_batch(parent):
        condition |= Q(state=ItemState.CANCELLED)
    return condition


def _rebuild(parent: Batch, rules: _Surface) -> tuple[ingest.Submission, list[int]]:
    """The parent's failed records as a parsed submission body (ingest.Submission), their bodies read
    from the payload store a page at a time; and their indexes in the parent."""
    spool = tempfile.SpooledTemporaryFile(max_size=_SPOOL_MEMORY)  # noqa: SIM115 - the Submission closes it
    digest = hashlib.sha256()
    parent_idx: list[int] = []
    failed = Item.objects.filter(_failed(parent, rules), batch_id=parent.pk).order_by("idx")
    last = -1
    try:
        while page := list(failed.filter(idx__gt=last).values_list("idx", "custom_id", "input_ref")[:PAGE]):
            bodies = storage.read_many([ref for _, _, ref in page])
            for (idx, custom_id, _), body in zip(page, bodies, strict=True):
                if isinstance(body, storage.PayloadMissing):
                    raise _gone(parent, rules, idx, body)
                line = rules.element(parent, custom_id, body) + b"\n"
                spool.write(line)
                digest.update(line)
                parent_idx.append(idx)
            last = page[-1][0]
    except BaseException:
        spool.close()
        raise
    if not parent_idx:
        spool.close()
        raise rules.error(400, "nothing_to_retry", _nothing_message(parent))
    return ingest.Submission(rules.top(parent, len(parent_idx)), len(parent_idx), spool, digest.hexdigest()), parent_idx


def _nothing_message(parent: Batch) -> str:
    if parent.surface == Surface.OPENAI and parent.status == BatchStatus.FAILED:
        return (
            f"Batch {parent.public_id} failed validation, so none of its records ran (see its `errors`): "
            "fix the input and create a new batch."
        )
    return f"Batch {parent.public_id} has no failed or expired records: nothing to retry."


def _gone(parent: Batch, rules: _Surface, idx: int, exc: storage.PayloadMissing) -> RelayError:
    log.warning("batch %s: retry refused, the body of item %d is missing: %s", parent.public_id, idx, exc)
    return rules.error(
        410,
        "payloads_unavailable",
        f"The stored request bodies of batch {parent.public_id} are no longer available (removed by retention, "
        "or the payload store is not reachable from this replica): its failed records cannot be retried. "
        "Submit them again as a new batch.",
    )
