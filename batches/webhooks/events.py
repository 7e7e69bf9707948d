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

from batches.surfaces import registry

# Every type the relay emits, in the order GET /v1/webhook_event_types lists them. Which final status raises
# which type is each surface object's `events` (batches/surfaces/registry.py); tests/test_surface_registry.py
# checks that this list names every one of them.
EVENT_TYPES = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled", "message_batch.ended")


def event_type(surface: str, status: str) -> str | None:
    """The type a batch of `surface` raises when it ends in `status`; None: that end raises no event."""
    return registry.get(surface).events.get(status)


def waits_for_batch(surface: str, status: str) -> bool:
    """Whether the event is sent only once the batch is done (a native cancel: its running items stop later)."""
    return registry.get(surface).event_waits_for_batch(status)


def public_batch_id(surface: str, batch_id: uuid.UUID) -> str:
    """The id the batch's surface shows (as Batch.public_id): batch_<hex>, msgbatch_<hex> or the UUID."""
    return registry.get(surface).public_id(batch_id)


def data(surface: str, batch_id: uuid.UUID) -> dict:
    return registry.get(surface).event_data(batch_id)


def sample_data(event_type: str) -> dict:
    """The `data` of a test event (POST …/test): a made-up batch id of the surface whose own type it is."""
    surface = next(s for s in registry.all_surfaces() if event_type in s.sample_events)
    return surface.event_data(uuid.uuid4())


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
