"""Reads of usage events: who may see what, the shared filters, keyset pages and summaries.

Everything is done in SQL: a page is one indexed range scan on (ts, request_id)
and a summary is one GROUP BY, however many events there are.
"""

from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import Count, Q, QuerySet, Sum

from core.auth import Principal
from core.dbfunctions import UUIDText
from usage.models import UsageEvent

# The event-time slugs a caller may filter and group on.
DIMENSIONS = ("source", "model", "project", "team", "policy", "host")

# The product's definition of a failed request: an error answer, or a relay-side
# rejection (status 0) that names its kind.
ERROR_Q = Q(status__gte=400) | ~Q(error_kind="")

_TOKEN_COLUMNS = {
    "input": "input_tokens",
    "output": "output_tokens",
    "cache_read": "cache_read_tokens",
    "cache_write": "cache_write_tokens",
}


@dataclass(frozen=True)
class Viewer:
    """Whose events a caller reads: an operator reads all, anyone else its own principal's."""

    operator: bool = False
    principal_kind: str = ""
    principal_id: int | None = None

    @classmethod
    def of(cls, principal: Principal) -> "Viewer":
        return cls(principal_kind=principal.principal_kind, principal_id=principal.principal_id)


@dataclass(frozen=True)
class EventFilters:
    start: datetime
    end: datetime
    # dimension -> accepted values; a dimension absent here is not filtered.
    slugs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    statuses: tuple[int, ...] = ()
    error: bool | None = None
    # Batch events whose batch came from one of these surfaces (native, openai, anthropic).
    batch_surfaces: tuple[str, ...] = ()


def visible_events(viewer: Viewer) -> QuerySet[UsageEvent]:
    if viewer.operator:
        return UsageEvent.objects.all()
    if viewer.principal_id is None:
        # Not "events without a principal": a viewer who is nobody sees nothing.
        return UsageEvent.objects.none()
    return UsageEvent.objects.filter(principal_kind=viewer.principal_kind, principal_id=viewer.principal_id)


def filtered_events(viewer: Viewer, filters: EventFilters) -> QuerySet[UsageEvent]:
    qs = visible_events(viewer).filter(ts__gte=filters.start, ts__lte=filters.end)
    for dimension, values in filters.slugs.items():
        qs = qs.filter(**{f"{dimension}__in": values})
    if filters.statuses:
        qs = qs.filter(status__in=filters.statuses)
    if filters.error is not None:
        qs = qs.filter(ERROR_Q if filters.error else ~ERROR_Q)
    if filters.batch_surfaces:
        from batches.models import Batch

        batches = Batch.objects.filter(surface__in=filters.batch_surfaces).annotate(sid=UUIDText("id"))
        qs = qs.filter(batch_id__in=batches.values("sid"))
    return qs


def batch_surfaces(batch_ids) -> dict[str, str]:
    """batch_id → the surface its batch came from, for a page of events (one query; a deleted batch is absent)."""
    import uuid

    from batches.models import Batch

    pks = []
    for value in set(batch_ids):
        try:
            pks.append(uuid.UUID(value))
        except (ValueError, TypeError):
            continue
    if not pks:
        return {}
    return {str(pk): surface for pk, surface in Batch.objects.filter(pk__in=pks).values_list("id", "surface")}


def event_page(
    viewer: Viewer, filters: EventFilters, *, limit: int, after: tuple[datetime, str] | None = None
) -> list[UsageEvent]:
    """Up to `limit` events, newest first, strictly after the keyset position `after` = (ts, request_id).

    request_id breaks ties on ts, so a page boundary inside a run of equal
    timestamps neither repeats nor skips an event.
    """
    qs = filtered_events(viewer, filters)
    if after is not None:
        ts, request_id = after
        qs = qs.filter(Q(ts__lt=ts) | Q(ts=ts, request_id__lt=request_id))
    return list(qs.order_by("-ts", "-request_id")[:limit])


def usage_summary(viewer: Viewer, filters: EventFilters, group_by: str) -> list[dict]:
    """One row per value of `group_by`, most requests first.

    Cost is summed over priced events only; `unpriced` counts the events that
    used tokens but have no cost, so a partial sum is never mistaken for a total.
    """
    if group_by not in DIMENSIONS:
        raise ValueError(f"cannot group usage by {group_by!r}")
    used_tokens = Q()
    for column in _TOKEN_COLUMNS.values():
        used_tokens |= Q(**{f"{column}__gt": 0})
    token_sums = {f"sum_{meter}": Sum(column) for meter, column in _TOKEN_COLUMNS.items()}
    rows = (
        filtered_events(viewer, filters)
        .values(group_by)
        .annotate(
            requests=Count("pk"),
            errors=Count("pk", filter=ERROR_Q),
            cost=Sum("cost_nano_usd"),
            unpriced=Count("pk", filter=Q(cost_nano_usd__isnull=True) & used_tokens),
            **token_sums,
        )
        .order_by("-requests", group_by)
    )
    return [_summary_row(group_by, row) for row in rows]


def _summary_row(group_by: str, row: dict) -> dict:
    # PostgreSQL's SUM(bigint) is numeric (a Decimal here); the API speaks integers.
    tokens = {meter: int(row[f"sum_{meter}"] or 0) for meter in _TOKEN_COLUMNS}
    tokens["total"] = sum(tokens.values())
    return {
        "group": {group_by: row[group_by]},
        "requests": row["requests"],
        "errors": row["errors"],
        "tokens": tokens,
        "cost_nano_usd": int(row["cost"] or 0),
        "unpriced": row["unpriced"],
    }


# --- spend budgets ----------------------------------------------------------------------------------


def visible_budgets(principal: Principal | None) -> list:
    """The budgets a caller may see, by name: every one for the operator (`principal` None), else those
    governing the caller (its project's, team's, service account's and policy's), enabled or not."""
    from usage.models import Budget

    qs = Budget.objects.select_related("project", "team", "service_account__project", "policy").order_by("name")
    if principal is None:
        return list(qs)
    scope = Q(pk__in=[])
    if principal.project_id is not None:
        scope |= Q(project_id=principal.project_id)
    if principal.team_id is not None:
        scope |= Q(team_id=principal.team_id)
    if principal.policy_id is not None:
        scope |= Q(policy_id=principal.policy_id)
    if principal.principal_kind == "serviceaccount":
        scope |= Q(service_account_id=principal.principal_id)
    return list(qs.filter(scope))
