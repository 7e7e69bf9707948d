"""Shared admin behaviour."""

import json

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.db import DatabaseError, connection
from django.utils.functional import cached_property

NANO = 1_000_000_000
# The products' names for the surfaces and batch APIs (Django would title-case the values: "Openai").
SURFACE_NAMES = {"native": "native", "openai": "OpenAI", "anthropic": "Anthropic"}


def surface_name(surface: str) -> str:
    return SURFACE_NAMES.get(surface, surface)


def usd(nanos: int | float | None) -> str:
    """Nano-USD as dollars: cents from a cent up, four decimals below (a single call's cost)."""
    if nanos is None:
        return "—"
    return f"${nanos / NANO:,.2f}" if abs(nanos) >= NANO / 100 or nanos == 0 else f"${nanos / NANO:,.4f}"


class OperateMixin:
    """The permission an admin action declares when it moves rows through their service (cancel a batch,
    revoke a key, pause an endpoint): `@admin.action(permissions=["operate"])`. It is the model's own
    *change* permission in Django's auth, asked of the user directly because a view-only admin answers
    "no" to change for everyone (its form stays read-only: the service is the only writer). Without a
    declaration Django offers an action to anyone who may *view* the list."""

    def has_operate_permission(self, request):
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")


class ViewOnlyAdmin(OperateMixin, admin.ModelAdmin):
    """Rows the relay writes itself (batches, items, files, usage events): operators
    look, they do not add or edit. `deletable` says whether the admin may delete."""

    deletable = True

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return self.deletable and super().has_delete_permission(request, obj)


class EstimatedCountPaginator(Paginator):
    """The changelist's page count without counting a million rows at every load: the planner's estimate
    (EXPLAIN) when it says the list holds more than EXACT_BELOW rows, an exact COUNT below that. An
    operator paging through a large table sees "about N"; a filter down to a few thousand rows is exact.
    Measured on 1,000,000 usage events (bench/scale.py): the COUNT took most of the changelist's time."""

    EXACT_BELOW = 10_000

    @cached_property
    def count(self):
        qs = self.object_list
        if connection.vendor == "postgresql" and hasattr(qs, "query"):
            try:
                sql, params = qs.query.sql_with_params()
                with connection.cursor() as cursor:
                    cursor.execute("EXPLAIN (FORMAT JSON) " + sql, params)
                    estimate = int(_plan(cursor.fetchone()[0])["Plan"]["Plan Rows"])
            except (DatabaseError, KeyError, IndexError, TypeError, ValueError):
                estimate = 0
            if estimate >= self.EXACT_BELOW:
                return estimate
        return super().count


def _plan(raw):
    data = json.loads(raw) if isinstance(raw, str) else raw
    return data[0]


class LargeTableAdmin(ViewOnlyAdmin):
    """A view-only changelist over a table that grows to millions of rows (items, usage events)."""

    paginator = EstimatedCountPaginator
    show_full_result_count = False


class ChoicesFilter(admin.SimpleListFilter):
    """A list filter whose choices come from somewhere small (the catalog, a fixed list), never from a
    `SELECT DISTINCT` over the filtered table: on a million usage events each such query took ~0.5 s per
    page load. Subclasses set `title`, `parameter_name` and `field`, and give `options()`."""

    field = ""

    def options(self) -> list[tuple[str, str]]:
        raise NotImplementedError

    def lookups(self, request, model_admin):
        return self.options()

    def queryset(self, request, queryset):
        value = self.value()
        return queryset.filter(**{self.field: value}) if value not in (None, "") else queryset


# --- owners by name ------------------------------------------------------------------------------------------


def owner_labels(rows) -> dict:
    """{(principal_kind, principal_id, credential_kind, credential_id): "sa-name (project) · sk-wr-ab12…"} for the
    rows of one changelist page (batches, files, usage events: anything with those four attribution columns):
    the service account or user by name, with the relay key's display prefix (or "token"), in at most three
    queries however many rows. A principal deleted since shows its kind and id."""
    from core.models import RelayKey, ServiceAccount, User

    keys = {_owner_key(r) for r in rows}
    sa_ids = {pid for kind, pid, _, _ in keys if kind == "serviceaccount" and pid is not None}
    user_ids = {pid for kind, pid, _, _ in keys if kind == "user" and pid is not None}
    key_ids = {int(cid) for _, _, ckind, cid in keys if ckind == "key" and str(cid).isdigit()}
    accounts = (
        {
            pk: f"{name} ({project})"
            for pk, name, project in ServiceAccount.objects.filter(pk__in=sa_ids).values_list(
                "pk", "name", "project__name"
            )
        }
        if sa_ids
        else {}
    )
    users = dict(User.objects.filter(pk__in=user_ids).values_list("pk", "username")) if user_ids else {}
    prefixes = dict(RelayKey.objects.filter(pk__in=key_ids).values_list("pk", "prefix")) if key_ids else {}
    out = {}
    for kind, pid, ckind, cid in keys:
        if kind == "serviceaccount":
            who = accounts.get(pid) or f"service account {pid} (deleted)"
        elif kind == "user":
            who = users.get(pid) or f"user {pid} (deleted)"
        else:
            who = f"{kind}:{pid}" if kind else "—"
        if ckind == "key":
            prefix = prefixes.get(int(cid)) if str(cid).isdigit() else None
            via = f"{prefix}…" if prefix else f"key {cid}"
        else:
            via = ckind or ""
        out[(kind, pid, ckind, cid)] = f"{who} · {via}" if via else who
    return out


def _owner_key(row) -> tuple:
    return (row.principal_kind, row.principal_id, row.credential_kind, row.credential_id)


def owner_label(row, labels: dict | None = None) -> str:
    """The row's owner by name, from the page's `owner_labels` when given (the change page: its own)."""
    labels = labels if labels is not None else owner_labels([row])
    return labels.get(_owner_key(row), "—")


class NamedOwnersChangeList(ChangeList):
    """A changelist that names each row's owner from one set of look-ups for the page (`owner_labels`)."""

    def get_results(self, request):
        super().get_results(request)
        labels = owner_labels(self.result_list)
        for row in self.result_list:
            row.owner_label = labels.get(_owner_key(row), "—")


def short_id(text: str, keep: int = 8) -> str:
    """A long id shortened for a list column: its prefix and first `keep` hex digits (batch_0193ab12…)."""
    text = str(text)
    head, sep, rest = text.rpartition("_")
    body = rest.replace("-", "")
    shown = f"{head}{sep}{body[:keep]}"
    return shown + "…" if len(body) > keep else shown
