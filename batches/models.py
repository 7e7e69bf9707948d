"""Batches and their items. PostgreSQL is the truth; Redis only wakes workers.

Item state machine (explicit, enforced by a CHECK constraint):

    available ──claim──▶ running ──finish──▶ completed | discarded | cancelled
        │                   │
        └──cancel──▶ cancelled   └──lease expired (sweeper)──▶ available (attempt < max) | discarded

`finished_at` is set exactly when the state is final (a constraint, as jobq
does). A running item holds a lease (`lease_owner`, `lease_expires_at`)
renewed by its heartbeat; finishing writes are fenced on (state, lease owner,
attempt) so a zombie cannot overwrite an item the sweeper rescued.

Two surfaces share these rows (decision 0002): the Relay-native one (decision 0003)
and the OpenAI-compatible one (decision 0005). They differ only in how a batch is
created and shown, so `Batch.surface` picks the status vocabulary and the
OpenAI-only columns; execution (claim, run, finish, cancel, sweep) is one path.

OpenAI batch lifecycle (explicit, enforced by CHECK constraints; each status
has its timestamp):

    validating ──▶ in_progress ──▶ finalizing ──▶ completed
        │              │               ▲    └──▶ expired   (window closed: expired_at is set)
        │              └─window closed─┘
        ├──▶ failed                          (the input did not validate: `errors`)
        └──────────────┴──▶ cancelling ──▶ cancelled   (partial results are still written)

Finalizing (and cancelling) ends by writing the output and error files.

Anthropic batch (Message Batches; batches/surfaces/anthropic/), no validation or
finalizing step: the records are stored as items at create, results are read from them:

    in_progress ──last item final──▶ completed | expired (expired_at set: the window closed)
        └──cancel──▶ cancelling ──last item final──▶ cancelled

`processing_status` shows in_progress / canceling / ended (completed, expired, cancelled);
`completed_at` is its `ended_at`, stamped on every ending status.
"""

from django.db import models
from django.db.models import Q
from django.utils import timezone

from batches import domains


class Surface(models.TextChoices):
    NATIVE = "native"  # decision 0003: {"shape", "requests"}; id shown as the UUID
    OPENAI = "openai"  # decision 0005: files + batch objects; id shown as batch_<uuid hex>
    ANTHROPIC = "anthropic"  # Anthropic Message Batches; id shown as msgbatch_<uuid hex>


class BatchStatus(models.TextChoices):
    # Relay-native (decision 0003) statuses.
    QUEUED = "queued"
    RUNNING = "running"
    # Shared by both surfaces.
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    # OpenAI-compatible (decision 0005) statuses.
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"


NATIVE_STATUSES = (BatchStatus.QUEUED, BatchStatus.RUNNING, BatchStatus.COMPLETED, BatchStatus.CANCELLED)
OPENAI_STATUSES = (
    BatchStatus.VALIDATING,
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
    BatchStatus.COMPLETED,
    BatchStatus.FAILED,
    BatchStatus.EXPIRED,
    BatchStatus.CANCELLING,
    BatchStatus.CANCELLED,
)
ANTHROPIC_STATUSES = (
    BatchStatus.IN_PROGRESS,
    BatchStatus.CANCELLING,
    BatchStatus.COMPLETED,
    BatchStatus.EXPIRED,
    BatchStatus.CANCELLED,
)
# Each Anthropic status and the timestamp that must be set while a batch is in it
# (completed_at is the batch's `ended_at`; expired_at is stamped when the window closes).
ANTHROPIC_STATUS_STAMP = {
    BatchStatus.CANCELLING: "cancelling_at",
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.EXPIRED: "completed_at",
    BatchStatus.CANCELLED: "completed_at",
}
# Batches whose available items a worker may claim. A validating OpenAI batch
# has no items yet; a cancelling or finalizing one starts no new work.
CLAIMABLE_STATUSES = (BatchStatus.QUEUED, BatchStatus.RUNNING, BatchStatus.IN_PROGRESS)
# OpenAI statuses after which nothing changes (its output and error files are written): the ones
# whose items retention may remove (batches/retention.py).
PRUNABLE_STATUSES = (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)
# The same for the Anthropic surface: its `ended` statuses (lifecycle.states.ANTHROPIC_ENDED, which
# imports this module), whose results retention archives.
ANTHROPIC_PRUNABLE_STATUSES = (BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)
# Each OpenAI status and the timestamp that must be set while a batch is in it.
OPENAI_STATUS_STAMP = {
    BatchStatus.IN_PROGRESS: "in_progress_at",
    BatchStatus.FINALIZING: "finalizing_at",
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.FAILED: "failed_at",
    BatchStatus.EXPIRED: "expired_at",
    BatchStatus.CANCELLING: "cancelling_at",
    BatchStatus.CANCELLED: "cancelled_at",
}


class Endpoint(models.TextChoices):
    """The API families an OpenAI-surface batch may call (decision 0005)."""

    CHAT_COMPLETIONS = "/v1/chat/completions", "/v1/chat/completions"
    COMPLETIONS = "/v1/completions", "/v1/completions"
    EMBEDDINGS = "/v1/embeddings", "/v1/embeddings"
    RESPONSES = "/v1/responses", "/v1/responses"


class Shape(models.TextChoices):
    OPENAI = "openai"
    OPENAI_RESPONSES = "openai_responses"
    ANTHROPIC = "anthropic"


class ItemState(models.TextChoices):
    AVAILABLE = "available"
    RUNNING = "running"
    # At the provider: sent (or about to be) in a provider batch job (batches/provider/); no worker claims it.
    DELEGATED = "delegated"
    COMPLETED = "completed"
    DISCARDED = "discarded"
    CANCELLED = "cancelled"


FINAL_STATES = (ItemState.COMPLETED, ItemState.DISCARDED, ItemState.CANCELLED)
PENDING_STATES = (ItemState.AVAILABLE, ItemState.RUNNING, ItemState.DELEGATED)


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

    surface = models.CharField(max_length=16, choices=Surface.choices, default=Surface.NATIVE)

    # --- OpenAI surface (decision 0005); blank/null on native batches ---
    endpoint = models.CharField(max_length=32, blank=True, default="", choices=Endpoint.choices)
    completion_window = models.CharField(max_length=8, blank=True, default="")
    model = models.CharField(max_length=200, blank=True, default="")  # the hint, then the records' model
    metadata = models.JSONField(null=True, blank=True)
    errors = models.JSONField(null=True, blank=True)  # OpenAI `errors.data` when validation failed
    # Plain ids, not foreign keys: a file may be deleted while the batch keeps
    # naming it, as on OpenAI (the batch object always shows input_file_id).
    input_file_id = models.UUIDField(null=True, blank=True)
    output_file_id = models.UUIDField(null=True, blank=True)
    error_file_id = models.UUIDField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    # Fixed at submit, so a settings change never reprices a running batch.
    discount_percent = models.PositiveSmallIntegerField(default=0)
    # Idempotent create: the caller's Idempotency-Key and the sha256 of the body it came with.
    idempotency_key = models.CharField(max_length=255, blank=True, default="")
    request_sha256 = models.CharField(max_length=64, blank=True, default="")

    # --- Waiting and retrying (batches/retrying.py), fixed at submit ---
    # Attempts an item may use: transient failures and worker losses count, waits for capacity don't.
    max_attempts = models.PositiveSmallIntegerField(default=3)
    # Retry transient failures (5xx, 408, 409, network) with backoff. Native default: off (decision 0003).
    retry_transient = models.BooleanField(default=False)
    # Wait for capacity (rate limits, open breakers, upstream 429) instead of failing. Native default: off.
    wait_for_capacity = models.BooleanField(default=False)
    # Claims skip the whole batch until then: its policy or keys have no capacity before it.
    not_before = models.DateTimeField(null=True, blank=True)

    # Re-run what failed (batches/surfaces/retry.py): the batch whose failed and expired records this one
    # re-runs, of the same surface. SET_NULL: deleting a parent (retention, Anthropic's DELETE) keeps its
    # retries, which are batches of their own.
    retry_of = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="retried_by", db_index=True
    )

    # How many of its items ended in each state ({state: n}), written once, when its last item became final
    # (lifecycle/stop.complete_if_done): an ended batch's items never change again (a retry is a new batch), so
    # the admin's lists and the console read an ended batch's counts from its row, and only the few batches still
    # running from the items. Null while items are pending, and on batches that ended before the column existed.
    ended_counts = models.JSONField(null=True, blank=True)

    # --- Item retention (batches/retention.py, `prune_items`) ---
    # An ended OpenAI batch keeps its object but loses its items (rows and stored bodies) once past
    # RELAY_OPENAI_ITEM_RETENTION_SECONDS: its output and error files hold the results. An ended Anthropic
    # batch likewise once past RELAY_ANTHROPIC_RESULTS_RETENTION_SECONDS after its creation: Anthropic
    # archives results after 29 days (its results download is refused from then on). `frozen_counts` is
    # what its request counts were made of ({"completed", "discarded", "cancelled": items in that final
    # state, "cancelled_expired": the cancelled ones stopped by batch_expired, "provider_done",
    # "provider_failed": provider_progress}), written with `frozen_at` in the transaction that begins the
    # removal; from then on every reader takes the counts from it, not the items, so a removal spread over
    # several transactions never shows a half-counted batch (and the Anthropic surface shows `frozen_at`
    # as `archived_at`). `items_pruned_at` is set by the transaction that removes the last item (the
    # bodies go once it commits).
    frozen_counts = models.JSONField(null=True, blank=True)
    frozen_at = models.DateTimeField(null=True, blank=True)
    items_pruned_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "batches"
        indexes = [
            models.Index(fields=["owner_hash", "-created_at"], name="batch_owner_created"),
            models.Index(fields=["status"], name="batch_active", condition=Q(status__in=CLAIMABLE_STATUSES)),
            # GET /v1/batches: the owner's OpenAI batches, newest first (UUIDv7 ids are time-ordered).
            models.Index(fields=["owner_hash", "-id"], name="batch_openai_owner", condition=Q(surface="openai")),
            # GET /v1/messages/batches: the owner's Anthropic batches, newest first.
            models.Index(fields=["owner_hash", "-id"], name="batch_anthropic_owner", condition=Q(surface="anthropic")),
            # Item retention's look-ups: OpenAI and Anthropic batches whose items are still kept, per surface
            # by age (the ended ones past retention are pruned, an open one that old is reported), and the
            # few whose removal has begun but not ended (frozen, items left).
            models.Index(
                fields=["surface", "created_at"],
                include=["status"],
                name="batch_items_kept",
                condition=Q(surface__in=["openai", "anthropic"], frozen_counts__isnull=True),
            ),
            models.Index(
                fields=["id"],
                name="batch_items_pruning",
                condition=Q(frozen_counts__isnull=False, items_pruned_at__isnull=True),
            ),
            # The sweeper's look-ups: open OpenAI batches (expiry, lost messages).
            models.Index(
                fields=["status", "expires_at"],
                name="batch_openai_open",
                condition=Q(surface="openai") & ~Q(status__in=["completed", "failed", "expired", "cancelled"]),
            ),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(status__in=[s.value for s in BatchStatus]), name="batch_status_valid"),
            models.CheckConstraint(condition=Q(inbound_shape__in=[s.value for s in Shape]), name="batch_shape_valid"),
            models.CheckConstraint(condition=Q(surface__in=[s.value for s in Surface]), name="batch_surface_valid"),
            # Each surface speaks its own status vocabulary.
            models.CheckConstraint(
                condition=Q(surface=Surface.NATIVE, status__in=[s.value for s in NATIVE_STATUSES])
                | Q(surface=Surface.OPENAI, status__in=[s.value for s in OPENAI_STATUSES])
                | Q(surface=Surface.ANTHROPIC, status__in=[s.value for s in ANTHROPIC_STATUSES]),
                name="batch_status_of_surface",
            ),
            # An OpenAI batch always has its endpoint, window, input file and expiry.
            models.CheckConstraint(
                condition=~Q(surface=Surface.OPENAI)
                | (
                    Q(endpoint__in=[e.value for e in Endpoint], completion_window="24h")
                    & Q(input_file_id__isnull=False, expires_at__isnull=False)
                ),
                name="batch_openai_complete",
            ),
            # An OpenAI status is stamped: in `expired` expired_at is set, and so on.
            *[
                models.CheckConstraint(
                    condition=~Q(surface=Surface.OPENAI, status=status) | Q(**{f"{stamp}__isnull": False}),
                    name=f"batch_openai_{status.value}_stamped",
                )
                for status, stamp in OPENAI_STATUS_STAMP.items()
            ],
            # An Anthropic status is stamped too (ended ones with completed_at, their ended_at), and an
            # Anthropic batch always has its expiry.
            *[
                models.CheckConstraint(
                    condition=~Q(surface=Surface.ANTHROPIC, status=status) | Q(**{f"{stamp}__isnull": False}),
                    name=f"batch_anthropic_{status.value}_stamped",
                )
                for status, stamp in ANTHROPIC_STATUS_STAMP.items()
            ],
            models.CheckConstraint(
                condition=~Q(surface=Surface.ANTHROPIC) | Q(expires_at__isnull=False, inbound_shape=Shape.ANTHROPIC),
                name="batch_anthropic_complete",
            ),
            models.CheckConstraint(
                condition=~Q(surface=Surface.ANTHROPIC, status=BatchStatus.EXPIRED) | Q(expired_at__isnull=False),
                name="batch_anthropic_expired_has_expired_at",
            ),
            models.CheckConstraint(condition=Q(discount_percent__lte=100), name="batch_discount_percent_range"),
            models.CheckConstraint(condition=Q(max_attempts__gte=1), name="batch_max_attempts_positive"),
            models.CheckConstraint(condition=~Q(retry_of=models.F("id")), name="batch_not_its_own_retry"),
            # Item retention: counts are frozen only on an ended OpenAI or Anthropic batch (with the time they
            # were), and before its items are gone.
            models.CheckConstraint(
                condition=Q(frozen_counts__isnull=True)
                | Q(surface=Surface.OPENAI, status__in=[s.value for s in PRUNABLE_STATUSES])
                | Q(surface=Surface.ANTHROPIC, status__in=[s.value for s in ANTHROPIC_PRUNABLE_STATUSES]),
                name="batch_frozen_only_ended",
            ),
            models.CheckConstraint(
                condition=Q(frozen_counts__isnull=True, frozen_at__isnull=True)
                | Q(frozen_counts__isnull=False, frozen_at__isnull=False),
                name="batch_frozen_at_with_counts",
            ),
            models.CheckConstraint(
                condition=Q(items_pruned_at__isnull=True) | Q(frozen_counts__isnull=False),
                name="batch_pruned_has_frozen_counts",
            ),
            # Idempotent create: one batch per (owner, key).
            models.UniqueConstraint(
                fields=["owner_hash", "idempotency_key"],
                condition=~Q(idempotency_key=""),
                name="uniq_batch_idempotency_key",
            ),
        ]

    def __str__(self):
        return self.public_id

    @property
    def public_id(self) -> str:
        """The id the batch's surface shows: the UUID (native), batch_<uuid hex> (OpenAI) or
        msgbatch_<uuid hex> (Anthropic)."""
        if self.surface == Surface.OPENAI:
            return f"batch_{self.id.hex}"
        if self.surface == Surface.ANTHROPIC:
            return f"msgbatch_{self.id.hex}"
        return str(self.id)

    @property
    def retry_of_public_id(self) -> str | None:
        """The parent's id in its surface's form (a retry is always of its parent's surface)."""
        return Batch(id=self.retry_of_id, surface=self.surface).public_id if self.retry_of_id else None

    @staticmethod
    def attribution(principal) -> dict:
        """The owner and attribution columns, fixed at submit from the authenticated principal."""
        return {**principal.attribution(), "principal": principal.as_dict()}

    def submitter(self):
        """The principal that submitted the batch, as it was at submit."""
        from core.auth import Principal

        return Principal.from_dict(self.principal)

    def event_attribution(self) -> dict:
        """Usage-event fields of an item that never reached the pipeline, from the submit-time principal."""
        return {"source": "batch", "batch_id": str(self.id), **self.submitter().usage_attribution()}


class ErrorCodeField(models.CharField):
    """A code of batches.outcomes.Code or "": on PostgreSQL a column of the domain `relay_error_code`
    (batches/domains.py: why not a table CHECK), elsewhere a column CHECK with the same list."""

    def db_type(self, connection):
        return domains.DOMAIN if connection.vendor == "postgresql" else super().db_type(connection)

    def db_check(self, connection):
        if connection.vendor == "postgresql":
            return None
        return f'"{self.column}" IN ({domains.sql_list(domains.codes())})'


class Item(models.Model):
    id = models.UUIDField(primary_key=True)  # UUIDv7; also the usage event's request_id
    # No index of its own: uniq_item_idx (batch, idx) and item_batch_state (batch, state) lead with it,
    # and every claim and finish updated a third one (decision 0011).
    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="items", db_index=False)
    idx = models.PositiveIntegerField()
    state = models.CharField(max_length=16, choices=ItemState.choices, default=ItemState.AVAILABLE)
    # Claims so far: the fence token of the current claim (it never goes down).
    attempt = models.PositiveIntegerField(default=0)
    # Attempts used up: transient failures retried and worker losses; waits for capacity don't count.
    retries = models.PositiveSmallIntegerField(default=0)
    max_attempts = models.PositiveSmallIntegerField(default=3)
    # An available item is not claimed before this (backoff after a transient failure, or a wait for capacity).
    not_before = models.DateTimeField(null=True, blank=True)
    lease_owner = models.CharField(max_length=100, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    input_ref = models.CharField(max_length=300)
    result_ref = models.CharField(max_length=300, blank=True, default="")
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)  # the upstream's, when it answered
    error = models.CharField(max_length=1000, blank=True, default="")
    error_body = models.TextField(blank=True, default="")  # the upstream's error body, at most 8 KiB
    # OpenAI surface: the record's custom_id (native items have none).
    custom_id = models.CharField(max_length=512, blank=True, default="")
    # Why the item failed, from batches.outcomes.Code, recorded where it failed ("" until it does).
    # (No `choices`: the admin and the API show the code itself, not a label; its type guards the set.)
    error_code = ErrorCodeField(max_length=64, blank=True, default="")
    # Provider batch mode (batches/provider/): the job that carries (or carried) this record to the provider's
    # batch API; null for a record the relay runs. `placement`: why a record of a binding that asks for the
    # provider runs in the relay instead ("" when it runs where its binding says).
    provider_job = models.ForeignKey(
        "batches.ProviderJob", null=True, blank=True, on_delete=models.SET_NULL, related_name="+", db_index=False
    )
    placement = models.CharField(max_length=32, blank=True, default="")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["batch", "idx"], name="uniq_item_idx"),
            # A delegated item always names its job.
            models.CheckConstraint(
                condition=~Q(state="delegated") | Q(provider_job__isnull=False), name="item_delegated_has_job"
            ),
            # "custom_id must be unique in the batch" (native items have none).
            models.UniqueConstraint(
                fields=["batch", "custom_id"], condition=~Q(custom_id=""), name="uniq_item_custom_id"
            ),
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
            # A job's records still at the provider, in order (results, cancel, the job's input file).
            models.Index(fields=["provider_job", "idx"], name="item_delegated", condition=Q(state="delegated")),
        ]

    def __str__(self):
        return f"{self.batch_id}#{self.idx}"


class Attempt(models.Model):
    """One try of an item that reached the pipeline: when, how it ended, which host key, what the upstream said.

    Written in the same transaction that finishes or releases the item, so the
    history and the item's state never disagree. Local waits for capacity that
    never called a provider (the policy's own limit, every key benched) are not
    attempts; an upstream 429 is.
    """

    # No index of its own: uniq_attempt_per_claim (item, number) leads with it (decision 0011).
    item = models.ForeignKey(Item, on_delete=models.CASCADE, related_name="attempts", db_index=False)
    number = models.PositiveIntegerField()  # the claim (Item.attempt) it ran under
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    duration_ms = models.PositiveIntegerField(default=0)
    # "completed", or the code of why it did not (batches.outcomes.Code).
    outcome = models.CharField(max_length=64)
    # What became of the item: finished, or retry / wait (back to available).
    decision = models.CharField(max_length=16)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)  # the upstream's, when it answered
    host_key_id = models.BigIntegerField(null=True, blank=True)
    error = models.CharField(max_length=1000, blank=True, default="")
    error_body = models.TextField(blank=True, default="")  # bounded like Item.error_body

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["item", "number"], name="uniq_attempt_per_claim"),
            models.CheckConstraint(
                condition=Q(decision__in=["finish", "retry", "wait"]), name="attempt_decision_valid"
            ),
        ]

    def __str__(self):
        return f"{self.item_id} attempt {self.number}: {self.outcome}"


class FilePurpose(models.TextChoices):
    BATCH = "batch"  # uploaded input (or a batch's inline `requests`)
    BATCH_OUTPUT = "batch_output"  # output and error files the relay writes


class File(models.Model):
    """A file of the OpenAI-compatible Files API; its bytes live in the payload store."""

    id = models.UUIDField(primary_key=True)  # UUIDv7, shown as file-<uuid hex>
    owner_hash = models.CharField(max_length=100)  # same ownership rule as batches
    credential_kind = models.CharField(max_length=16)
    credential_id = models.CharField(max_length=64)
    principal_kind = models.CharField(max_length=16)
    principal_id = models.BigIntegerField()
    project_id = models.BigIntegerField(null=True, blank=True)
    purpose = models.CharField(max_length=16, choices=FilePurpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.BigIntegerField()
    created_at = models.DateTimeField(default=timezone.now)
    ref = models.CharField(max_length=300)  # storage ref (batches/storage.py)
    # The batch that wrote it: its output/error files, or the input file made from inline `requests`.
    batch_id = models.UUIDField(null=True, blank=True)
    # OpenAI's `expires_after` (uploads) / the batch's `output_expires_after` (its output and error
    # files); null: kept until deleted. The retention job removes the row and the bytes once past it.
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["owner_hash", "-id"], name="file_owner_id"),
            models.Index(fields=["expires_at"], name="file_expiring", condition=Q(expires_at__isnull=False)),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(purpose__in=[p.value for p in FilePurpose]), name="file_purpose_valid"),
            models.CheckConstraint(condition=Q(bytes__gte=0), name="file_bytes_not_negative"),
            models.CheckConstraint(
                condition=~Q(purpose=FilePurpose.BATCH_OUTPUT) | Q(batch_id__isnull=False),
                name="file_output_has_batch",
            ),
        ]

    def __str__(self):
        return self.public_id

    @property
    def public_id(self) -> str:
        return f"file-{self.id.hex}"


class OutputExpiry(models.Model):
    """A batch's `output_expires_after` (OpenAI): its output and error files expire `seconds` after
    they are written. Its own table, so the batch row is untouched."""

    batch = models.OneToOneField(Batch, primary_key=True, on_delete=models.CASCADE, related_name="output_expiry")
    seconds = models.PositiveIntegerField()

    def __str__(self):
        return f"{self.batch_id}: {self.seconds}s"


class Payload(models.Model):
    """The `db` payload store: bodies every replica can read (see batches/storage.py)."""

    key = models.CharField(max_length=200, primary_key=True)
    data = models.BinaryField()

    def __str__(self):
        return self.key


from batches.provider.models import ProviderJob  # noqa: E402,F401 - registered with this app
