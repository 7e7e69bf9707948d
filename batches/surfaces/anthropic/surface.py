"""The Anthropic-compatible surface (Message Batches) as one object (batches/surfaces/registry.py): ids
`msgbatch_<hex>`, errors in Anthropic's envelope, requests stored as items at create, results read from the
items, a completion window after which the batch ends `expired`, and one webhook event when it ends."""

import logging
import uuid

from django.db.models import Q
from rest_framework.exceptions import APIException

from batches import ingest
from batches.errors import AnthropicError
from batches.lifecycle import states, stop
from batches.models import Batch, BatchStatus, Surface
from batches.surfaces.anthropic import create as anthropic_create
from batches.surfaces.anthropic import read
from batches.surfaces.registry import BatchSurface
from core.errors import RelayError, is_anthropic_path

log = logging.getLogger(__name__)

S = BatchStatus
# Where the operator's pages show a batch's results_url from: the surface's route, without a host.
_ROUTE = "/v1/messages/batches/"


class AnthropicSurface(BatchSurface):
    name = Surface.ANTHROPIC
    id_prefix = "msgbatch_"

    def parse_id(self, text: str) -> uuid.UUID | None:
        return read.parse_id(text)

    def error(self, status: int, code: str, message: str) -> RelayError:
        return AnthropicError(status, message, code=code)

    def envelope(self, exc: Exception) -> Exception:
        if isinstance(exc, RelayError):
            return AnthropicError.of(exc)
        if isinstance(exc, APIException):  # DRF's own, e.g. 405 for a method this route lacks
            return AnthropicError(exc.status_code, str(exc.detail))
        return exc

    def serialize(self, batch: Batch, base_url: str = _ROUTE) -> dict:
        return read.serialize(batch, base_url)

    # --- its API --------------------------------------------------------------------------------

    def find(self, public_id: str, principal) -> Batch:
        return read.batch_for_owner(public_id, principal)

    def answer_page(self, principal, params, base_url: str) -> dict:
        rows, has_more = read.batches_page(principal, params)
        return read.page(rows, has_more, base_url)

    def answer_created(self, batch: Batch, base_url: str) -> tuple[int, dict]:
        return 200, read.serialize(read.as_created(batch), base_url)

    def answer_detail(self, public_id: str, principal, base_url: str) -> dict:
        return read.serialize(read.batch_for_owner(public_id, principal, counts=True), base_url)

    def answer_cancel(self, public_id: str, principal, base_url: str) -> dict:
        return read.serialize(read.cancel(self.find(public_id, principal)), base_url)

    def answer_retried(self, retried, base_url: str) -> tuple[int, dict]:
        return self.answer_created(retried.batch, base_url)

    # --- the edge -------------------------------------------------------------------------------

    def edge_error(self, path: str, status: int, code: str, message: str, param: str | None) -> RelayError | None:
        if not is_anthropic_path(path) or "/messages/batches" not in path:
            return None
        # Anthropic's shape without the relay's code (the live Anthropic routes keep it beside the type).
        return AnthropicError(status, f"{param}: {message}" if param else message)

    # --- the lifecycle --------------------------------------------------------------------------

    unfinished = Q(status__in=states.OPEN[Surface.ANTHROPIC])
    expirable = Q(status=S.IN_PROGRESS, expired_at__isnull=True)

    def all_final(self, batch_id, status: str) -> None:
        stop.end_anthropic(batch_id, status)

    def cancel(self, batch: Batch) -> bool:
        return stop.cancelled_or_cancelling(batch, stop.cancel_anthropic(batch.pk))

    def expire(self, batch_id, now) -> bool:
        return stop.expire_anthropic(batch_id, now)

    # --- re-running what failed -----------------------------------------------------------------

    not_ended_status = 400  # as Anthropic answers results or delete of a batch still processing

    def ended(self, batch: Batch) -> bool:
        return batch.status in states.ANTHROPIC_ENDED

    def still(self, batch: Batch) -> str:
        return f"is still {read.processing_status(batch)}"

    def expired_by_batch(self, batch: Batch) -> bool:
        return read.stopped_by_expiry(batch)

    def retry_element(self, parent: Batch, custom_id: str, body: bytes) -> bytes:
        return ingest.dumps({"custom_id": custom_id})[:-1] + b',"params":' + body + b"}"

    def retry_top(self, parent: Batch, count: int) -> dict:
        return {"requests": count}

    def create(self, principal, submission, *, retry_of: Batch | None = None, idempotency_key: str = "") -> Batch:
        return anthropic_create.create(principal, submission, retry_of=retry_of)

    def removed_message(self, batch: Batch) -> str:
        return (
            f"{read.archived_message(batch)} Its errored and expired requests cannot be retried "
            "from it: submit them again as a new message batch."
        )

    # --- webhooks -------------------------------------------------------------------------------

    events = {S.COMPLETED: "message_batch.ended", S.EXPIRED: "message_batch.ended", S.CANCELLED: "message_batch.ended"}
    sample_events = ("message_batch.ended",)

    def event_data(self, batch_id: uuid.UUID) -> dict:
        return {"id": self.public_id(batch_id), "processing_status": "ended"}
