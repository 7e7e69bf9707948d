"""ProviderJob: one upstream batch job (an OpenAI batch, an Anthropic message batch, a Bedrock model invocation
job…) carrying some records of one relay batch, all on one binding and one host key.

The row is written before any upstream call, so a restart never creates a job twice: the row's id travels in
the upstream batch's metadata (OpenAI) or in its records' custom_ids (Anthropic), and a job whose create
outcome is unknown (`submitting`) is found again by listing the provider's batches, not created again.

    pending ──▶ submitting ──▶ running ──▶ ingesting ──▶ done
       ▲            │              │
       └────────────┴──────────────┘  the provider had no capacity (429, token_limit_exceeded): wait, again
    pending | submitting | running ──▶ released   (auto mode: the records went back to the relay's workers)
    pending ──▶ done                              (cancelled or expired before it was sent)
"""

from django.db import models
from django.db.models import Q
from django.utils import timezone


class JobStatus(models.TextChoices):
    PENDING = "pending"  # nothing upstream yet (or waiting, after a capacity refusal, until not_before)
    SUBMITTING = "submitting"  # the create call is (or was) in flight: its outcome is not known
    RUNNING = "running"  # the provider has it: polled
    INGESTING = "ingesting"  # the provider ended it: its results are being written to the items
    DONE = "done"  # every record of the job is final
    RELEASED = "released"  # its records run in the relay instead (auto mode)


# The batch APIs a job may be sent to: gateway.batch_apis.REGISTRY's names (tests/test_provider_batch_apis.py
# checks the two agree; vertex is listed with the clouds' batch APIs, so that its module needs no migration).
BATCH_API_KINDS = ["openai", "anthropic", "azure_openai", "bedrock", "vertex", "openai_compatible"]

OPEN_JOB_STATUSES = (JobStatus.PENDING, JobStatus.SUBMITTING, JobStatus.RUNNING, JobStatus.INGESTING)


class ProviderJob(models.Model):
    id = models.UUIDField(primary_key=True)  # UUIDv7
    batch = models.ForeignKey("batches.Batch", on_delete=models.CASCADE, related_name="provider_jobs")
    # Plain ids of the catalog rows, with what the job needs of them copied: a catalog edit while the job
    # runs must not change where its results are fetched from.
    binding_id = models.BigIntegerField()
    host_id = models.BigIntegerField()
    kind = models.CharField(max_length=32)  # the batch API: a name in gateway.batch_apis.REGISTRY
    endpoint = models.CharField(max_length=32)  # the records' path: /v1/chat/completions, /v1/messages, …
    host_key_id = models.BigIntegerField(null=True, blank=True)  # chosen when the job is first sent
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.PENDING)
    records = models.PositiveIntegerField(default=0)
    bytes = models.BigIntegerField(default=0)
    # What the provider calls it.
    upstream_id = models.CharField(max_length=200, blank=True, default="")
    upstream_input_file_id = models.CharField(max_length=200, blank=True, default="")
    upstream_status = models.CharField(max_length=32, blank=True, default="")
    # The provider's counts while it runs (the surfaces show them before the results are written).
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    submit_started_at = models.DateTimeField(null=True, blank=True)
    submitted_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    # The next poll (or send, for a pending job) is not due before this: the poll budget and capacity waits.
    not_before = models.DateTimeField(null=True, blank=True)
    polls = models.PositiveIntegerField(default=0)
    create_attempts = models.PositiveSmallIntegerField(default=0)
    capacity_waits = models.PositiveSmallIntegerField(default=0)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True, default="")
    # Who holds the job's step now: a new token each take. A step's writes are fenced on it, so a process
    # whose lease ran out (a second taker has the job) can no longer move it, above all not to `submitting`.
    lease = models.UUIDField(null=True, blank=True)
    # The spend-budget reservation of the job's records (usage.job_budgets.reserve_for_job), taken before the
    # job is sent and given back as its results are written or when it ends: {"holds": [[hold id, period
    # id, nanos]], "budgets": [ids], "per_record": nanos}. Null: nothing reserved (no budget applies).
    budget_hold = models.JSONField(null=True, blank=True)
    # The records' summed worst case (nano-USD, batch discount taken), worked out the first time the records
    # are read out. A job waiting on a spent budget is then weighed against the room left without reading its
    # records again: a tenant with a little budget left and a large job costs the control queue one read.
    worst_nanos = models.BigIntegerField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["not_before"], name="provider_job_open", condition=Q(status__in=OPEN_JOB_STATUSES)),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=[s.value for s in JobStatus]), name="provider_job_status_valid"
            ),
            # The registry's names (a new provider widens it in a migration: decision 0018).
            models.CheckConstraint(condition=Q(kind__in=BATCH_API_KINDS), name="provider_job_kind_valid"),
            # One row per upstream batch: a job found again by listing can never be adopted twice.
            models.UniqueConstraint(
                fields=["host_id", "upstream_id"], condition=~Q(upstream_id=""), name="uniq_provider_job_upstream"
            ),
            # A job the provider has (or had) names its upstream batch.
            models.CheckConstraint(
                condition=~Q(status__in=["running", "ingesting"]) | ~Q(upstream_id=""),
                name="provider_job_running_has_upstream",
            ),
        ]

    def __str__(self):
        return f"job {self.id} ({self.kind} {self.upstream_id or self.status})"

    def custom_id(self, idx: int) -> str:
        """The relay-made custom_id of the batch's item `idx` in this job: users' ids never reach the provider,
        never collide across jobs, and name the job (how an Anthropic job is found again; `item_idx`)."""
        return f"{self.id.hex}-{idx}"

    def item_idx(self, custom_id: str) -> int | None:
        head, _, idx = custom_id.partition("-")
        if head != self.id.hex or not idx.isascii() or not idx.isdigit():
            return None
        return int(idx)
