"""The OpenAPI 3.1 schema of every API endpoint: `/api/schema/` (YAML; `?format=json`), docs at `/api/docs/`.

drf-spectacular discovers the endpoints (every DRF view in the URLconf, with its path parameters).
The views build their JSON by hand, so what they accept and answer is declared here, once, and
merged in by `postprocess`: `OPERATIONS` maps each (path pattern, method) to its request and
responses, `SCHEMAS` (relay/openapi_schemas.py) holds the shared components. `tests/test_openapi.py`
fails when a route has no declaration, validates the document (openapi-spec-validator) and checks
real responses of the main flows against it. Nothing here is imported by the views: they stay as they are.
"""

import re

from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from relay import openapi_webhooks
from relay.openapi_schemas import INT, SCHEMAS, STR, ref


def urls():
    return [
        path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
        path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="swagger-ui"),
        path("api/redoc/", SpectacularRedocView.as_view(url_name="schema"), name="redoc"),
    ]


def _json(name_or_schema) -> dict:
    schema = ref(name_or_schema) if isinstance(name_or_schema, str) else name_or_schema
    return {"application/json": {"schema": schema}}


def _resp(description: str, schema=None) -> dict:
    out = {"description": description}
    if schema is not None:
        out["content"] = _json(schema)
    return out


RELAY_ERRORS = {
    "400": _resp("invalid request", "RelayError"),
    "401": _resp("missing or invalid credential", "RelayError"),
    "404": _resp("not found (or not yours)", "RelayError"),
    "429": _resp("rate limited (Retry-After)", "RelayError"),
}
OPENAI_ERRORS = {
    "400": _resp("invalid request", "OpenAIError"),
    "401": _resp("missing or invalid credential", "OpenAIError"),
    "404": _resp("not found, not yours, or no batch access", "OpenAIError"),
    "429": _resp("too many concurrent uploads", "OpenAIError"),
}
ANTHROPIC_ERRORS = {
    "400": _resp("invalid request", "AnthropicError"),
    "401": _resp("missing or invalid credential", "AnthropicError"),
    "404": _resp("not found, not yours, or no batch access", "AnthropicError"),
}
INFERENCE = {
    "requestBody": {"required": True, "content": _json("InferenceRequest")},
    "responses": {
        "200": _resp("the upstream's answer", "InferenceResponse"),
        **RELAY_ERRORS,
        "502": _resp("no upstream answer", "RelayError"),
        "503": _resp("every host key is cooling down or rate limited", "RelayError"),
    },
    "tags": ["inference"],
}
# A relay credential (relay key or inference token) is accepted in any of three headers wherever it is
# accepted at all (core.auth.bearer_from_headers): `Authorization: Bearer`, `x-api-key` (what the
# Anthropic SDK sends) and `X-WR-API-Key`. Each is a scheme, any one of them suffices.
RELAY_CREDENTIAL = [{"RelayKey": []}, {"RelayApiKey": []}, {"RelayWrApiKey": []}]
SESSION_OR_TOKEN = [*RELAY_CREDENTIAL, {"AdminToken": []}]

OPERATIONS = {
    ("/healthz", "get"): {
        "summary": "Database and Redis reachability",
        "tags": ["operations"],
        "security": [],
        "responses": {"200": _resp("healthy", "Health"), "503": _resp("the database or Redis is down", "Health")},
    },
    ("/v1/models", "get"): {
        "summary": "Models the caller's policy grants",
        "tags": ["inference"],
        "responses": {"200": _resp("models", "ModelList"), "401": RELAY_ERRORS["401"]},
    },
    ("/v1/batches", "post"): {
        "summary": "Create a batch (relay-native or OpenAI-compatible, told apart by the body)",
        "tags": ["batches"],
        "parameters": [
            {"name": "Idempotency-Key", "in": "header", "required": False, "schema": STR},
        ],
        "requestBody": {
            "required": True,
            "content": _json({"oneOf": [ref("NativeBatchCreate"), ref("BatchCreate")]}),
        },
        "responses": {
            "200": _resp("OpenAI-compatible batch, status validating", "Batch"),
            "202": _resp("relay-native batch accepted", "NativeBatchAccepted"),
            **OPENAI_ERRORS,
            "503": _resp("the queue broker is unreachable; nothing stored", "OpenAIError"),
        },
    },
    ("/v1/batches", "get"): {
        "summary": "List the caller's OpenAI-compatible batches, newest first",
        "tags": ["batches"],
        "parameters": [
            {"name": "after", "in": "query", "required": False, "schema": STR},
            {
                "name": "limit",
                "in": "query",
                "required": False,
                "schema": {"type": "integer", "minimum": 1, "maximum": 100},
            },
        ],
        "responses": {"200": _resp("a page of batches", "BatchList"), **OPENAI_ERRORS},
    },
    ("/v1/batches/{batch_id}", "get"): {
        "summary": "A batch: native status (UUID id) or OpenAI batch object (batch_… id)",
        "tags": ["batches"],
        "responses": {
            "200": _resp("the batch", {"oneOf": [ref("NativeBatchStatus"), ref("Batch")]}),
            "401": RELAY_ERRORS["401"],
            "404": RELAY_ERRORS["404"],
        },
    },
    ("/v1/batches/{batch_id}/results", "get"): {
        "summary": "Results of a native batch, in item order",
        "tags": ["batches"],
        "responses": {
            "200": _resp("results", "NativeBatchResults"),
            "401": RELAY_ERRORS["401"],
            "404": RELAY_ERRORS["404"],
        },
    },
    ("/v1/batches/{batch_id}/cancel", "post"): {
        "summary": "Cancel a batch",
        "tags": ["batches"],
        "responses": {
            "200": _resp(
                "cancelled (native) or the batch object, cancelling (OpenAI)",
                {"oneOf": [ref("NativeBatchCancelled"), ref("Batch")]},
            ),
            **OPENAI_ERRORS,
        },
    },
    ("/v1/batches/{batch_id}/retry_failed", "post"): {
        "summary": "Re-run a finished batch's failed and expired records as a new batch of its surface",
        "description": "Native (UUID id): 202 with the new batch's id and `parent_idx`; OpenAI (batch_… id): the new "
        "batch object. Both carry `retry_of`. Errors in the surface's envelope (docs/api: 'Re-run what failed').",
        "tags": ["batches"],
        "responses": {
            "200": _resp("the new OpenAI-compatible batch, status validating", "Batch"),
            "202": _resp("the new relay-native batch, accepted", "NativeBatchRetried"),
            **{
                status: _resp(d, {"anyOf": [ref("OpenAIError"), ref("RelayError")]})
                for status, d in (
                    ("400", "not finished (OpenAI), nothing to retry, or another project's credential"),
                    ("401", "missing or invalid credential"),
                    ("404", "not found, not yours, or no batch access"),
                )
            },
            "409": _resp("the native batch has not finished", "RelayError"),
            "410": _resp(
                "the batch's stored request bodies are gone", {"anyOf": [ref("OpenAIError"), ref("RelayError")]}
            ),
            "503": _resp("the queue broker is unreachable; nothing stored", "OpenAIError"),
        },
    },
    ("/v1/files", "post"): {
        "summary": "Upload a batch input file (JSONL), streamed",
        "tags": ["files"],
        "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": ref("FileUpload")}}},
        "responses": {"200": _resp("the file", "File"), **OPENAI_ERRORS, "413": _resp("file too large", "OpenAIError")},
    },
    ("/v1/files", "get"): {
        "summary": "List the caller's files",
        "tags": ["files"],
        "parameters": [
            {"name": "purpose", "in": "query", "required": False, "schema": STR},
            {"name": "after", "in": "query", "required": False, "schema": STR},
            {"name": "limit", "in": "query", "required": False, "schema": INT},
            {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"]}},
        ],
        "responses": {"200": _resp("a page of files", "FileList"), **OPENAI_ERRORS},
    },
    ("/v1/files/{file_id}", "get"): {
        "summary": "A file object",
        "tags": ["files"],
        "responses": {"200": _resp("the file", "File"), **OPENAI_ERRORS},
    },
    ("/v1/files/{file_id}", "delete"): {
        "summary": "Delete a file (row and bytes)",
        "tags": ["files"],
        "responses": {"200": _resp("deleted", "FileDeleted"), **OPENAI_ERRORS},
    },
    ("/v1/files/{file_id}/content", "get"): {
        "summary": "A file's bytes (JSONL), streamed",
        "tags": ["files"],
        "responses": {
            "200": {
                "description": "the bytes",
                "content": {"application/octet-stream": {"schema": {"type": "string"}}},
            },
            **OPENAI_ERRORS,
        },
    },
    **{
        (prefix + path_, method): op
        for prefix in ("", "/anthropic")
        for (path_, method), op in {
            ("/v1/messages/batches", "post"): {
                "summary": "Create a Message Batch (Anthropic-compatible)",
                "tags": ["anthropic batches"],
                "requestBody": {"required": True, "content": _json("MessageBatchCreate")},
                "responses": {"200": _resp("the message batch", "MessageBatch"), **ANTHROPIC_ERRORS},
            },
            ("/v1/messages/batches", "get"): {
                "summary": "List the caller's Message Batches, newest first",
                "tags": ["anthropic batches"],
                "parameters": [
                    {"name": "before_id", "in": "query", "required": False, "schema": STR},
                    {"name": "after_id", "in": "query", "required": False, "schema": STR},
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                    },
                ],
                "responses": {"200": _resp("a page of message batches", "MessageBatchList"), **ANTHROPIC_ERRORS},
            },
            ("/v1/messages/batches/{batch_id}", "get"): {
                "summary": "A Message Batch",
                "tags": ["anthropic batches"],
                "responses": {"200": _resp("the message batch", "MessageBatch"), **ANTHROPIC_ERRORS},
            },
            ("/v1/messages/batches/{batch_id}", "delete"): {
                "summary": "Delete an ended Message Batch (its items and results)",
                "tags": ["anthropic batches"],
                "responses": {"200": _resp("deleted", "MessageBatchDeleted"), **ANTHROPIC_ERRORS},
            },
            ("/v1/messages/batches/{batch_id}/cancel", "post"): {
                "summary": "Cancel a Message Batch",
                "tags": ["anthropic batches"],
                "responses": {"200": _resp("the message batch, canceling", "MessageBatch"), **ANTHROPIC_ERRORS},
            },
            ("/v1/messages/batches/{batch_id}/retry_failed", "post"): {
                "summary": "Re-run an ended Message Batch's errored and expired requests as a new Message Batch",
                "tags": ["anthropic batches"],
                "responses": {
                    "200": _resp("the new message batch, with retry_of", "MessageBatch"),
                    **ANTHROPIC_ERRORS,
                    "410": _resp("the batch's stored request bodies are gone", "AnthropicError"),
                },
            },
            ("/v1/messages/batches/{batch_id}/results", "get"): {
                "summary": "Results of an ended Message Batch, streamed as JSONL (one line per request)",
                "tags": ["anthropic batches"],
                "responses": {
                    "200": {
                        "description": "JSONL: {custom_id, result: {type: succeeded|errored|canceled|expired, …}}",
                        "content": {"application/binary": {"schema": {"type": "string"}}},
                    },
                    **ANTHROPIC_ERRORS,
                    "404": _resp(
                        "not found, not yours, no batch access, or its results archived (archived_at set; "
                        "error code results_archived)",
                        "AnthropicError",
                    ),
                },
            },
        }.items()
    },
    # Webhook endpoints (batches/webhooks): also under /openai/, like the other OpenAI-compatible routes.
    **openapi_webhooks.operations(_resp, _json, OPENAI_ERRORS),
    ("/api/usage/events", "get"): {
        "summary": "Usage events, newest first (keyset pages)",
        "tags": ["usage"],
        "security": SESSION_OR_TOKEN,
        "responses": {"200": _resp("events", "UsageEvents"), **RELAY_ERRORS},
    },
    ("/api/usage/budgets", "get"): {
        "summary": "Spend budgets the caller may see, with the current period's spent, reserved and left",
        "tags": ["usage"],
        "security": SESSION_OR_TOKEN,
        "responses": {"200": _resp("budgets", "UsageBudgets"), **RELAY_ERRORS},
    },
    ("/api/usage/summary", "get"): {
        "summary": "Usage grouped by a dimension",
        "tags": ["usage"],
        "security": SESSION_OR_TOKEN,
        "responses": {"200": _resp("summary rows", "UsageSummary"), **RELAY_ERRORS},
    },
}

_INFERENCE_PATH = re.compile(
    r"^(/openai|/anthropic)?/v1/(chat/completions|completions|embeddings|responses|messages|messages/count_tokens)$"
)
_CHAT_PATHS = {"/v1/chat/completions", "/openai/v1/chat/completions"}


def declaration(path: str, method: str) -> dict | None:
    if (path, method) in OPERATIONS:
        return OPERATIONS[(path, method)]
    if path.startswith("/openai/v1/") and (path.removeprefix("/openai"), method) in OPERATIONS:
        # The OpenAI-compatible routes are served under /openai/ too, the same operations.
        return OPERATIONS[(path.removeprefix("/openai"), method)]
    if method == "post" and _INFERENCE_PATH.match(path):
        op = dict(INFERENCE, summary=f"Live inference: POST {path} (non-streaming)")
        if path in _CHAT_PATHS:
            op["responses"] = dict(op["responses"], **{"200": _resp("the chat completion", "ChatCompletion")})
        return op
    return None


def preprocess(endpoints):
    """Only the API: not the schema and docs views themselves."""
    return [e for e in endpoints if not e[0].startswith(("/api/schema", "/api/docs", "/api/redoc"))]


def postprocess(result, generator, request, public):
    """Replace each discovered operation's guessed request/responses with its declaration."""
    undeclared = []
    for path_, item in result.get("paths", {}).items():
        for method, op in item.items():
            decl = declaration(path_, method)
            if decl is None:
                undeclared.append(f"{method.upper()} {path_}")
                continue
            params = [p for p in op.get("parameters", []) if p.get("in") == "path"] + decl.get("parameters", [])
            new = {"operationId": op["operationId"], **{k: v for k, v in decl.items() if k != "parameters"}}
            if params:
                new["parameters"] = params
            new.setdefault("security", RELAY_CREDENTIAL)
            item[method] = new
    result.setdefault("components", {})
    result["components"]["schemas"] = {**SCHEMAS, **openapi_webhooks.SCHEMAS}
    result["components"]["securitySchemes"] = {
        "RelayKey": {"type": "http", "scheme": "bearer", "description": "a relay key (sk-wr-…) or inference token"},
        "RelayApiKey": {
            "type": "apiKey",
            "in": "header",
            "name": "x-api-key",
            "description": "a relay key (sk-wr-…) or inference token, as the Anthropic SDK sends its key",
        },
        "RelayWrApiKey": {
            "type": "apiKey",
            "in": "header",
            "name": "X-WR-API-Key",
            "description": "a relay key (sk-wr-…) or inference token (checked first when several are sent)",
        },
        "AdminToken": {"type": "http", "scheme": "bearer", "description": "RELAY_ADMIN_TOKEN (operator)"},
    }
    if undeclared:  # tests/test_openapi.py fails on it; a running relay still serves the rest
        result["x-undeclared-operations"] = undeclared
    return result
