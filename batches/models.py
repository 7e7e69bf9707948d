"""Batches and their items. PostgreSQL is the truth; Redis only wakes workers.

Item state machine (explicit, enforced by a CHECK constraint):

    available ──claim──▶ running ──finish──▶ completed | discarded | cancelled
        │                   │
        └──cancel──▶ cancelled   └──lease expired (sweeper)──▶ available (attempt < max) | discarded

`finished_at` is set exactly when the state is final (a constraint, as jobq
does). A running item holds a lease (`lease_owner`, `lease_expires_at`)
renewed by its heartbeat; finishing writes are fenced on (state, lease owner,
attempt) so a zombie cannot overwrite an item the sweeper rescued.
"""

from django.db import models
from django.db.models import Q
from django.utils import timezone


class BatchStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"


class Shape(models.TextChoices):
    OPENAI = "openai"
    OPENAI_RESPONSES = "openai_responses"
    ANTHROPIC = "anthropic"


class ItemState(models.TextChoices):
    AVAILABLE = "available"
    RUNNING = "running"
    COMPLETED = "completed"
    DISCARDED = "discarded"
    CANCELLED = "cancelled"


FINAL_STATES = (ItemState.COMPLETED, ItemState.DISCARDED, ItemState.CANCELLED)
PENDING_STATES = (ItemState.AVAILABLE, ItemState.RUNNING)


class Batch(models.Model):
    id = models.UUIDField(primary_key=True)  # UUIDv7: time-ordered
    inbound_shape = models.CharField(max_length=32, choices=Shape.choices)
    status = models.CharField(max_length=16, choices=BatchStatus.choices, default=BatchStatus.QUEUED)
    total_items = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    completed_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)

    # Ownership and attribution, fixed at submit.
    owner_hash = models.CharField(max_length=100, db_index=True)  # relay key sha256, or "user:<id>" for tokens
    policy_id = models.BigIntegerField(null=True, blank=True)
    project_id = models.BigIntegerField(null=True, blank=True)
    team_id = models.BigIntegerField(null=True, blank=True)
    principal_kind = models.CharField(max_length=16)
    principal_id = models.BigIntegerField()
    credential_kind = models.CharField(max_length=16)
    credential_id = models.CharField(max_length=64)
    # The whole principal, so each item can re-check the credential when it runs.
    principal = models.JSONField()

    class Meta:
        verbose_name_plural = "batches"
        indexes = [
            models.Index(fields=["owner_hash", "-created_at"], name="batch_owner_created"),
            models.Index(fields=["status"], name="batch_active", condition=Q(status__in=["queued", "running"])),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(status__in=[s.value for s in BatchStatus]), name="batch_status_valid"),
            models.CheckConstraint(condition=Q(inbound_shape__in=[s.value for s in Shape]), name="batch_shape_valid"),
        ]

    def __str__(self):
        return str(self.id)


class Item(models.Model):
    id = models.UUIDField(primary_key=True)  # UUIDv7; also the usage event's request_id
    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="items")
    idx = models.PositiveIntegerField()
    state = models.CharField(max_length=16, choices=ItemState.choices, default=ItemState.AVAILABLE)
    attempt = models.PositiveSmallIntegerField(default=0)
    max_attempts = models.PositiveSmallIntegerField(default=3)
    lease_owner = models.CharField(max_length=100, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    input_ref = models.CharField(max_length=300)
    result_ref = models.CharField(max_length=300, blank=True, default="")
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)  # the upstream's, when it answered
    error = models.CharField(max_length=1000, blank=True, default="")
    error_body = models.TextField(blank=True, default="")  # the upstream's error body, at most 8 KiB

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["batch", "idx"], name="uniq_item_idx"),
            models.CheckConstraint(condition=Q(state__in=[s.value for s in ItemState]), name="item_state_valid"),
            models.CheckConstraint(
                condition=Q(state__in=[s.value for s in FINAL_STATES], finished_at__isnull=False)
                | (~Q(state__in=[s.value for s in FINAL_STATES]) & Q(finished_at__isnull=True)),
                name="item_finished_iff_final",
            ),
            models.CheckConstraint(
                condition=~Q(state="running") | (~Q(lease_owner="") & Q(lease_expires_at__isnull=False)),
                name="item_running_has_lease",
            ),
        ]
        indexes = [
            # Claim: the next available item of a batch, in order.
            models.Index(fields=["batch", "idx"], name="item_available", condition=Q(state="available")),
            # Fairness (running per batch) and the sweeper (expired leases).
            models.Index(fields=["batch"], name="item_running", condition=Q(state="running")),
            models.Index(fields=["lease_expires_at"], name="item_lease", condition=Q(state="running")),
            models.Index(fields=["batch", "state"], name="item_batch_state"),
        ]

    def __str__(self):
        return f"{self.batch_id}#{self.idx}"


class Payload(models.Model):
    """The `db` payload store: bodies every replica can read (see batches/storage.py)."""

    key = models.CharField(max_length=200, primary_key=True)
    data = models.BinaryField()

    def __str__(self):
        return self.key
