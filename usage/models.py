"""One usage event per request (live or batch item), written once.

Attribution is stored both as ids and as the names in force when the event was
recorded (slugs), like the product: renaming a project later does not rewrite
history. `cost_nano_usd` is integer nano-USD computed once at record time from
the binding's pricing; null means unpriced, never 0.

`billed_cost_nano_usd` is what the caller pays when a batch discount applies
(OpenAI-surface batches, RELAY_BATCH_DISCOUNT_PERCENT fixed on the batch at
submit): `cost_nano_usd * (100 - percent) // 100`, floored per event, so a
batch's billed total is exactly the sum of its events'. It is null when no
discount applies (live requests, native batches: the price is cost_nano_usd)
and when the event is unpriced. The undiscounted cost is always kept beside it.

A batch record run at the provider (`executed_by = "provider"`, batches/provider/) costs the operator the
provider's batch price: its `cost_nano_usd` is at the pricing's batch rates (half the live ones unless set),
while `billed_cost_nano_usd` follows the same rule as a relay-run record (the list price less the batch
discount), so the margin between the two is visible per event.
"""

from django.db import models
from django.db.models import Q
from django.utils import timezone

from core.generation import CatalogQuerySet


class Source(models.TextChoices):
    LIVE = "live"
    BATCH = "batch"


class ExecutedBy(models.TextChoices):
    RELAY = "relay"
    PROVIDER = "provider"


class UsageEvent(models.Model):
    # "Written once" is a constraint (usage_request_id_unique, below): a UniqueConstraint rather than
    # unique=True, which on PostgreSQL also builds a varchar_pattern_ops index for LIKE queries that
    # nothing makes, updated at every event (decision 0011). The same goes for batch_id's index.
    request_id = models.CharField(max_length=64)
    source = models.CharField(max_length=16, choices=Source.choices)
    ts = models.DateTimeField(default=timezone.now)
    status = models.PositiveSmallIntegerField(default=0)  # 0: rejected before any upstream answer
    duration_ms = models.PositiveIntegerField(default=0)
    attempts = models.PositiveSmallIntegerField(default=0)
    error_kind = models.CharField(max_length=64, blank=True, default="")
    error_message = models.CharField(max_length=500, blank=True, default="")

    credential_kind = models.CharField(max_length=16, blank=True, default="")
    credential_id = models.CharField(max_length=64, blank=True, default="")
    principal_kind = models.CharField(max_length=16, blank=True, default="")
    principal_id = models.BigIntegerField(null=True, blank=True)
    project_id = models.BigIntegerField(null=True, blank=True)
    team_id = models.BigIntegerField(null=True, blank=True)
    policy_id = models.BigIntegerField(null=True, blank=True)
    host_key_id = models.BigIntegerField(null=True, blank=True)
    project = models.CharField(max_length=100, blank=True, default="")
    team = models.CharField(max_length=100, blank=True, default="")
    policy = models.CharField(max_length=100, blank=True, default="")
    model = models.CharField(max_length=200, blank=True, default="")
    provider = models.CharField(max_length=100, blank=True, default="")
    host = models.CharField(max_length=100, blank=True, default="")
    batch_id = models.CharField(max_length=64, blank=True, default="")

    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cache_read_tokens = models.BigIntegerField(default=0)
    cache_write_tokens = models.BigIntegerField(default=0)
    cost_nano_usd = models.BigIntegerField(null=True, blank=True)
    billed_cost_nano_usd = models.BigIntegerField(null=True, blank=True)
    # Where the request ran: "relay" (a live call, or a batch record the relay's workers ran) or "provider"
    # (a batch record sent in a provider batch job; its cost_nano_usd is the provider's batch price).
    executed_by = models.CharField(max_length=16, choices=ExecutedBy.choices, default=ExecutedBy.RELAY)
    # The token counts are the relay's estimate, not the provider's: a stream that ended before the provider's
    # usage arrived (the client hung up, the stream broke) is billed its prompt's size and the text relayed
    # so far (gateway.streaming), because the provider bills it all the same.
    usage_estimated = models.BooleanField(default=False)

    class Meta:
        indexes = [
            # Keyset pagination, newest first: (ts, request_id).
            models.Index(fields=["-ts", "-request_id"], name="usage_ts_rid_desc"),
            models.Index(fields=["principal_kind", "principal_id", "-ts"], name="usage_principal_ts"),
            models.Index(fields=["source", "-ts"], name="usage_source_ts"),
            models.Index(fields=["batch_id"], name="usage_batch_id"),
        ]
        constraints = [
            models.UniqueConstraint(fields=["request_id"], name="usage_request_id_unique"),
            models.CheckConstraint(condition=Q(source__in=[s.value for s in Source]), name="usage_source_valid"),
            models.CheckConstraint(
                condition=Q(executed_by__in=[e.value for e in ExecutedBy]), name="usage_executed_by_valid"
            ),
            models.CheckConstraint(
                condition=Q(input_tokens__gte=0)
                & Q(output_tokens__gte=0)
                & Q(cache_read_tokens__gte=0)
                & Q(cache_write_tokens__gte=0),
                name="usage_tokens_not_negative",
            ),
            # A discount never charges more than the undiscounted price, nor prices an unpriced event. (A record
            # the provider ran costs its batch price, which the operator sets apart from what it bills.)
            models.CheckConstraint(
                condition=Q(billed_cost_nano_usd__isnull=True)
                | Q(cost_nano_usd__isnull=False, billed_cost_nano_usd__lte=models.F("cost_nano_usd"))
                | Q(cost_nano_usd__isnull=False, executed_by="provider"),
                name="usage_billed_within_cost",
            ),
        ]

    def __str__(self):
        return f"{self.request_id} {self.source} {self.model} {self.status}"

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens + self.cache_read_tokens + self.cache_write_tokens


# --- spend budgets (usage/budgets.py keeps the accounts) ------------------------------------------


class Period(models.TextChoices):
    DAY = "day"
    MONTH = "month"


class ScopeKind(models.TextChoices):
    PROJECT = "project"
    TEAM = "team"
    SERVICE_ACCOUNT = "service_account"
    POLICY = "policy"


SCOPE_KINDS = tuple(k.value for k in ScopeKind)


def _exactly_one_scope() -> Q:
    one = Q()
    for kind in SCOPE_KINDS:
        present = Q(**{f"{kind}__isnull": False})
        for other in SCOPE_KINDS:
            if other != kind:
                present &= Q(**{f"{other}__isnull": True})
        one = present if not one else one | present
    return one


class Budget(models.Model):
    """At most `usd_nanos` of billed cost per period (UTC day, or UTC month from the 1st) for one scope.

    Budgets are read on every live request, so they are cached like the catalog: writes bump the
    catalog generation (CatalogQuerySet here, post_save/post_delete in usage.apps)."""

    name = models.SlugField(max_length=100, unique=True)
    project = models.ForeignKey("relay.Project", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    team = models.ForeignKey("relay.Team", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    service_account = models.ForeignKey(
        "relay.ServiceAccount", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    policy = models.ForeignKey("policies.Policy", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    usd_nanos = models.BigIntegerField(help_text="The limit in nano-USD (1 USD = 1,000,000,000).")
    period = models.CharField(max_length=8, choices=Period.choices, default=Period.MONTH)
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    objects = CatalogQuerySet.as_manager()  # bulk writes bump the generation the budget cache follows

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=_exactly_one_scope(),
                name="budget_exactly_one_scope",
                violation_error_message=(
                    "A budget has exactly one scope: a project, a team, a service account or a policy."
                ),
            ),
            models.CheckConstraint(condition=Q(usd_nanos__gte=0), name="budget_usd_not_negative"),
            models.CheckConstraint(condition=Q(period__in=[p.value for p in Period]), name="budget_period_valid"),
        ]

    def __str__(self):
        return self.name

    @property
    def scope(self) -> tuple[str, int]:
        for kind in SCOPE_KINDS:
            value = getattr(self, f"{kind}_id")
            if value is not None:
                return kind, value
        raise ValueError(f"budget {self.name} has no scope")


class BudgetPeriod(models.Model):
    """A budget's account for one period: what was spent (billed cost settled) and what is reserved
    (batch records' worst cases in flight). Changed only by single conditional UPDATEs (usage/budgets.py)."""

    budget = models.ForeignKey(Budget, on_delete=models.CASCADE, related_name="periods")
    period_start = models.DateTimeField()
    spent_nanos = models.BigIntegerField(default=0)
    reserved_nanos = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["budget", "period_start"], name="budget_period_unique"),
            models.CheckConstraint(condition=Q(spent_nanos__gte=0), name="budget_spent_not_negative"),
            models.CheckConstraint(condition=Q(reserved_nanos__gte=0), name="budget_reserved_not_negative"),
        ]

    def __str__(self):
        return f"{self.budget_id}@{self.period_start:%Y-%m-%d}"


class BudgetHold(models.Model):
    """One reservation against one budget period, until it is settled or `expires_at` passes (a process
    that died between reserve and settle): usage/budgets.reclaim_expired gives expired ones back."""

    period = models.ForeignKey(BudgetPeriod, on_delete=models.CASCADE, related_name="holds")
    nanos = models.BigIntegerField()
    expires_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["expires_at"], name="budget_hold_expires")]
        constraints = [models.CheckConstraint(condition=Q(nanos__gte=0), name="budget_hold_not_negative")]

    def __str__(self):
        return f"{self.nanos} on {self.period_id} until {self.expires_at:%Y-%m-%d %H:%M}"
