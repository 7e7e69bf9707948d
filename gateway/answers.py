"""What the pipeline reads off an upstream answer that is not a success: which failure class a status is
(for the key's breaker), the Retry-After a provider sent, capped, and what a tenant reads when no HTTP
answer came at all. Split from gateway/pipeline.py, which calls these once per answer."""

import json
import logging

from core.errors import RelayError
from core.retry_after import header_seconds, parse_retry_after
from gateway import upstream
from policies.breaker import Failure

log = logging.getLogger(__name__)

RETRYABLE = {401: Failure.AUTH, 403: Failure.FORBIDDEN, 429: Failure.RATE_LIMITED}


def classify(status: int) -> Failure | None:
    if status in RETRYABLE:
        return RETRYABLE[status]
    if status >= 500:
        return Failure.SERVER
    return None


def retry_after(resp: upstream.UpstreamResponse) -> float | None:
    return parse_retry_after({k.lower(): v for k, v in resp.headers.items()}.get("retry-after"))


MAX_RETRY_AFTER_S = 3600


def capped(seconds: float | None) -> float | None:
    """A wait we act on: at least a moment, at most an hour, whatever a provider or a limiter said."""
    if seconds is None or seconds != seconds:  # None or NaN
        return None
    return min(max(seconds, 0.05), MAX_RETRY_AFTER_S)


def passthrough_retry(resp: upstream.UpstreamResponse) -> dict:
    seconds = retry_after(resp)
    return {"Retry-After": header_seconds(seconds)} if seconds is not None else {}


def content_type(resp: upstream.UpstreamResponse, default: str = "application/json") -> dict:
    ct = {k.lower(): v for k, v in resp.headers.items()}.get("content-type", default)
    return {"Content-Type": ct}


def json_or_empty(raw: bytes) -> dict:
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# What a tenant reads when no HTTP answer came: one fixed sentence per cause, with its code. The
# exception's own text (hosts, ports, library class names) goes to the log only, under the request id.
TRANSPORT_ERRORS = {
    "timeout": (504, "timeout", "the upstream provider did not answer within the deadline"),
    "cancelled": (499, "client_canceled", "cancelled"),
    "unreachable": (502, "upstream_unreachable", "the upstream provider could not be reached"),
    "network": (502, "upstream_error", "the connection to the upstream provider broke"),
    "too_large": (502, "upstream_error", "the upstream answer exceeded the relay's size limit"),
}


def upstream_error_to_relay(exc: upstream.UpstreamError, request_id: str) -> RelayError:
    status, code, message = TRANSPORT_ERRORS.get(exc.kind, TRANSPORT_ERRORS["network"])
    if exc.kind != "cancelled":
        log.warning("request %s: upstream %s: %s", request_id, exc.kind, exc.message)
    return RelayError(status, code, f"{message} (request {request_id})" if request_id else message)
