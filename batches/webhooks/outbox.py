"""The outbox: a batch's end writes its event and one delivery per subscribed endpoint in the same
transaction as its final move (`record_batch_end`, run by batches.lifecycle.states.move), so an event
exists if and only if the batch ended. The webhook lane (lane.py, its own process) finds them in PostgreSQL;
once the move commits, `wake` tells it through Redis so it looks at once. A lost wake-up costs at most
RELAY_WEBHOOK_POLL_SECONDS, never an event: the rows are the queue.
"""

import logging

import redis
import uuid6
from django.db import transaction
from django.utils import timezone

from batches.models import Batch
from batches.webhooks import events
from batches.webhooks.models import Delivery, Event, WebhookEndpoint
from core.redis import get_redis

log = logging.getLogger(__name__)

# The lanes block on this Redis list between looks at the database; bounded, since one entry wakes a lane and
# it then takes everything due.
WAKE_KEY = "relay:webhooks:wake"
_WAKE_DEPTH = 16


def record_batch_end(batch_id, surface: str, status: str):
    """Before a batch's final move: None when no endpoint of its owner is subscribed to the event's type (the
    move stays one statement), else the writer the move runs inside its transaction: the event, with a
    delivery for each subscribed endpoint (paused ones too: they keep it for when they are resumed). An
    endpoint created between this look-up and the move (one statement later) gets the batches that end after."""
    event_type = events.event_type(surface, status)
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
        waits_for_batch=events.waits_for_batch(surface, status),
    )
    deliveries = Delivery.objects.bulk_create(
        [
            Delivery(
                id=uuid6.uuid7(), event=event, endpoint_id=pk, next_attempt_at=now, schedule_from=now, created_at=now
            )
            for pk in endpoints
        ]
    )
    transaction.on_commit(wake)
    log.info("batch %s %s: event %s for %d endpoint(s)", batch_id, status, event.public_id, len(deliveries))
    return len(deliveries)


def wake() -> None:
    """Tell a webhook lane that deliveries are due now. Best effort: the lane polls anyway."""
    try:
        pipe = get_redis().pipeline(transaction=False)
        pipe.lpush(WAKE_KEY, 1)
        pipe.ltrim(WAKE_KEY, 0, _WAKE_DEPTH - 1)
        pipe.execute()
    except redis.RedisError:
        log.warning("could not wake the webhook lane; it finds the deliveries at its next poll", exc_info=True)
