"""Policies: what a credential may call, through which host keys, how fast."""

from decimal import Decimal

from django.db import models
from django.db.models import Q
from django.utils import timezone

from core.generation import CatalogQuerySet


class Meter(models.TextChoices):
    REQUESTS = "requests"
    TOKENS = "tokens"
    TOKENS_INPUT = "tokens.input"
    TOKENS_OUTPUT = "tokens.output"
    CONCURRENCY = "concurrency"


class Strategy(models.TextChoices):
    TOKEN_BUCKET = "token-bucket"
    SLIDING_WINDOW = "sliding-window"
    FIXED_WINDOW = "fixed-window"


class KeySelection(models.TextChoices):
    PRIORITIZED = "prioritized"
    ROUND_ROBIN = "round-robin"
    LEAST_RECENTLY_USED = "least-recently-used"


class RateLimit(models.Model):
    name = models.SlugField(max_length=100, unique=True)
    enabled = models.BooleanField(default=True)

    objects = CatalogQuerySet.as_manager()  # bulk writes bump the catalog generation

    def __str__(self):
        return self.name


class RateLimitRule(models.Model):
    """One bucket: `amount` of `meter` per `window_seconds`, counted by `strategy`."""

    rate_limit = models.ForeignKey(RateLimit, on_delete=models.CASCADE, related_name="rules")
    meter = models.CharField(max_length=32, choices=Meter.choices)
    amount = models.PositiveBigIntegerField()
    window_seconds = models.PositiveIntegerField()
    strategy = models.CharField(max_length=32, choices=Strategy.choices, default=Strategy.SLIDING_WINDOW)

    objects = CatalogQuerySet.as_manager()  # bulk writes bump the catalog generation

    class Meta:
        ordering = ["id"]
        constraints = [
            models.CheckConstraint(condition=Q(amount__gt=0), name="rule_amount_positive"),
            models.CheckConstraint(condition=Q(window_seconds__gt=0), name="rule_window_positive"),
            models.CheckConstraint(condition=Q(meter__in=[m.value for m in Meter]), name="rule_meter_valid"),
            models.CheckConstraint(condition=Q(strategy__in=[s.value for s in Strategy]), name="rule_strategy_valid"),
        ]

    def __str__(self):
        return f"{self.amount} {self.meter}/{self.window_seconds}s ({self.strategy})"


class Policy(models.Model):
    """Model grants, an ordered host-key pool, key selection and a rate limit.

    Grants use the product's model-ref form: `provider/model@host`,
    `provider/model` (any host), `provider/*` or `provider` (every model of a
    provider), `*` (everything).
    """

    name = models.SlugField(max_length=100, unique=True)
    project = models.ForeignKey(
        "relay.Project", null=True, blank=True, on_delete=models.CASCADE, related_name="policies"
    )
    # The product calls this list `models`; it is named `grants` here so it
    # does not shadow django.db.models inside the class body.
    grants = models.JSONField(default=list, blank=True, help_text="e.g. openai/gpt-4o@openai, anthropic/*, *")
    host_keys = models.ManyToManyField("relay.HostKey", through="PolicyHostKey", blank=True, related_name="+")
    key_selection = models.CharField(max_length=32, choices=KeySelection.choices, default=KeySelection.PRIORITIZED)
    rate_limit = models.ForeignKey(RateLimit, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    enabled = models.BooleanField(default=True)
    # The OpenAI-compatible batch surface answers 404 when this is off.
    batch_enabled = models.BooleanField(default=True)
    # Live first: the most of a shared limit (a host key's provider quota or tier, this policy's rate
    # limit) batch items may take while live traffic is active on it; all of it when live is quiet.
    batch_share = models.DecimalField(
        max_digits=3, decimal_places=2, default=Decimal("0.80"), help_text="0.00 to 1.00; default 0.80"
    )
    created_at = models.DateTimeField(default=timezone.now)

    objects = CatalogQuerySet.as_manager()  # bulk writes bump the catalog generation

    class Meta:
        verbose_name_plural = "policies"
        constraints = [
            models.CheckConstraint(
                condition=Q(key_selection__in=[k.value for k in KeySelection]), name="policy_key_selection_valid"
            ),
            models.CheckConstraint(
                condition=Q(batch_share__gte=0) & Q(batch_share__lte=1), name="policy_batch_share_range"
            ),
        ]

    def __str__(self):
        return self.name

    def pool(self):
        """Host keys in declared order (order matters for `prioritized`), with their rate limits.

        An instance from the catalog cache (core.catalog) carries its pool, read once
        at the catalog generation the instance belongs to."""
        cached = self.__dict__.get("_pool_memo")
        if cached is not None:
            return cached
        links = (
            self.pool_links.select_related("host_key__host", "host_key__rate_limit")
            .prefetch_related("host_key__rate_limit__rules")
            .order_by("position")
        )
        return [link.host_key for link in links]


class PolicyHostKey(models.Model):
    policy = models.ForeignKey(Policy, on_delete=models.CASCADE, related_name="pool_links")
    host_key = models.ForeignKey("relay.HostKey", on_delete=models.CASCADE, related_name="+")
    position = models.PositiveIntegerField(default=0)

    objects = CatalogQuerySet.as_manager()  # bulk writes bump the catalog generation

    class Meta:
        ordering = ["position"]
        constraints = [
            models.UniqueConstraint(fields=["policy", "host_key"], name="uniq_policy_host_key"),
        ]

    def __str__(self):
        return f"{self.policy_id}#{self.position}: {self.host_key_id}"
