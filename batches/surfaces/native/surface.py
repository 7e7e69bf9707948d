"""The Relay-native surface as one object (batches/surfaces/registry.py): ids are the batch's UUID, errors
in the relay's own envelope, batches submitted whole and shown with their items' states, no completion
window, cancel at once, and the seed's fail-at-once default unless a batch opts in to retries."""

import logging
import uuid
from collections.abc import Iterator

from django.db.models import Q

from batches.lifecycle import stop
from batches.models import Batch, BatchStatus, Surface
from batches.surfaces.native import read, submit
from batches.surfaces.registry import BatchSurface
from core.errors import RelayError

log = logging.getLogger(__name__)

S = BatchStatus
# A native batch's retry options when it did not opt in (submit._retry_options).
_DEFAULT_RETRY = (3, False, False)


class NativeSurface(BatchSurface):
    name = Surface.NATIVE
    access_gated = False  # native batches are not gated by the policy's batch access

    def parse_id(self, text: str) -> uuid.UUID | None:
        return read.parse_native_id(text)

    def error(self, status: int, code: str, message: str) -> RelayError:
        return RelayError(status, code, message)

    def serialize(self, batch: Batch) -> dict:
        return read.status_head(batch)  # the status object without its items

    # --- its API --------------------------------------------------------------------------------

    def find(self, public_id: str, principal) -> Batch:
        return read.batch_for_owner(public_id, principal)

    def answer_created(self, batch: Batch, base_url: str) -> tuple[int, dict]:
        return 202, {"id": str(batch.id), "status": "queued", "total_items": batch.total_items}

    def answer_detail(self, public_id: str, principal, base_url: str) -> Iterator[bytes]:
        return read.iter_status_json(self.find(public_id, principal))

    def answer_results(self, public_id: str, principal) -> Iterator[bytes]:
        return read.iter_results_json(self.find(public_id, principal))

    def answer_cancel(self, public_id: str, principal, base_url: str) -> dict:
        batch = self.find(public_id, principal)
        stop.cancel(batch)
        batch.refresh_from_db(fields=["status"])  # a finished batch keeps (and answers) its own status
        return {"status": batch.status}

    def answer_retried(self, retried, base_url: str) -> tuple[int, dict]:
        batch = retried.batch
        status, body = self.answer_created(batch, base_url)
        # Item i of the new batch re-runs item parent_idx[i] of the parent.
        return status, {**body, "retry_of": batch.retry_of_public_id, "parent_idx": retried.parent_idx}

    # --- the lifecycle --------------------------------------------------------------------------

    # Cancelled native batches too: one is done once its last running item stopped (completed_at).
    unfinished = Q(completed_at__isnull=True, status__in=[S.QUEUED, S.RUNNING, S.CANCELLED])

    def all_final(self, batch_id, status: str) -> None:
        stop.native_all_final(batch_id, status)

    def cancel(self, batch: Batch) -> bool:
        stop.cancel_native(batch.pk)
        return True

    # --- re-running what failed -----------------------------------------------------------------

    not_ended_status = 409

    def ended(self, batch: Batch) -> bool:
        # A cancelled native batch is done once its last running item stopped (completed_at is then set).
        return batch.status == S.COMPLETED or (batch.status == S.CANCELLED and batch.completed_at is not None)

    def still(self, batch: Batch) -> str:
        return "still running" if batch.status != S.CANCELLED else "still stopping"

    def retry_element(self, parent: Batch, custom_id: str, body: bytes) -> bytes:
        return body

    def retry_top(self, parent: Batch, count: int) -> dict:
        top = {"shape": parent.inbound_shape, "requests": count}
        if (parent.max_attempts, parent.retry_transient, parent.wait_for_capacity) != _DEFAULT_RETRY:
            # The options it was submitted with: retry_transient follows max_attempts > 1 (submit._retry_options).
            top["retry"] = {"max_attempts": parent.max_attempts, "wait_for_capacity": parent.wait_for_capacity}
        return top

    def create(self, principal, submission, *, retry_of: Batch | None = None, idempotency_key: str = "") -> Batch:
        return submit.store_native(principal, submission, retry_of=retry_of)

    # --- webhooks -------------------------------------------------------------------------------

    events = {S.COMPLETED: "batch.completed", S.CANCELLED: "batch.cancelled"}

    def event_waits_for_batch(self, status: str) -> bool:
        # A cancel: its running items stop at their next heartbeat; the event is sent once the batch is done.
        return status == S.CANCELLED
