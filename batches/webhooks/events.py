"""The events a batch's end raises, per surface, and their bodies.

- OpenAI surface: `batch.completed` / `batch.failed` / `batch.expired` / `batch.cancelled`, in OpenAI's
  own shape, `data: {"id": "batch_…"}` (the receiver fetches the batch, as with OpenAI).
- Anthropic surface: `message_batch.ended`, `data: {"id": "msgbatch_…", "processing_status": "ended"}`.
- Native surface: `batch.completed` / `batch.cancelled`, `data: {"id": "<uuid>"}`; a cancel's event waits
  until the batch is done (its running items stopped: completed_at), so what the receiver fetches is final.

The body is encoded once, when the event is written: every delivery and every retry sends (and signs)
the same bytes.
"""

import json
import uuid

from batches.models import BatchStatus, Surface

S = BatchStatus

# What each surface's final statuses raise.
EVENT_TYPE = {
    Surface.OPENAI: {
        S.COMPLETED: "batch.completed",
        S.FAILED: "batch.failed",
        S.EXPIRED: "batch.expired",
        S.CANCELLED: "batch.cancelled",
    },
    Surface.ANTHROPIC: {
        S.COMPLETED: "message_batch.ended",
        S.EXPIRED: "message_batch.ended",
        S.CANCELLED: "message_batch.ended",
    },
    Surface.NATIVE: {S.COMPLETED: "batch.completed", S.CANCELLED: "batch.cancelled"},
}
# Every type the relay emits, in the order GET /v1/webhook_event_types lists them.
EVENT_TYPES = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled", "message_batch.ended")
assert {t for table in EVENT_TYPE.values() for t in table.values()} == set(EVENT_TYPES)


def public_batch_id(surface: str, batch_id: uuid.UUID) -> str:
    """The id the batch's surface shows (as Batch.public_id): batch_<hex>, msgbatch_<hex> or the UUID."""
    if surface == Surface.OPENAI:
        return f"batch_{batch_id.hex}"
    if surface == Surface.ANTHROPIC:
        return f"msgbatch_{batch_id.hex}"
    return str(batch_id)


def data(surface: str, batch_id: uuid.UUID) -> dict:
    if surface == Surface.ANTHROPIC:
        return {"id": public_batch_id(surface, batch_id), "processing_status": "ended"}
    return {"id": public_batch_id(surface, batch_id)}


def sample_data(event_type: str) -> dict:
    """The `data` of a test event (POST …/test): a made-up batch id of the type's surface."""
    fake = uuid.uuid4()
    if event_type == "message_batch.ended":
        return data(Surface.ANTHROPIC, fake)
    return data(Surface.OPENAI, fake)


def body(event_id: uuid.UUID, event_type: str, created_at, payload: dict) -> str:
    """The event as its deliveries send it: OpenAI's event object, compact JSON."""
    obj = {
        "id": f"evt_{event_id.hex}",
        "object": "event",
        "type": event_type,
        "created_at": int(created_at.timestamp()),
        "data": payload,
    }
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
