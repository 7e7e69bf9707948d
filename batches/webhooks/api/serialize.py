"""The API's objects, as the `openai` SDK's types in openai/types/webhooks/ read them (WebhookEndpoint,
WebhookEndpointWithSecret, WebhookEndpointList, …), plus the relay's delivery object."""

import json

from batches.webhooks import selectors
from batches.webhooks.models import Delivery, DeliveryAttempt, WebhookEndpoint


def _ts(value) -> int | None:
    return int(value.timestamp()) if value is not None else None


def endpoint(row: WebhookEndpoint, secret: str | None = None) -> dict:
    obj = {
        "id": row.public_id,
        "object": "webhook_endpoint",
        "name": row.name,
        "url": row.url,
        "event_types": list(row.event_types),
        "signing_secret_hint": row.secret_hint,
        "created_at": _ts(row.created_at),
        "updated_at": _ts(row.updated_at),
        # The relay's own: paused automatically after failing every attempt for long enough (paused_reason says
        # since when, how many and the last error), or by an operator; POST …/resume clears both.
        "paused_at": _ts(row.paused_at),
        "paused_reason": row.paused_reason or None if row.paused_at is not None else None,
    }
    if secret is not None:  # WebhookEndpointWithSecret: only when created or rotated
        obj["signing_secret"] = secret
    return obj


def page(rows: list, serialize, has_more: bool) -> dict:
    data = [serialize(row) for row in rows]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def attempt(row: DeliveryAttempt) -> dict:
    return {
        "number": row.number,
        "started_at": _ts(row.started_at),
        "duration_ms": row.duration_ms,
        "status_code": row.status_code,
        "error": row.error or None,
        "response_head": row.response_head,
    }


def delivery(row: Delivery) -> dict:
    """A delivery: its webhook-id (also its id), its event as sent, its outcome and its latest attempts."""
    return {
        "id": row.webhook_id,
        "object": "webhook_endpoint.delivery",
        "webhook_id": row.webhook_id,
        "webhook_endpoint_id": f"we_{row.endpoint_id.hex}",
        "event": json.loads(row.event.body),
        "test": row.event.test,
        "status": row.outcome,
        "attempts": row.attempts,
        "created_at": _ts(row.created_at),
        "last_attempt_at": _ts(row.last_attempt_at),
        "next_attempt_at": _ts(row.next_attempt_at) if row.outcome == "pending" else None,
        "delivered_at": _ts(row.delivered_at),
        "last_status_code": row.last_status_code,
        "last_error": row.last_error or None,
        "latest_attempts": [attempt(a) for a in selectors.shown_attempts(row)],
    }
