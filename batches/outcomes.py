"""Why an item failed, as one explicit set of codes.

A failure is recorded where it happens, as a code from `Code` on the item
(`Item.error_code`, guarded by the database: batches/domains.py) next to the human message
(`Item.error`). Everything a caller sees is derived from the code, never parsed
back out of the message: the usage event's `error_kind`, the native result's
`error`, and the `code` of a record in an OpenAI error file.
"""

import logging

from django.db import models

log = logging.getLogger(__name__)


class Code(models.TextChoices):
    # The upstream answered with an HTTP error (Item.status_code holds its status).
    UPSTREAM_ERROR = "upstream_error"
    # The pipeline refused or could not reach a provider (gateway.pipeline / gateway.routing codes).
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    NO_KEYS = "no_keys"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    CLIENT_CANCELED = "client_canceled"
    CROSS_SHAPE_DISPATCH = "cross_shape_dispatch"
    MODEL_NOT_FOUND = "model_not_found"
    MODEL_NOT_ALLOWED = "model_not_allowed"
    NO_POLICY = "no_policy"
    POLICY_DISABLED = "policy_disabled"
    NO_HOST_BINDING = "no_host_binding"
    INVALID_REQUEST = "invalid_request"
    REQUEST_TOO_LARGE = "request_too_large"
    PROJECT_UNAVAILABLE = "project_unavailable"
    # A spend budget of the batch's project, team, service account or policy is spent (usage/budgets.py):
    # a wait until its period ends where the surface waits for capacity, else the item's failure.
    BUDGET_EXCEEDED = "budget_exceeded"
    # The item ran longer than RELAY_BATCH_ITEM_DEADLINE_SECONDS.
    TIMEOUT = "timeout"
    # Decided by the batch runner before the pipeline.
    CREDENTIAL_INVALID = "credential_invalid"
    POLICY_UNAVAILABLE = "policy_unavailable"
    INVALID_ITEM = "invalid_item"
    STREAMING_UNSUPPORTED = "streaming_unsupported"
    WORKER_LOST = "worker_lost"
    # The batch ended the item.
    BATCH_CANCELLED = "batch_cancelled"
    BATCH_EXPIRED = "batch_expired"
    # Tool calling inside OpenAI records (batches/tools/config.py).
    INVALID_TOOL_CONFIG = "invalid_tool_config"
    TOOL_CONFIG_MOVED = "tool_config_moved"
    TOOL_EXECUTOR_TIMEOUT = "tool_executor_timeout"
    TOOL_EXECUTOR_ERROR = "tool_executor_error"
    TOOL_EXECUTOR_BAD_RESPONSE = "tool_executor_bad_response"
    TOOL_EXECUTOR_BLOCKED = "tool_executor_blocked"
    TOOL_ROUNDS_EXHAUSTED = "tool_rounds_exhausted"
    INVALID_TOOL_CALLS = "invalid_tool_calls"
    # A relay-side failure with a code outside this set (logged, so the set can grow).
    RELAY_ERROR = "relay_error"


CODES = frozenset(Code.values)

# What an OpenAI error-file record calls a code, where OpenAI names it differently.
_OPENAI_NAMES = {Code.TIMEOUT: "request_timeout", Code.RELAY_ERROR: "batch_item_failed"}


def normalize(kind: str) -> str:
    """A pipeline/tool error kind as a code of the set; unknown kinds become `relay_error`."""
    if kind in CODES:
        return kind
    if kind:
        log.warning("batch item failure kind %r is not in batches.outcomes.Code; recorded as relay_error", kind)
    return Code.RELAY_ERROR


def openai_code(code: str) -> str:
    return _OPENAI_NAMES.get(code, code or "batch_item_failed")
