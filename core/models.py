"""Gateway core: tenancy, the catalog and credentials.

Invariants that matter are database constraints, not just form validation:
a binding is unique per (model, host), a host key has exactly one value
source, a relay key belongs to exactly one principal.
"""

import re

from django.contrib.auth.models import AbstractUser
from django.core.validators import RegexValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone

from core import crypto, hostkinds
from core.errors import quoted
from core.generation import CatalogQuerySet

# An OpenAI organization or project id (org-…, proj_…) as it goes into a header: no spaces, no line breaks.
ACCOUNT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
_account_id = RegexValidator(ACCOUNT_ID_RE, "an id such as org-… or proj_… (letters, digits, '-', '_', '.')")


class User(AbstractUser):
    """A person. `token_version` is bumped to revoke every inference token of the user."""

    token_version = models.PositiveIntegerField(default=1)

    def bump_token_version(self):
        User.objects.filter(pk=self.pk).update(token_version=models.F("token_version") + 1)
        self.refresh_from_db(fields=["token_version"])


class Team(models.Model):
    name = models.SlugField(max_length=100, unique=True)
    created_at = models.DateTimeField(default=timezone.now)

    objects = CatalogQuerySet.as_manager()  # bulk writes bump the generation (relay keys are cached)

    def __str__(self):
        return self.name


class Project(models.Model):
    team = models.ForeignKey(Team, on_delete=models.PROTECT, related_name="projects")
    name = models.SlugField(max_length=100, unique=True)
    # Governs inference tokens minted for this project and service accounts
    # that name no policy of their own.
    default_policy = models.ForeignKey(
        "policies.Policy", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    objects = CatalogQuerySet.as_manager()  # bulk writes bump the generation (relay keys are cached)

    def __str__(self):
        return self.name


class ServiceAccount(models.Model):
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="service_accounts")
    name = models.SlugField(max_length=100)
    policy = models.ForeignKey("policies.Policy", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)

    objects = CatalogQuerySet.as_manager()  # bulk writes bump the generation (relay keys are cached)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="uniq_service_account_per_project")]

    def __str__(self):
        return f"{self.project.name}/{self.name}"


class Host(models.Model):
    name = models.SlugField(max_length=100, unique=True)
    base_url = models.URLField(max_length=500)
    # How the host is reached (core.hostkinds): URL scheme, auth, what it serves live, its batch API. Empty: as
    # before kinds existed, each binding's adapter picks OpenAI's or Anthropic's wire.
    kind = models.CharField(max_length=32, blank=True, default="", choices=hostkinds.choices())
    # The kind's own settings (Azure's api_version…), checked by the kind; a setting left out takes its default.
    options = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    objects = CatalogQuerySet.as_manager()  # bulk writes bump the catalog generation

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(kind__in=["", *hostkinds.REGISTRY]), name="host_kind_valid"),
        ]

    def __str__(self):
        return self.name

    def clean(self):
        from django.core.exceptions import ValidationError

        if self.kind and self.kind in hostkinds.REGISTRY:
            problem = hostkinds.get(self.kind).options_problem(self.options)
            if problem:
                raise ValidationError({"options": problem})
        elif self.options:
            raise ValidationError({"options": "only a host with a kind takes settings"})


class LLMModel(models.Model):
    """A model as clients name it (`gpt-4o`), with its provider (`openai`)."""

    name = models.CharField(max_length=200, unique=True)
    provider = models.SlugField(max_length=100)
    created_at = models.DateTimeField(default=timezone.now)

    objects = CatalogQuerySet.as_manager()  # bulk writes bump the catalog generation

    class Meta:
        verbose_name = "model"
        db_table = "relay_model"

    def __str__(self):
        return f"{self.provider}/{self.name}"


class Pricing(models.Model):
    """Rates in integer nano-USD per million tokens (1 USD = 1e9 nano-USD).

    A null rate means "unpriced": an event whose tokens hit a null rate has a
    null cost, never 0.
    """

    name = models.CharField(max_length=200, unique=True)
    input_nanos_per_mtok = models.BigIntegerField(null=True, blank=True)
    output_nanos_per_mtok = models.BigIntegerField(null=True, blank=True)
    cache_read_nanos_per_mtok = models.BigIntegerField(null=True, blank=True)
    cache_write_nanos_per_mtok = models.BigIntegerField(null=True, blank=True)
    # What the provider charges for a record run through its own batch API (usage.pricing.provider_batch_cost):
    # null means half the live rate, the OpenAI and Anthropic batch price (docs/provider-batches.md).
    batch_input_nanos_per_mtok = models.BigIntegerField(null=True, blank=True)
    batch_output_nanos_per_mtok = models.BigIntegerField(null=True, blank=True)
    # A long-context tier (usage.pricing.cost_nano_usd): a request whose input side (input + cache read +
    # cache write tokens) is above the threshold is billed at the long rates on every meter, as Anthropic
    # bills a request over 200K input tokens under the 1M-context beta. Null threshold: no tier. A null long
    # rate with a threshold set means that meter is unpriced above it (the event's cost is null, never 0).
    long_context_threshold_tokens = models.BigIntegerField(null=True, blank=True)
    long_input_nanos_per_mtok = models.BigIntegerField(null=True, blank=True)
    long_output_nanos_per_mtok = models.BigIntegerField(null=True, blank=True)
    long_cache_read_nanos_per_mtok = models.BigIntegerField(null=True, blank=True)
    long_cache_write_nanos_per_mtok = models.BigIntegerField(null=True, blank=True)

    objects = CatalogQuerySet.as_manager()  # bulk writes bump the catalog generation

    class Meta:
        verbose_name_plural = "pricing"
        constraints = [
            models.CheckConstraint(
                condition=(
                    (Q(input_nanos_per_mtok__isnull=True) | Q(input_nanos_per_mtok__gte=0))
                    & (Q(output_nanos_per_mtok__isnull=True) | Q(output_nanos_per_mtok__gte=0))
                    & (Q(cache_read_nanos_per_mtok__isnull=True) | Q(cache_read_nanos_per_mtok__gte=0))
                    & (Q(cache_write_nanos_per_mtok__isnull=True) | Q(cache_write_nanos_per_mtok__gte=0))
                    & (Q(batch_input_nanos_per_mtok__isnull=True) | Q(batch_input_nanos_per_mtok__gte=0))
                    & (Q(batch_output_nanos_per_mtok__isnull=True) | Q(batch_output_nanos_per_mtok__gte=0))
                ),
                name="pricing_rates_not_negative",
            ),
            models.CheckConstraint(
                condition=(
                    (Q(long_input_nanos_per_mtok__isnull=True) | Q(long_input_nanos_per_mtok__gte=0))
                    & (Q(long_output_nanos_per_mtok__isnull=True) | Q(long_output_nanos_per_mtok__gte=0))
                    & (Q(long_cache_read_nanos_per_mtok__isnull=True) | Q(long_cache_read_nanos_per_mtok__gte=0))
                    & (Q(long_cache_write_nanos_per_mtok__isnull=True) | Q(long_cache_write_nanos_per_mtok__gte=0))
                ),
                name="pricing_long_rates_not_negative",
            ),
            # Long rates without a threshold would never apply: a tier is a threshold with its rates.
            models.CheckConstraint(
                condition=Q(long_context_threshold_tokens__gt=0)
                | (
                    Q(long_context_threshold_tokens__isnull=True)
                    & Q(long_input_nanos_per_mtok__isnull=True)
                    & Q(long_output_nanos_per_mtok__isnull=True)
                    & Q(long_cache_read_nanos_per_mtok__isnull=True)
                    & Q(long_cache_write_nanos_per_mtok__isnull=True)
                ),
                name="pricing_long_context_tier_whole",
            ),
        ]

    def __str__(self):
        return self.name


class Adapter(models.TextChoices):
    OPENAI = "openai", "openai (Chat Completions, Completions, Embeddings)"
    OPENAI_RESPONSES = "openai_responses", "openai_responses (Responses API)"
    ANTHROPIC = "anthropic", "anthropic (Messages API)"


class BatchMode(models.TextChoices):
    """Where a binding's batch records run (batches/provider/placement.py): in the relay's own workers, at the
    provider's batch API (its price and its separate quota), or there when the record can go."""

    RELAY = "relay"
    PROVIDER = "provider"
    AUTO = "auto"


class HostBinding(models.Model):
    model = models.ForeignKey(LLMModel, on_delete=models.CASCADE, related_name="bindings")
    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="bindings")
    adapter = models.CharField(max_length=32, choices=Adapter.choices, default=Adapter.OPENAI)
    upstream_name = models.CharField(max_length=200)
    pricing = models.ForeignKey(Pricing, null=True, blank=True, on_delete=models.SET_NULL)
    enabled = models.BooleanField(default=True)
    batch_mode = models.CharField(max_length=16, choices=BatchMode.choices, default=BatchMode.RELAY)
    # The `anthropic-beta` values a caller may send through this binding (gateway.adapters): the betas bill the
    # operator's account, so the operator lists the ones it enabled and priced. Empty: none pass.
    allowed_betas = models.JSONField(default=list, blank=True)

    objects = CatalogQuerySet.as_manager()  # bulk writes bump the catalog generation

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["model", "host"], name="uniq_binding_model_host"),
            models.CheckConstraint(
                condition=Q(batch_mode__in=[m.value for m in BatchMode]), name="binding_batch_mode_valid"
            ),
            models.CheckConstraint(condition=Q(adapter__in=[a.value for a in Adapter]), name="binding_adapter_valid"),
        ]

    def __str__(self):
        return f"{self.model.name}@{self.host.name}"

    def clean(self):
        from django.core.exceptions import ValidationError

        pricing = self.pricing if self.pricing_id else None
        problem = betas_problem(self.adapter, self.allowed_betas, pricing)
        if problem:
            raise ValidationError({"allowed_betas": problem})
        kind = hostkinds.get(self.host.kind) if self.host_id and self.host.kind in hostkinds.REGISTRY else None
        if kind is not None and kind.adapter_problem(self.adapter):
            raise ValidationError({"adapter": kind.adapter_problem(self.adapter)})
        if kind is not None and kind.batch_mode_problem(self.batch_mode):
            raise ValidationError({"batch_mode": kind.batch_mode_problem(self.batch_mode)})


class HostKey(models.Model):
    """A provider credential. The value is AES-GCM encrypted with RELAY_MASTER_KEY,
    or read from an environment variable at call time; it is never shown back."""

    name = models.SlugField(max_length=100, unique=True)
    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="keys")
    value_encrypted = models.TextField(blank=True, default="", editable=False)
    # Read only when it starts with settings.RELAY_HOSTKEY_ENV_PREFIX (`HostKey.env_problem`): the process
    # calling a provider also holds the master key, the database URL and cloud credentials.
    value_env = models.CharField(max_length=200, blank=True, default="")
    # The OpenAI organization and project this key bills (sent as OpenAI-Organization / OpenAI-Project by
    # gateway.adapters). The operator's choice, never the caller's. Empty: the key's own default.
    openai_organization = models.CharField(max_length=200, blank=True, default="", validators=[_account_id])
    openai_project = models.CharField(max_length=200, blank=True, default="", validators=[_account_id])
    # Upstream tier limit of this key: when spent, the key is skipped.
    rate_limit = models.ForeignKey(
        "policies.RateLimit", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    objects = CatalogQuerySet.as_manager()  # bulk writes bump the catalog generation

    class Meta:
        constraints = [
            # Exactly one value source.
            models.CheckConstraint(
                condition=(Q(value_encrypted="") & ~Q(value_env="")) | (~Q(value_encrypted="") & Q(value_env="")),
                name="host_key_one_value_source",
            )
        ]

    def __str__(self):
        return self.name

    def clean(self):
        from django.core.exceptions import ValidationError

        problem = self.env_problem(self.value_env)
        if problem:
            raise ValidationError({"value_env": problem})

    @staticmethod
    def env_problem(name: str) -> str:
        """Why a host key may not read environment variable `name` ("" when it may): hostkinds.env_problem."""
        return hostkinds.env_problem(name)

    def set_value(self, plaintext: str) -> None:
        self.value_encrypted = crypto.encrypt(plaintext)
        self.value_env = ""

    def get_value(self) -> str:
        if self.value_env:
            import os

            # Checked at every read too: a row written past `relay apply` and the admin (SQL, a restore, a
            # prefix changed since) still cannot send another variable to a provider.
            problem = self.env_problem(self.value_env)
            if problem:
                raise crypto.SecretUnavailable(f"host key {self.name}: {problem}")
            value = os.environ.get(self.value_env, "")
            if not value:
                raise crypto.SecretUnavailable(
                    f"host key {self.name}: environment variable {self.value_env} is not set"
                )
            return value
        # Decrypted once per instance and ciphertext: the catalog cache keeps instances.
        memo = self.__dict__.get("_value_memo")
        if memo is not None and memo[0] == self.value_encrypted:
            return memo[1]
        value = crypto.decrypt(self.value_encrypted)
        self.__dict__["_value_memo"] = (self.value_encrypted, value)
        return value


class RelayKey(models.Model):
    """A relay credential: `sk-wr-…`. Only sha256 and a display prefix are stored."""

    name = models.CharField(max_length=200, blank=True, default="")
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=14, editable=False)
    previous_key_hash = models.CharField(max_length=64, unique=True, null=True, blank=True, editable=False)
    grace_until = models.DateTimeField(null=True, blank=True)
    service_account = models.ForeignKey(
        ServiceAccount, null=True, blank=True, on_delete=models.CASCADE, related_name="keys"
    )
    user = models.ForeignKey(User, null=True, blank=True, on_delete=models.CASCADE, related_name="relay_keys")
    # For a personal key: the project it acts in (tenancy and default policy).
    project = models.ForeignKey(Project, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    policy = models.ForeignKey("policies.Policy", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    enabled = models.BooleanField(default=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    objects = CatalogQuerySet.as_manager()  # bulk writes bump the generation (relay keys are cached)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(Q(service_account__isnull=False) & Q(user__isnull=True))
                | (Q(service_account__isnull=True) & Q(user__isnull=False)),
                name="relay_key_one_principal",
            )
        ]

    def __str__(self):
        return f"{self.prefix}… ({self.name or self.principal_label})"

    @property
    def principal_label(self) -> str:
        if self.service_account_id:
            return f"serviceaccount:{self.service_account}"
        return f"user:{self.user}"


class RevokedToken(models.Model):
    """jti denylist. Kept in Postgres (the truth), pruned after the token's expiry."""

    jti = models.CharField(max_length=64, primary_key=True)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(default=timezone.now)

    def __str__(self):
        return self.jti


class UsageRollup(models.Model):
    """Running totals of usage events per label set, for /metrics (relay/metrics_rollup.py).

    Prometheus counters: they only grow, so retention deleting usage events never makes them step down.
    `model` is the catalog model at the time the event was counted, else "unknown" (decision 0014)."""

    model = models.CharField(max_length=200)
    source = models.CharField(max_length=16)
    status = models.PositiveSmallIntegerField()
    host = models.CharField(max_length=100, blank=True, default="")
    executed_by = models.CharField(max_length=16)
    n = models.BigIntegerField(default=0)
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cache_read_tokens = models.BigIntegerField(default=0)
    cache_write_tokens = models.BigIntegerField(default=0)
    cost_nano_usd = models.BigIntegerField(default=0)
    billed_nano_usd = models.BigIntegerField(default=0)
    duration_ms = models.BigIntegerField(default=0)
    # Events at or under each bound of relay.metrics.UPSTREAM_BUCKETS_S (events with a host only).
    buckets = models.JSONField(default=list)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["model", "source", "status", "host", "executed_by"], name="usage_rollup_labels_unique"
            )
        ]

    def __str__(self):
        return f"{self.model}/{self.source}/{self.status}/{self.host or '-'}/{self.executed_by}: {self.n}"


class ItemRunRollup(models.Model):
    """Finished batch items' run time (claim to finish) per final state, for /metrics: counted with the
    item's usage event, which its finish writes in the same transaction (relay/metrics_rollup.py)."""

    state = models.CharField(max_length=16, unique=True)
    n = models.BigIntegerField(default=0)
    total_ms = models.BigIntegerField(default=0)
    # Items at or under each bound of relay.metrics_rollup.RUN_BUCKETS_S.
    buckets = models.JSONField(default=list)

    def __str__(self):
        return f"{self.state}: {self.n}"


class SpendRollup(models.Model):
    """Billed spend per UTC day, project and model, for the console's 30-day chart (relay/console.py): kept by
    the same run of relay/metrics_rollup.py as UsageRollup, so the page reads a few hundred rows instead of
    grouping a month of usage events. Only priced events are counted (an unpriced one has no cost to add), so a
    refused call's junk model name never makes a row. `nanos` is what callers are charged: the billed cost, else
    the cost. Like UsageRollup it only grows: retention deleting usage events leaves past days' spend as it was."""

    day = models.DateField()
    project = models.CharField(max_length=100, blank=True, default="")
    model = models.CharField(max_length=200, blank=True, default="")
    n = models.BigIntegerField(default=0)
    nanos = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            # Leading with `day`: the console's read is a range over the last days.
            models.UniqueConstraint(fields=["day", "project", "model"], name="spend_rollup_day_project_model")
        ]

    def __str__(self):
        return f"{self.day} {self.project or '-'}/{self.model or '-'}: {self.nanos} nano-USD"


class UsageRollupCursor(models.Model):
    """How far the rollup has read the usage table: every id up to `last_id` is counted except the
    `gaps` ([first id, last id, epoch s first seen] ranges of ids not committed when they were passed)."""

    last_id = models.BigIntegerField(default=0)
    gaps = models.JSONField(default=list)
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self):
        return f"usage rollup at id {self.last_id} ({len(self.gaps)} gaps)"


# Betas that change what a request costs, and what the binding's pricing must have before one may be allowed:
# the 1M-context beta bills a request over 200K input tokens at long-context rates (Pricing.long_*).
PRICE_CHANGING_BETAS = {"context-1m-": "long_context"}
# A beta name as Anthropic writes them: `files-api-2025-04-14`, `context-1m-2025-08-07`.
_BETA_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}\Z")


def betas_problem(adapter: str, allowed, pricing) -> str:
    """Why a binding may not allow these betas ("" when it may): `relay apply` and the admin refuse it."""
    if not isinstance(allowed, list) or not all(isinstance(b, str) for b in allowed):
        return "must be a list of beta names, such as [files-api-2025-04-14]"
    if not allowed:
        return ""
    if adapter != Adapter.ANTHROPIC:
        return f"only an anthropic binding takes betas (this one's adapter is {adapter})"
    for beta in allowed:
        if not _BETA_NAME.match(beta):
            return f"{quoted(beta)} is not a beta name (lower-case letters, digits, '-', '.', '_')"
        problem = beta_price_problem(beta, pricing)
        if problem:
            return problem
    return ""


def beta_price_problem(beta: str, pricing) -> str:
    for prefix, tier in PRICE_CHANGING_BETAS.items():
        if beta.startswith(prefix) and tier == "long_context":
            if pricing is None or pricing.long_context_threshold_tokens is None:
                return (
                    f"'{beta}' bills long-context rates: give the binding a pricing with a long_context tier "
                    "(above_input_tokens and its rates) before allowing it"
                )
    return ""


def kind_binding_problem(host, adapter: str, batch_mode: str) -> str:
    """Why a binding with `adapter` and `batch_mode` cannot be on `host`, given the host's kind ("" when it can)."""
    if not host.kind or host.kind not in hostkinds.REGISTRY:
        return ""  # no kind: the binding's adapter picks the wire, as it always did
    kind = hostkinds.get(host.kind)
    return kind.adapter_problem(adapter) or kind.batch_mode_problem(batch_mode)
