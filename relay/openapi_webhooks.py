"""The webhook routes of the OpenAPI schema (batches/webhooks; docs/webhooks.md): their operations and
components, merged into relay/openapi.py's. The objects are OpenAI's (openai/types/webhooks/), plus the
relay's delivery object."""

from relay.openapi_schemas import BOOL, INT, OBJ, STR, TS, nullable, openai_list, ref

EVENT_TYPES = ["batch.completed", "batch.failed", "batch.expired", "batch.cancelled", "message_batch.ended"]

_ENDPOINT_PROPS = {
    "id": {"type": "string", "pattern": "^we_[0-9a-f]{32}$"},
    "object": {"const": "webhook_endpoint"},
    "name": STR,
    "url": STR,
    "event_types": {"type": "array", "items": {"enum": EVENT_TYPES}},
    "signing_secret_hint": nullable(STR),
    "created_at": TS,
    "updated_at": nullable(TS),
    "paused_at": {**nullable(TS), "description": "set while deliveries are paused (automatically or by an operator)"},
    "paused_reason": {**nullable(STR), "description": "why deliveries are paused; POST …/resume clears it"},
}
_ENDPOINT_REQUIRED = ["id", "object", "name", "url", "event_types", "created_at"]

SCHEMAS = {
    "WebhookEndpointCreate": {
        "type": "object",
        "required": ["url", "name", "event_types"],
        "properties": {
            "url": {**STR, "description": "https (plain http only for RELAY_WEBHOOK_ALLOWED_HOSTS)"},
            "name": STR,
            "event_types": {"type": "array", "minItems": 1, "items": {"enum": EVENT_TYPES}},
        },
        "additionalProperties": False,
    },
    "WebhookEndpointUpdate": {
        "type": "object",
        "properties": {
            "url": STR,
            "name": STR,
            "event_types": {"type": "array", "minItems": 1, "items": {"enum": EVENT_TYPES}},
        },
        "additionalProperties": False,
    },
    "WebhookEndpoint": {"type": "object", "required": _ENDPOINT_REQUIRED, "properties": _ENDPOINT_PROPS},
    "WebhookEndpointWithSecret": {
        "type": "object",
        "required": [*_ENDPOINT_REQUIRED, "signing_secret"],
        "properties": {
            **_ENDPOINT_PROPS,
            "signing_secret": {"type": "string", "pattern": "^whsec_", "description": "shown only here"},
        },
    },
    "WebhookEndpointList": openai_list("WebhookEndpoint"),
    "WebhookEndpointDeleted": {
        "type": "object",
        "required": ["id", "object", "deleted"],
        "properties": {"id": STR, "object": {"const": "webhook_endpoint.deleted"}, "deleted": BOOL},
    },
    "WebhookRotateSecret": {
        "type": "object",
        "properties": {"keep_old_secret_active_for_24_hours": BOOL},
        "additionalProperties": False,
    },
    "WebhookTest": {
        "type": "object",
        "required": ["event_type"],
        "properties": {"event_type": {"enum": EVENT_TYPES}},
        "additionalProperties": False,
    },
    "WebhookEvent": {
        "type": "object",
        "description": "What a delivery POSTs (signed per Standard Webhooks).",
        "required": ["id", "object", "type", "created_at", "data"],
        "properties": {
            "id": {"type": "string", "pattern": "^evt_"},
            "object": {"const": "event"},
            "type": {"enum": EVENT_TYPES},
            "created_at": TS,
            "data": OBJ,
        },
    },
    "WebhookDeliveryAttempt": {
        "type": "object",
        "required": ["number", "started_at", "duration_ms", "status_code"],
        "properties": {
            "number": INT,
            "started_at": TS,
            "duration_ms": INT,
            "status_code": nullable(INT),
            "error": nullable(STR),
            "response_head": {**STR, "description": "the answer's first KiB"},
        },
    },
    "WebhookDelivery": {
        "type": "object",
        "required": ["id", "object", "webhook_id", "webhook_endpoint_id", "event", "status", "attempts"],
        "properties": {
            "id": {"type": "string", "pattern": "^wh_[0-9a-f]{32}$"},
            "object": {"const": "webhook_endpoint.delivery"},
            "webhook_id": {**STR, "description": "the webhook-id header, the same on every retry and resend"},
            "webhook_endpoint_id": STR,
            "event": ref("WebhookEvent"),
            "test": BOOL,
            "status": {"enum": ["pending", "delivered", "failed"]},
            "attempts": INT,
            "created_at": TS,
            "last_attempt_at": nullable(TS),
            "next_attempt_at": nullable(TS),
            "delivered_at": nullable(TS),
            "last_status_code": nullable(INT),
            "last_error": nullable(STR),
            "latest_attempts": {"type": "array", "items": ref("WebhookDeliveryAttempt")},
        },
    },
    "WebhookDeliveryList": openai_list("WebhookDelivery"),
    "WebhookEventTypeList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": STR}},
    },
}


def operations(resp, json_body, errors) -> dict:
    """(path, method) → operation, built with relay/openapi.py's helpers (`_resp`, `_json`, its OpenAI errors)."""
    page = [
        {"name": "after", "in": "query", "required": False, "schema": STR},
        {
            "name": "limit",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 1, "maximum": 100},
        },
    ]
    tags = ["webhooks"]
    one = "/v1/webhook_endpoints/{endpoint_id}"
    return {
        ("/v1/webhook_endpoints", "post"): {
            "summary": "Register a webhook endpoint (its signing secret is shown this once)",
            "tags": tags,
            "requestBody": {"required": True, "content": json_body("WebhookEndpointCreate")},
            "responses": {"200": resp("the endpoint, with its secret", "WebhookEndpointWithSecret"), **errors},
        },
        ("/v1/webhook_endpoints", "get"): {
            "summary": "The caller's webhook endpoints, newest first",
            "tags": tags,
            "parameters": page,
            "responses": {"200": resp("a page of endpoints", "WebhookEndpointList"), **errors},
        },
        (one, "get"): {
            "summary": "A webhook endpoint",
            "tags": tags,
            "responses": {"200": resp("the endpoint", "WebhookEndpoint"), **errors},
        },
        (one, "post"): {
            "summary": "Update a webhook endpoint's url, name or event types",
            "tags": tags,
            "requestBody": {"required": True, "content": json_body("WebhookEndpointUpdate")},
            "responses": {"200": resp("the endpoint", "WebhookEndpoint"), **errors},
        },
        (one, "delete"): {
            "summary": "Delete a webhook endpoint and its deliveries",
            "tags": tags,
            "responses": {"200": resp("deleted", "WebhookEndpointDeleted"), **errors},
        },
        (one + "/rotate_secret", "post"): {
            "summary": "A new signing secret (the old one may keep signing for 24 h)",
            "tags": tags,
            "requestBody": {"required": False, "content": json_body("WebhookRotateSecret")},
            "responses": {"200": resp("the endpoint, with its new secret", "WebhookEndpointWithSecret"), **errors},
        },
        (one + "/test", "post"): {
            "summary": "Queue a real signed sample event (sent once, at once, by the webhook lane)",
            "tags": tags,
            "requestBody": {"required": True, "content": json_body("WebhookTest")},
            "responses": {
                "202": resp("the test delivery, queued: poll it for the receiver's answer", "WebhookDelivery"),
                **errors,
            },
        },
        (one + "/resume", "post"): {
            "summary": "Resume a paused endpoint: what waited is sent now",
            "tags": tags,
            "responses": {
                "200": resp("the endpoint", "WebhookEndpoint"),
                "409": resp("paused by the relay's operator: only the operator can resume it", "OpenAIError"),
                **errors,
            },
        },
        (one + "/deliveries/{delivery_id}", "get"): {
            "summary": "One delivery, with its latest attempts",
            "tags": tags,
            "responses": {"200": resp("the delivery", "WebhookDelivery"), **errors},
        },
        (one + "/deliveries", "get"): {
            "summary": "The endpoint's deliveries, newest first, with their attempts",
            "tags": tags,
            "parameters": page,
            "responses": {"200": resp("a page of deliveries", "WebhookDeliveryList"), **errors},
        },
        (one + "/deliveries/{delivery_id}/resend", "post"): {
            "summary": "Send a delivery again (same webhook-id, a fresh retry schedule)",
            "tags": tags,
            "responses": {"200": resp("the delivery, pending", "WebhookDelivery"), **errors},
        },
        ("/v1/webhook_event_types", "get"): {
            "summary": "Every event type the relay emits",
            "tags": tags,
            "responses": {"200": resp("the types", "WebhookEventTypeList"), **errors},
        },
    }
