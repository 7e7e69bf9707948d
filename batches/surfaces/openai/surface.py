"""The OpenAI-compatible surface as one object (batches/surfaces/registry.py): ids `batch_<hex>`, errors in
OpenAI's envelope, a batch validated in the background and finalized into output and error files, a 24 h
completion window, cancel through `cancelling`, and the webhook events OpenAI sends."""

import logging
import uuid

from django.conf import settings
from django.db.models import Q
from rest_framework.exceptions import APIException

from batches import dispatch, ingest
from batches.errors import OpenAIError, invalid
from batches.lifecycle import states, stop
from batches.models import Batch, BatchStatus, OutputExpiry, Surface
from batches.surfaces.openai import create as openai_create
from batches.surfaces.openai import files, read, serialize
from batches.surfaces.registry import BatchSurface
from core.errors import RelayError

log = logging.getLogger(__name__)

S = BatchStatus
# Its routes, under both prefixes: before a view has run, the edge answers on them in OpenAI's envelope (the
# native surface shares /v1/batches; OpenAI's envelope carries every field of the native one).
_ROUTES = ("/v1/batches", "/v1/files", "/openai/v1/batches", "/openai/v1/files")
_CREATE = ("/v1/batches", "/openai/v1/batches")
_UPLOAD = ("/v1/files", "/openai/v1/files")
# Multipart framing and the small form fields around an upload's file part.
_MULTIPART_OVERHEAD = 1024 * 1024


class OpenAISurface(BatchSurface):
    name = Surface.OPENAI
    id_prefix = "batch_"

    def parse_id(self, text: str) -> uuid.UUID | None:
        return read.parse_public_id(text, self.id_prefix)

    def error(self, status: int, code: str, message: str) -> RelayError:
        return OpenAIError(status, code, message)

    def envelope(self, exc: Exception) -> Exception:
        if isinstance(exc, RelayError):
            return OpenAIError.of(exc)
        if isinstance(exc, APIException):  # DRF's own, e.g. 405 for a method this route lacks
            return OpenAIError(exc.status_code, exc.default_code, str(exc.detail))
        return exc

    def serialize(self, batch: Batch) -> dict:
        return serialize.batch(batch)

    # --- its API --------------------------------------------------------------------------------

    def find(self, public_id: str, principal) -> Batch:
        return read.openai_batch_for_owner(public_id, principal)

    def answer_page(self, principal, params, base_url: str) -> dict:
        rows, has_more = read.openai_batches_page(principal, params.get("after"), params.get("limit"))
        return serialize.page(rows, serialize.batch, has_more)

    def answer_created(self, batch: Batch, base_url: str) -> tuple[int, dict]:
        return 200, serialize.batch(batch)

    def answer_detail(self, public_id: str, principal, base_url: str) -> dict:
        return serialize.batch(read.openai_batch_for_owner(public_id, principal, progress=True))

    def answer_cancel(self, public_id: str, principal, base_url: str) -> dict:
        batch = self.find(public_id, principal)
        if not stop.cancel(batch):
            raise invalid(f"Cannot cancel a batch with status '{batch.status}'.", code="batch_not_cancellable")
        return serialize.batch(batch)

    def answer_retried(self, retried, base_url: str) -> tuple[int, dict]:
        return self.answer_created(retried.batch, base_url)

    # --- the edge -------------------------------------------------------------------------------

    def edge_error(self, path: str, status: int, code: str, message: str, param: str | None) -> RelayError | None:
        return OpenAIError(status, code, message, param=param) if path.startswith(_ROUTES) else None

    def edge_body_limit(self, path: str) -> int | None:
        return settings.RELAY_MAX_UPLOAD_BYTES + _MULTIPART_OVERHEAD if path.rstrip("/") in _UPLOAD else None

    def edge_too_large(self, path: str, method: str, limit: int) -> RelayError | None:
        path = path.rstrip("/")
        if path in _CREATE and method == "POST":
            # A batch body over the limit is a 400 (the native contract's, decision 0003), refused before a
            # byte is read; the Anthropic surface answers its own 413 (its path is not this one).
            return OpenAIError(400, "request_too_large", f"request body exceeds {limit} bytes")
        if path in _UPLOAD:
            return files.too_large(settings.RELAY_MAX_UPLOAD_BYTES)  # the upload's own answer
        return None

    # --- the lifecycle --------------------------------------------------------------------------

    unfinished = Q(status__in=[S.IN_PROGRESS, S.FINALIZING, S.CANCELLING])
    expirable = Q(status__in=states.OPENAI_STOPPABLE)

    def all_final(self, batch_id, status: str) -> None:
        stop.openai_all_final(batch_id, status)

    def cancel(self, batch: Batch) -> bool:
        return stop.cancelled_or_cancelling(batch, stop.cancel_openai(batch.pk))

    def expire(self, batch_id, now) -> bool:
        return stop.expire_openai(batch_id, now)

    def redispatch_lost(self, stale) -> int:
        # Batches validating since before `stale`: their message was lost (or its worker died).
        lost = list(
            Batch.objects.filter(surface=self.name, status=S.VALIDATING, created_at__lt=stale).values_list(
                "id", flat=True
            )[:100]
        )
        for batch_id in lost:
            dispatch.redispatch("validate_openai_batch", batch_id)
        return len(lost)

    def finishes_itself(self, batch_id, status: str, since, stale) -> bool:
        if status not in (S.FINALIZING, S.CANCELLING):
            return False
        if since < stale:
            dispatch.redispatch("finalize_openai_batch", batch_id)  # finalize's message was lost
        return True

    # --- re-running what failed -----------------------------------------------------------------

    not_ended_status = 400  # as OpenAI answers a cancel of a batch that cannot be cancelled

    def ended(self, batch: Batch) -> bool:
        return batch.status in states.TERMINAL

    def still(self, batch: Batch) -> str:
        return f"has status '{batch.status}'"

    def expired_by_batch(self, batch: Batch) -> bool:
        return batch.expired_at is not None

    def retry_element(self, parent: Batch, custom_id: str, body: bytes) -> bytes:
        head = ingest.dumps({"custom_id": custom_id, "method": "POST", "url": parent.endpoint})
        return head[:-1] + b',"body":' + body + b"}"

    def retry_top(self, parent: Batch, count: int) -> dict:
        top = {"endpoint": parent.endpoint, "completion_window": parent.completion_window, "requests": count}
        if parent.metadata is not None:
            top["metadata"] = parent.metadata
        if parent.model:
            top["model"] = parent.model
        expiry = OutputExpiry.objects.filter(batch_id=parent.pk).values_list("seconds", flat=True).first()
        if expiry is not None:
            top["output_expires_after"] = {"anchor": "created_at", "seconds": expiry}
        return top

    def create(self, principal, submission, *, retry_of: Batch | None = None, idempotency_key: str = "") -> Batch:
        return openai_create.create(principal, submission, idempotency_key=idempotency_key, retry_of=retry_of)

    def removed_message(self, batch: Batch) -> str:
        return (
            f"The records of batch {batch.public_id} were removed by retention "
            "(RELAY_OPENAI_ITEM_RETENTION_SECONDS after it ended): its failed records cannot be retried. Its "
            "error file, while it has not expired, lists them; submit them again as a new batch."
        )

    def nothing_to_retry_message(self, batch: Batch) -> str:
        if batch.status == S.FAILED:
            return (
                f"Batch {batch.public_id} failed validation, so none of its records ran (see its `errors`): "
                "fix the input and create a new batch."
            )
        return super().nothing_to_retry_message(batch)

    # --- webhooks -------------------------------------------------------------------------------

    events = {
        S.COMPLETED: "batch.completed",
        S.FAILED: "batch.failed",
        S.EXPIRED: "batch.expired",
        S.CANCELLED: "batch.cancelled",
    }
    # OpenAI's own event types: a test event of one shows an OpenAI batch (the native surface raises two of them).
    sample_events = tuple(events.values())
