"""Reads: an owner's endpoints and their deliveries (another owner's are not found, as with batches), and
the delivery figures /metrics shows."""

import re
import uuid

from django.db.models import Count, Min, Prefetch
from django.utils import timezone

from batches.errors import invalid, not_found
from batches.surfaces import common
from batches.webhooks.models import Delivery, DeliveryAttempt, DeliveryOutcome, WebhookEndpoint
from core.auth import Principal
from core.errors import clipped, quoted

_PUBLIC_ID = re.compile(r"(we_|wh_)([0-9a-f]{32})")
# Attempts a delivery object shows (the latest first); the admin shows them all.
SHOWN_ATTEMPTS = 5


def parse_public_id(value: str, prefix: str) -> uuid.UUID | None:
    """we_<hex> / wh_<hex> → the row's UUID; None for anything else."""
    match = _PUBLIC_ID.fullmatch(value or "")
    if match is None or match.group(1) != prefix:
        return None
    return uuid.UUID(hex=match.group(2))


def owned(principal: Principal):
    return WebhookEndpoint.objects.filter(owner_hash=principal.owner_hash)


def endpoint_for_owner(public_id: str, principal: Principal) -> WebhookEndpoint:
    pk = parse_public_id(public_id, "we_")
    endpoint = owned(principal).filter(pk=pk).first() if pk is not None else None
    if endpoint is None:
        raise not_found(f"No webhook endpoint found with id '{clipped(public_id)}'.")
    return endpoint


def _page_params(after: str | None, limit: str | None, prefix: str):
    n = common.parse_limit(
        limit,
        default=20,
        maximum=100,
        refuse=lambda problem, code: invalid(f"Invalid 'limit': {problem}.", param="limit", code=code),
    )
    cursor = None
    if after:
        cursor = parse_public_id(after, prefix)
        if cursor is None:
            raise invalid(f"Invalid 'after': {quoted(after)} is not a {prefix}… id.", param="after")
    return cursor, n


def endpoints_page(principal: Principal, after: str | None, limit: str | None) -> tuple[list[WebhookEndpoint], bool]:
    """The owner's endpoints, newest first (UUIDv7 ids: id order is creation order), after the cursor."""
    cursor, n = _page_params(after, limit, "we_")
    qs = owned(principal).order_by("-id")
    if cursor is not None:
        qs = qs.filter(id__lt=cursor)
    rows = list(qs[: n + 1])
    return rows[:n], len(rows) > n


def _with_attempts(qs):
    latest = DeliveryAttempt.objects.order_by("-number")
    return qs.select_related("event").prefetch_related(Prefetch("attempt_log", queryset=latest))


def deliveries_page(endpoint: WebhookEndpoint, after: str | None, limit: str | None) -> tuple[list[Delivery], bool]:
    """An endpoint's deliveries, newest first, each with its event and latest attempts."""
    cursor, n = _page_params(after, limit, "wh_")
    qs = Delivery.objects.filter(endpoint=endpoint).order_by("-id")
    if cursor is not None:
        qs = qs.filter(id__lt=cursor)
    rows = list(_with_attempts(qs)[: n + 1])
    return rows[:n], len(rows) > n


def delivery_for_endpoint(endpoint: WebhookEndpoint, public_id: str) -> Delivery:
    pk = parse_public_id(public_id, "wh_")
    delivery = _with_attempts(Delivery.objects.filter(endpoint=endpoint, pk=pk)).first() if pk is not None else None
    if delivery is None:
        raise not_found(f"No delivery found with id '{clipped(public_id)}' for this webhook endpoint.")
    return delivery


def shown_attempts(delivery: Delivery) -> list[DeliveryAttempt]:
    return list(delivery.attempt_log.all())[:SHOWN_ATTEMPTS]


# --- /metrics ------------------------------------------------------------------------------------


def delivery_counts() -> dict[str, int]:
    """Deliveries by outcome (pending, delivered, failed), tests included."""
    counts = dict(Delivery.objects.values_list("outcome").annotate(n=Count("pk")).order_by())
    return {outcome: counts.get(outcome, 0) for outcome in DeliveryOutcome.values}


def oldest_undelivered_age(now=None) -> float:
    """Seconds since the oldest event still waiting for a delivery was raised; 0 when none waits."""
    oldest = Delivery.objects.filter(outcome=DeliveryOutcome.PENDING).aggregate(at=Min("created_at"))["at"]
    if oldest is None:
        return 0.0
    return max(0.0, ((now or timezone.now()) - oldest).total_seconds())


def paused_endpoints() -> int:
    return WebhookEndpoint.objects.filter(paused_at__isnull=False).count()
