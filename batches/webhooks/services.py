"""Writes: an owner's webhook endpoints (create — at most RELAY_WEBHOOK_MAX_ENDPOINTS each —, update, delete,
rotate the secret, queue a test), a delivery's resend, and pause and resume (the operator's, and resume by the
owner). The API's views and the admin call these. Nothing here POSTs: deliveries are the webhook lane's."""

import json
import logging
from datetime import timedelta

import uuid6
from django.conf import settings
from django.db import connection, transaction
from django.db.models import DateTimeField, F, Q, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from batches.errors import invalid, missing
from batches.webhooks import events, guard, outbox, signing
from batches.webhooks.models import Delivery, DeliveryOutcome, Event, WebhookEndpoint
from core import crypto
from core.auth import Principal
from core.errors import RelayError, quoted

log = logging.getLogger(__name__)

FIELDS = ("url", "name", "event_types")
NAME_MAX = 200
# keep_old_secret_active_for_24_hours: how long the rotated-out secret still signs.
OVERLAP = timedelta(hours=24)


# --- validation -----------------------------------------------------------------------------------


def _unknown(body: dict, allowed) -> None:
    for key in body:
        if key not in allowed:
            raise invalid(f"Unrecognized request argument supplied: {quoted(key)}.", param=str(key)[:64])


def _name(value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise invalid("Invalid 'name': expected a non-empty string.", param="name")
    if len(value) > NAME_MAX:
        raise invalid(f"Invalid 'name': at most {NAME_MAX} characters.", param="name")
    return value.strip()


def _url(value) -> str:
    if not isinstance(value, str):
        raise invalid("Invalid 'url': expected a string.", param="url")
    try:
        guard.check(value)
    except (guard.Blocked, guard.Unresolvable) as exc:
        raise invalid(f"Invalid 'url': {quoted(value, 200)} {exc.message}.", param="url") from exc
    return value


def event_type(value, param: str = "event_type") -> str:
    if not isinstance(value, str) or value not in events.EVENT_TYPES:
        raise invalid(
            f"Invalid '{param}': {quoted(value) if isinstance(value, str) else 'expected a string'} is not an event "
            f"type this relay emits ({', '.join(events.EVENT_TYPES)}).",
            param=param,
        )
    return value


def _event_types(value) -> list[str]:
    if not isinstance(value, list) or not value:
        raise invalid("Invalid 'event_types': expected a non-empty array of event types.", param="event_types")
    out: list[str] = []
    for i, item in enumerate(value):
        kind = event_type(item, f"event_types[{i}]")
        if kind not in out:
            out.append(kind)
    return out


# --- endpoints ------------------------------------------------------------------------------------


def create_endpoint(principal: Principal, body: dict) -> tuple[WebhookEndpoint, str]:
    """A new endpoint of the caller's and its signing secret (shown this once)."""
    _unknown(body, FIELDS)
    for field in FIELDS:
        if field not in body:
            raise missing(field)
    name, event_types, url = _name(body["name"]), _event_types(body["event_types"]), _url(body["url"])
    secret = signing.new_secret()
    attribution = principal.attribution()
    now = timezone.now()
    with transaction.atomic():
        _within_endpoint_cap(principal.owner_hash)
        endpoint = _insert_endpoint(principal, attribution, name, url, event_types, secret, now)
    log.info("webhook endpoint %s created for %s", endpoint.public_id, event_types)
    return endpoint, secret


def _within_endpoint_cap(owner_hash: str) -> None:
    """Inside the create's transaction: refuse an owner's endpoint beyond RELAY_WEBHOOK_MAX_ENDPOINTS. Creates of
    one owner take turns (a transaction-scoped advisory lock on the owner), so two at once cannot both pass."""
    cap = settings.RELAY_WEBHOOK_MAX_ENDPOINTS
    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", ["webhook_endpoints:" + owner_hash])
    if WebhookEndpoint.objects.filter(owner_hash=owner_hash).count() >= cap:
        raise invalid(
            f"Too many webhook endpoints: at most {cap} per owner (RELAY_WEBHOOK_MAX_ENDPOINTS). "
            "Delete one, or send several event types to one endpoint.",
            code="webhook_endpoint_limit_reached",
        )


def _insert_endpoint(principal, attribution, name, url, event_types, secret, now) -> WebhookEndpoint:
    return WebhookEndpoint.objects.create(
        id=uuid6.uuid7(),
        owner_hash=principal.owner_hash,
        project_id=attribution.get("project_id"),
        team_id=attribution.get("team_id"),
        name=name,
        url=url,
        event_types=event_types,
        secret_sealed=crypto.encrypt(secret),
        secret_hint=signing.hint(secret),
        created_at=now,
        updated_at=now,
    )


def update_endpoint(endpoint: WebhookEndpoint, body: dict) -> WebhookEndpoint:
    """Change the url, name and/or event types; updated_at moves only when something changed."""
    _unknown(body, FIELDS)
    changes = {}
    if "name" in body:
        changes["name"] = _name(body["name"])
    if "event_types" in body:
        changes["event_types"] = _event_types(body["event_types"])
    if "url" in body:
        changes["url"] = _url(body["url"])
    changes = {k: v for k, v in changes.items() if getattr(endpoint, k) != v}
    if changes:
        changes["updated_at"] = timezone.now()
        WebhookEndpoint.objects.filter(pk=endpoint.pk).update(**changes)
        for key, value in changes.items():
            setattr(endpoint, key, value)
    return endpoint


def delete_endpoint(endpoint: WebhookEndpoint) -> None:
    """The endpoint and its deliveries (an event no endpoint holds any more is removed with it)."""
    with transaction.atomic():
        event_ids = list(Delivery.objects.filter(endpoint=endpoint).values_list("event_id", flat=True))
        endpoint.delete()
        Event.objects.filter(pk__in=event_ids, deliveries__isnull=True).delete()


def rotate_secret(endpoint: WebhookEndpoint, body: dict) -> tuple[WebhookEndpoint, str]:
    """A new signing secret; with keep_old_secret_active_for_24_hours, deliveries carry both signatures for 24 h."""
    _unknown(body, ("keep_old_secret_active_for_24_hours",))
    keep = body.get("keep_old_secret_active_for_24_hours", False)
    if not isinstance(keep, bool):
        raise invalid(
            "Invalid 'keep_old_secret_active_for_24_hours': expected a boolean.",
            param="keep_old_secret_active_for_24_hours",
        )
    secret, now = signing.new_secret(), timezone.now()
    changes = {
        "secret_sealed": crypto.encrypt(secret),
        "secret_hint": signing.hint(secret),
        "previous_secret_sealed": endpoint.secret_sealed if keep else "",
        "previous_secret_expires_at": now + OVERLAP if keep else None,
        "updated_at": now,
    }
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(**changes)
    for key, value in changes.items():
        setattr(endpoint, key, value)
    log.info("webhook endpoint %s: secret rotated (old one kept: %s)", endpoint.public_id, keep)
    return endpoint, secret


def send_test(endpoint: WebhookEndpoint, body: dict) -> Delivery:
    """A real signed delivery of a sample event of `event_type`, queued on the webhook lane (under the owner's
    caps, as any delivery) and sent once, never retried; recorded among the endpoint's deliveries. Returns the
    pending delivery at once: the caller polls it for the receiver's answer."""
    _unknown(body, ("event_type",))
    if "event_type" not in body:
        raise missing("event_type")
    kind = event_type(body["event_type"])
    now = timezone.now()
    event_id = uuid6.uuid7()
    with transaction.atomic():
        event = Event.objects.create(
            id=event_id,
            type=kind,
            owner_hash=endpoint.owner_hash,
            created_at=now,
            body=events.body(event_id, kind, now, events.sample_data(kind)),
            test=True,
        )
        delivery = Delivery.objects.create(
            id=uuid6.uuid7(), event=event, endpoint=endpoint, next_attempt_at=now, schedule_from=now, created_at=now
        )
        transaction.on_commit(outbox.wake)
    log.info("webhook endpoint %s: test %s queued as %s", endpoint.public_id, kind, delivery.webhook_id)
    return delivery


def sample(event_type_: str) -> dict:
    """A sample event of a type, as its deliveries show it (for docs and the admin)."""
    now = timezone.now()
    return json.loads(events.body(uuid6.uuid7(), event_type_, now, events.sample_data(event_type_)))


# --- deliveries -----------------------------------------------------------------------------------


def resend(delivery: Delivery) -> Delivery:
    """Send a delivery again, whatever became of it: same webhook-id and body, a fresh retry schedule."""
    now = timezone.now()
    with transaction.atomic():
        Delivery.objects.filter(pk=delivery.pk).update(
            outcome=DeliveryOutcome.PENDING, delivered_at=None, next_attempt_at=now, schedule_from=now
        )
        transaction.on_commit(outbox.wake)
    delivery.refresh_from_db()
    log.info("webhook %s re-sent", delivery.webhook_id)
    return delivery


def pause(endpoint: WebhookEndpoint, reason: str = "Paused by an operator.") -> None:
    """An operator stops deliveries to an endpoint; what waits is kept for its resume, which only an operator
    may do (`resume(by_owner=True)` refuses). An endpoint the relay paused for failing becomes the operator's."""
    WebhookEndpoint.objects.filter(pk=endpoint.pk).filter(
        Q(paused_at__isnull=True) | Q(paused_by_operator=False)
    ).update(
        paused_at=Coalesce(F("paused_at"), Value(timezone.now(), output_field=DateTimeField())),
        paused_reason=reason[:300],
        paused_by_operator=True,
    )


def resume(endpoint: WebhookEndpoint, *, by_owner: bool = False) -> int:
    """Deliveries to a paused endpoint start again (the owner's or an operator's): its reason and failure count
    are cleared, and everything it kept is due now, on a fresh schedule. Its owner may resume what the relay
    paused, never what an operator paused (409)."""
    now = timezone.now()
    with transaction.atomic():
        fresh = WebhookEndpoint.objects.select_for_update().get(pk=endpoint.pk)
        if by_owner and fresh.paused_by_operator:
            raise RelayError(
                409,
                "endpoint_paused_by_operator",
                "this webhook endpoint was paused by the relay's operator: only they can resume it",
            )
        WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
            paused_at=None,
            paused_reason="",
            paused_by_operator=False,
            failing_since=None,
            last_failure_at=None,
            consecutive_failures=0,
        )
        pending = Delivery.objects.filter(endpoint=endpoint, outcome=DeliveryOutcome.PENDING)
        waiting = pending.update(next_attempt_at=now, schedule_from=now)
        transaction.on_commit(outbox.wake)
    for key, value in {
        "paused_at": None,
        "paused_reason": "",
        "failing_since": None,
        "consecutive_failures": 0,
    }.items():
        setattr(endpoint, key, value)
    log.info("webhook endpoint %s resumed: %d deliveries waiting", endpoint.public_id, waiting)
    return waiting
