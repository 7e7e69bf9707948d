"""Usage API (control plane): `GET /api/usage/events`, `GET /api/usage/summary` and `GET /api/usage/budgets`.

Views validate the query, call one selector and serialize. Every malformed
value is a 400 in the product's envelope rather than being ignored, so a bad
filter never silently widens or empties the answer.

Choices where the product is silent or differs: `since` defaults to 24h;
the window [from, to] includes both ends; every slug filter, like `status`,
may be repeated (any value matches); summaries count relay-side rejections
(status 0 with an error_kind) as requests and errors, and rows with equal
request counts are ordered by their group value.

Who sees what: the operator (`Authorization: Bearer <RELAY_ADMIN_TOKEN>`, or a
staff user's admin session) sees every event; any other caller authenticates
like an inference caller and sees only its own principal's events.
"""

import base64
import re
from datetime import UTC, datetime, timedelta

from django.utils import timezone
from rest_framework.response import Response
from rest_framework.views import APIView

from core.authentication import (
    OPERATOR,
    AdminTokenAuthentication,
    RelayCredentialAuthentication,
    StaffSessionAuthentication,
)
from core.durations import parse_duration
from core.errors import bad_request, quoted
from relay.reports import selectors
from relay.reports.selectors import DIMENSIONS, EventFilters, Viewer
from usage import budgets
from usage.models import UsageEvent

DEFAULT_LIMIT = 100
MAX_LIMIT = 10_000
DEFAULT_SINCE = "24h"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class UsageView(APIView):
    # The operator (admin token or a staff session) first; anyone else must present
    # a relay key or token, and a missing one is the product's 401.
    authentication_classes = [AdminTokenAuthentication, StaffSessionAuthentication, RelayCredentialAuthentication]


class EventListView(UsageView):
    """Events, newest first, in keyset pages: `cursor` continues where the last full page stopped."""

    def get(self, request):
        viewer = resolve_viewer(request)
        params = request.query_params
        filters = parse_filters(params)
        limit = _limit(params.get("limit"))
        after = decode_cursor(params["cursor"]) if "cursor" in params else None
        events = selectors.event_page(viewer, filters, limit=limit, after=after)
        surfaces = selectors.batch_surfaces(e.batch_id for e in events if e.batch_id)
        body = {"events": [event_json(e, surfaces) for e in events]}
        if len(events) == limit:
            body["next_cursor"] = encode_cursor(events[-1])
        return Response(body)


class SummaryView(UsageView):
    """Totals per `group_by` value over the same filters as the event list."""

    def get(self, request):
        viewer = resolve_viewer(request)
        params = request.query_params
        filters = parse_filters(params)
        group_by = params.get("group_by", "source")
        if group_by not in DIMENSIONS:
            raise bad_request(f"group_by must be one of {', '.join(DIMENSIONS)}")
        rows = selectors.usage_summary(viewer, filters, group_by)
        return Response({"rows": rows, "from": _iso(filters.start), "to": _iso(filters.end)})


class BudgetListView(UsageView):
    """Each spend budget the caller may see, with its current period's account (docs/budgets.md)."""

    def get(self, request):
        principal = None if request.user is OPERATOR else request.user
        rows = budgets.standings(selectors.visible_budgets(principal))
        return Response({"budgets": [budget_json(s) for s in rows]})


# --- who is asking ------------------------------------------------------------


def resolve_viewer(request) -> Viewer:
    return Viewer(operator=True) if request.user is OPERATOR else Viewer.of(request.user)


# --- query parameters ----------------------------------------------------------


def parse_filters(params) -> EventFilters:
    start, end = _window(params)
    slugs = {dim: tuple(params.getlist(dim)) for dim in DIMENSIONS if dim in params}
    statuses = tuple(_status(value) for value in params.getlist("status"))
    return EventFilters(
        start=start,
        end=end,
        slugs=slugs,
        statuses=statuses,
        error=_error(params.get("error")),
        batch_surfaces=tuple(_batch_surface(value) for value in params.getlist("batch_surface")),
    )


def _window(params) -> tuple[datetime, datetime]:
    """[from, to], both inclusive. `from`/`to` win over `since`, which counts back from `to` (default now)."""
    since = _duration(params.get("since", DEFAULT_SINCE))
    end = _timestamp(params["to"], "to") if "to" in params else timezone.now()
    if "from" in params:
        start = _timestamp(params["from"], "from")
    else:
        try:
            start = end - since
        except OverflowError as exc:
            raise bad_request("since reaches before the year 1") from exc
    if start > end:
        raise bad_request("from must not be after to")
    return start, end


def _duration(value: str) -> timedelta:
    try:
        duration = parse_duration(value)
    except OverflowError as exc:
        raise bad_request(f"since is too large: {quoted(value)}") from exc
    if duration is None:
        raise bad_request(f"since must be a positive duration like 30m, 1h or 7d, got {quoted(value)}")
    return duration


def _timestamp(value: str, name: str) -> datetime:
    # An unencoded "+01:00" in a query string arrives as " 01:00"; take it back.
    value = re.sub(r" ([0-9]{2}:[0-9]{2})$", r"+\1", value)
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        parsed = None
    if parsed is None or parsed.tzinfo is None:
        raise bad_request(f"{name} must be an RFC 3339 timestamp with a UTC offset, like 2025-01-31T12:00:00Z")
    return parsed


def _status(value: str) -> int:
    if not re.fullmatch(r"[0-9]{1,3}", value):
        raise bad_request(f"status must be an HTTP status code (0 for a relay-side rejection), got {quoted(value)}")
    return int(value)


def _batch_surface(value: str) -> str:
    from batches.models import Surface

    if value not in Surface.values:
        raise bad_request(f"batch_surface must be one of {', '.join(Surface.values)}, got {quoted(value)}")
    return value


def _error(value: str | None) -> bool | None:
    if value is None:
        return None
    if value not in ("true", "false"):
        raise bad_request(f"error must be true or false, got {quoted(value)}")
    return value == "true"


def _limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    if not re.fullmatch(r"[0-9]+", value) or not 1 <= int(value) <= MAX_LIMIT:
        raise bad_request(f"limit must be an integer from 1 to {MAX_LIMIT}")
    return int(value)


# --- cursor --------------------------------------------------------------------
# base64url of "<ts in unix nanoseconds>:<request_id>", the product's format.
# Timestamps are stored to the microsecond, so the nanoseconds are exact.


def encode_cursor(event: UsageEvent) -> str:
    nanos = (event.ts - _EPOCH) // timedelta(microseconds=1) * 1000
    return base64.urlsafe_b64encode(f"{nanos}:{event.request_id}".encode()).decode().rstrip("=")


def decode_cursor(value: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).decode()
        nanos, request_id = raw.split(":", 1)
        # A request id is printable ASCII (a UUID, `<uuid>:<round>`): a NUL would reach PostgreSQL (a 500).
        if not re.fullmatch(r"-?[0-9]+", nanos) or not re.fullmatch(r"[\x21-\x7e]{1,200}", request_id):
            raise ValueError(raw)
        ts = _EPOCH + timedelta(microseconds=int(nanos) // 1000)
    except (ValueError, OverflowError) as exc:
        raise bad_request("cursor is not valid: pass back a next_cursor unchanged") from exc
    return ts, request_id


# --- output --------------------------------------------------------------------


def _iso(ts: datetime) -> str:
    return ts.astimezone(UTC).isoformat().replace("+00:00", "Z")


def event_json(e: UsageEvent, surfaces: dict | None = None) -> dict:
    return {
        "request_id": e.request_id,
        "source": e.source,
        "ts": _iso(e.ts),
        "status": e.status,
        "duration_ms": e.duration_ms,
        "attempts": e.attempts,
        "error_kind": e.error_kind,
        "error_message": e.error_message,
        "credential_kind": e.credential_kind,
        "credential_id": e.credential_id,
        "principal_kind": e.principal_kind,
        "principal_id": e.principal_id,
        "project_id": e.project_id,
        "team_id": e.team_id,
        "policy_id": e.policy_id,
        "host_key_id": e.host_key_id,
        "project": e.project,
        "team": e.team,
        "policy": e.policy,
        "model": e.model,
        "provider": e.provider,
        "host": e.host,
        "batch_id": e.batch_id,
        # The surface the event's batch came from (native, openai, anthropic); null for live requests
        # and for batches deleted since.
        "batch_surface": (surfaces or {}).get(e.batch_id),
        "tokens": {
            "input": e.input_tokens,
            "output": e.output_tokens,
            "cache_read": e.cache_read_tokens,
            "cache_write": e.cache_write_tokens,
            "total": e.total_tokens,
        },
        "cost_nano_usd": e.cost_nano_usd,
        # What the caller is billed where it differs from the cost (a batch discount); null: the cost.
        "billed_cost_nano_usd": e.billed_cost_nano_usd,
        # Where it ran: "relay", or "provider" (a batch record sent to the provider's batch API).
        "executed_by": e.executed_by,
        # true: the tokens (and so the cost) are the relay's estimate, not the provider's count (a stream that
        # ended before the provider's usage arrived: docs/api/usage.md).
        "usage_estimated": e.usage_estimated,
    }


def budget_json(s: "budgets.Standing") -> dict:
    b = s.budget
    kind, _ = b.scope
    return {
        "name": b.name,
        "scope": {"kind": kind, "name": budgets.scope_name(b)},
        "period": b.period,
        "enabled": b.enabled,
        # Money as exact decimal strings of USD (nano-USD precision, at least two decimals).
        "usd": budgets.usd_text(b.usd_nanos),
        "spent_usd": budgets.usd_text(s.spent_nanos),
        "reserved_usd": budgets.usd_text(s.reserved_nanos),
        "left_usd": budgets.usd_text(s.left_nanos),
        "period_start": _iso(s.period_start),
        "period_ends_at": _iso(s.period_ends_at),
    }
