"""The webhook lane's housekeeping: probes of failing endpoints and the retention of settled deliveries (and
of a paused endpoint's deliveries past retention). Run by the lane (lane.py) every few seconds."""

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction

from batches.webhooks.delivery import FAILED, PENDING, PRUNE_LIMIT
from batches.webhooks.models import Delivery, DeliveryAttempt, Event, WebhookEndpoint

log = logging.getLogger(__name__)


def probe(now) -> int:
    """Failing endpoints not tried for RELAY_WEBHOOK_PROBE_SECONDS: their next pending delivery is due now."""
    every = timedelta(seconds=settings.RELAY_WEBHOOK_PROBE_SECONDS)
    stale = WebhookEndpoint.objects.filter(
        failing_since__isnull=False, paused_at__isnull=True, last_failure_at__lt=now - every
    ).values_list("id", flat=True)[:100]
    probed = []
    for endpoint_id in stale:
        first = (
            Delivery.objects.filter(endpoint_id=endpoint_id, outcome=PENDING)
            .order_by("next_attempt_at")
            .values_list("id", "next_attempt_at")
            .first()
        )
        if first is None or first[1] <= now + every:
            continue  # nothing waits, or one is due soon anyway
        if Delivery.objects.filter(pk=first[0], outcome=PENDING).update(next_attempt_at=now):
            probed.append(first[0])
    return len(probed)


def prune(now) -> int:
    """Delete up to PRUNE_LIMIT delivered and failed deliveries (with their attempts) whose last attempt is
    older than RELAY_WEBHOOK_RETENTION_SECONDS, and the events no delivery holds any more. Pending ones are
    never pruned. Returns the deliveries deleted; a backlog older than that shrinks a pass at a time."""
    keep = settings.RELAY_WEBHOOK_RETENTION_SECONDS
    if not keep:
        return 0
    cutoff = now - timedelta(seconds=keep)
    # A paused endpoint keeps its deliveries for when it is resumed, but not past retention: its owner's
    # backlog stays bounded. They fail (and are pruned a retention later, as any settled delivery).
    expired = Delivery.objects.filter(
        pk__in=Delivery.objects.filter(
            outcome=PENDING, endpoint__paused_at__isnull=False, schedule_from__lt=cutoff
        ).values("pk")[:PRUNE_LIMIT]
    ).update(outcome=FAILED, last_attempt_at=now, last_error="the endpoint stayed paused past retention")
    if expired:
        log.info("webhook retention: %d deliveries of paused endpoints failed, kept past retention", expired)
    old = list(
        Delivery.objects.exclude(outcome=PENDING)
        .filter(last_attempt_at__lt=cutoff)
        .order_by("last_attempt_at")
        .values_list("id", "event_id")[:PRUNE_LIMIT]
    )
    if not old:
        return 0
    ids, event_ids = [pk for pk, _ in old], {event_id for _, event_id in old}
    with transaction.atomic():
        DeliveryAttempt.objects.filter(delivery_id__in=ids).delete()
        deleted = Delivery.objects.filter(pk__in=ids).exclude(outcome=PENDING).delete()[1].get(Delivery._meta.label, 0)
        Event.objects.filter(pk__in=event_ids, deliveries__isnull=True).delete()
    log.info("webhook retention: %d settled deliveries older than %d s deleted", deleted, keep)
    return deleted
