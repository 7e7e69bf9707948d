"""Webhook endpoints, the events a batch's end raises, and their deliveries (the outbox).

    WebhookEndpoint ─┐
                     ├─▶ Delivery (one per event and subscribed endpoint; its id is the webhook-id)
    Event ───────────┘        └─▶ DeliveryAttempt (every POST: time, status, latency, answer's first KiB)

A delivery is `pending` until a POST answers 2xx (`delivered`) or its retries run out (`failed`):

    pending ──2xx──▶ delivered
       │  └──non-2xx, network error, refused address──▶ pending (next_attempt_at: backoff with jitter)
       └──no retry left (RELAY_WEBHOOK_MAX_AGE_SECONDS since schedule_from)──▶ failed
    delivered | failed ──resend──▶ pending (same webhook-id, a fresh schedule)

An endpoint that has failed every attempt for RELAY_WEBHOOK_PAUSE_AFTER_SECONDS, at least
RELAY_WEBHOOK_PAUSE_AFTER_FAILURES times in a row, is paused (`paused_at`, `paused_reason`): its pending
deliveries stay pending and are sent when its owner or an operator resumes it.

A delivery in flight carries a lease (`lease_owner`, `lease_expires_at`) taken by the webhook lane
(batches/webhooks/lane.py): the lane's caps count leases, and a lane killed mid-POST loses nothing — the
lease runs out and the delivery is picked again.

A batch is named by a plain id, not a foreign key: an event outlives the batch it reports (retention
deletes old native batches), as a batch outlives the files it names.
"""

from django.db import models
from django.db.models import Q
from django.utils import timezone


class DeliveryOutcome(models.TextChoices):
    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


class WebhookEndpoint(models.Model):
    id = models.UUIDField(primary_key=True)  # UUIDv7: time-ordered, so id order is creation order
    # Same ownership as batches: the relay key's sha256, or "user:<id>" for an inference token.
    owner_hash = models.CharField(max_length=100)
    project_id = models.BigIntegerField(null=True, blank=True)
    team_id = models.BigIntegerField(null=True, blank=True)
    name = models.CharField(max_length=200)
    url = models.CharField(max_length=2000)
    event_types = models.JSONField(default=list)
    # `whsec_…`, sealed with the master key (core.crypto); never shown again after create/rotate.
    secret_sealed = models.TextField()
    secret_hint = models.CharField(max_length=32)
    # The secret before the last rotation, signed with too while it overlaps (keep_old_secret_active_for_24_hours).
    previous_secret_sealed = models.TextField(blank=True, default="")
    previous_secret_expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    # Every delivery since this time has failed (null: the last one answered 2xx, or none was tried).
    failing_since = models.DateTimeField(null=True, blank=True)
    last_failure_at = models.DateTimeField(null=True, blank=True)
    # Failed attempts since the last 2xx: with failing_since, what pauses an endpoint automatically.
    consecutive_failures = models.PositiveIntegerField(default=0)
    paused_at = models.DateTimeField(null=True, blank=True)
    # Why it is paused, shown to its owner (the API) and the operator (the admin); empty when not paused.
    paused_reason = models.CharField(max_length=300, blank=True, default="")
    # Paused by an operator (the admin), not by the relay for failing: only an operator may resume it, so an
    # owner cannot undo what the operator decided about its endpoint.
    paused_by_operator = models.BooleanField(default=False)

    class Meta:
        indexes = [models.Index(fields=["owner_hash", "-id"], name="webhook_endpoint_owner")]
        constraints = [
            models.CheckConstraint(
                condition=Q(previous_secret_sealed="") | Q(previous_secret_expires_at__isnull=False),
                name="webhook_previous_secret_expires",
            ),
        ]

    def __str__(self):
        return f"{self.name} ({self.public_id})"

    @property
    def public_id(self) -> str:
        return f"we_{self.id.hex}"


class Event(models.Model):
    id = models.UUIDField(primary_key=True)  # UUIDv7; shown as evt_<hex>
    type = models.CharField(max_length=64)
    owner_hash = models.CharField(max_length=100)
    created_at = models.DateTimeField(default=timezone.now)
    batch_id = models.UUIDField(null=True, blank=True)  # null for a test event
    # The exact bytes every delivery of this event sends (and signs): the same body on every retry.
    body = models.TextField()
    # A native batch's cancel: sent once the batch is done (completed_at), i.e. its running items stopped.
    waits_for_batch = models.BooleanField(default=False)
    test = models.BooleanField(default=False)  # POST /v1/webhook_endpoints/{id}/test

    def __str__(self):
        return f"{self.type} {self.public_id}"

    @property
    def public_id(self) -> str:
        return f"evt_{self.id.hex}"


class Delivery(models.Model):
    id = models.UUIDField(primary_key=True)  # UUIDv7; shown as wh_<hex>, the `webhook-id` header
    event = models.ForeignKey(Event, on_delete=models.CASCADE, related_name="deliveries")
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries")
    outcome = models.CharField(max_length=16, choices=DeliveryOutcome.choices, default=DeliveryOutcome.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(default=timezone.now)
    # Retries end RELAY_WEBHOOK_MAX_AGE_SECONDS after this: the event's creation, or a resend / resume.
    schedule_from = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(default=timezone.now)
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=300, blank=True, default="")
    # The lane holding this delivery while its POST is in flight (both null/empty when none does).
    lease_owner = models.CharField(max_length=100, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "deliveries"
        constraints = [
            models.UniqueConstraint(fields=["event", "endpoint"], name="uniq_webhook_delivery"),
            models.CheckConstraint(
                condition=Q(outcome__in=[s.value for s in DeliveryOutcome]), name="webhook_delivery_outcome_valid"
            ),
            models.CheckConstraint(
                condition=Q(outcome="delivered", delivered_at__isnull=False)
                | (~Q(outcome="delivered") & Q(delivered_at__isnull=True)),
                name="webhook_delivered_iff_stamped",
            ),
        ]
        indexes = [
            # The sweep: pending deliveries by when they are due.
            models.Index(fields=["next_attempt_at"], name="webhook_delivery_due", condition=Q(outcome="pending")),
            # GET …/deliveries: an endpoint's deliveries, newest first.
            models.Index(fields=["endpoint", "-id"], name="webhook_delivery_endpoint"),
            # The lane's pick: each endpoint's due deliveries, oldest due first.
            models.Index(
                fields=["endpoint", "next_attempt_at"],
                name="webhook_delivery_endpoint_due",
                condition=Q(outcome="pending"),
            ),
            # The lane's caps: deliveries in flight (a lease is cleared when the attempt is recorded: few rows).
            models.Index(
                fields=["endpoint"], name="webhook_delivery_leased", condition=Q(lease_expires_at__isnull=False)
            ),
            # Retention: settled deliveries by their last attempt.
            models.Index(fields=["last_attempt_at"], name="webhook_delivery_settled", condition=~Q(outcome="pending")),
        ]

    def __str__(self):
        return self.webhook_id

    @property
    def webhook_id(self) -> str:
        return f"wh_{self.id.hex}"


class DeliveryAttempt(models.Model):
    delivery = models.ForeignKey(Delivery, on_delete=models.CASCADE, related_name="attempt_log")
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    duration_ms = models.PositiveIntegerField()
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)  # null: no answer (network, refused)
    error = models.CharField(max_length=300, blank=True, default="")
    response_head = models.TextField(blank=True, default="")  # the answer's first KiB
    delivered = models.BooleanField(default=False)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["delivery", "number"], name="uniq_webhook_attempt")]

    def __str__(self):
        return f"{self.delivery_id} #{self.number}"
