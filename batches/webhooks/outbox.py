"""The outbox: a batch's end writes its event and one delivery per subscribed endpoint in the same
transaction as its final move (`record_batch_end`, run by batches.lifecycle.states.move), so an event
exists if and only if the batch ended. The control worker delivers them once that commits; a lost
message costs latency until the webhook sweep, never an event.
"""

import logging

import uuid6
from django.db import transaction
from django.utils import timezone

from batches import dispatch
from batches.models import Batch, BatchStatus, Surface
from batches.webhooks import events
from batches.webhooks.models import Delivery, Event, WebhookEndpoint

log = logging.getLogger(__name__)


def record_batch_end(batch_id, surface: str, status: str):
    """Before a batch's final move: None when no endpoint of its owner is subscribed to the event's type (the
    move stays one statement), else the writer the move runs inside its transaction: the event, with a
    delivery for each subscribed endpoint (paused ones too: they keep it for when they are resumed). An
    endpoint created between this look-up and the move (one statement later) gets the batches that end after."""
    event_type = events.EVENT_TYPE[surface].get(status)
    if event_type is None:
        return None
    owner = Batch.objects.filter(pk=batch_id).values("owner_hash")[:1]
    endpoints = [
        pk
        for pk, types in WebhookEndpoint.objects.filter(owner_hash=owner).values_list("id", "event_types")
        if event_type in types
    ]
    if not endpoints:
        return None
    return lambda: _write(batch_id, surface, status, event_type, endpoints)


def _write(batch_id, surface: str, status: str, event_type: str, endpoints: list) -> int:
    """Inside the final move's transaction: the event and its deliveries. Returns the deliveries written."""
    owner_hash = Batch.objects.filter(pk=batch_id).values_list("owner_hash", flat=True).first()
    now = timezone.now()
    event_id = uuid6.uuid7()
    event = Event.objects.create(
        id=event_id,
        type=event_type,
        owner_hash=owner_hash,
        created_at=now,
        batch_id=batch_id,
        body=events.body(event_id, event_type, now, events.data(surface, batch_id)),
        # A native cancel: its running items stop at their next heartbeat; sent once the batch is done.
        waits_for_batch=surface == Surface.NATIVE and status == BatchStatus.CANCELLED,
    )
    deliveries = Delivery.objects.bulk_create(
        [
            Delivery(
                id=uuid6.uuid7(), event=event, endpoint_id=pk, next_attempt_at=now, schedule_from=now, created_at=now
            )
            for pk in endpoints
        ]
    )
    ids = [d.id for d in deliveries]
    transaction.on_commit(lambda: send(ids))
    log.info("batch %s %s: event %s for %d endpoint(s)", batch_id, status, event.public_id, len(ids))
    return len(ids)


def send(delivery_ids, countdown: float | None = None) -> None:
    """Hand deliveries to the control worker (a lost message: the webhook sweep sends it again)."""
    for delivery_id in delivery_ids:
        dispatch.hand_off_webhook(delivery_id, countdown=countdown)
