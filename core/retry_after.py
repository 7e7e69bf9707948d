"""One parser for a provider's `Retry-After` header (decision 0010).

RFC 9110 §10.2.3 allows two forms: delta-seconds (a non-negative integer) or an
HTTP-date. Providers also send decimals ("1.5"), which we accept. Anything else
(`inf`, `nan`, `1e400`, negative numbers, garbage) is ignored: None, as if the
header were absent. The result is capped at MAX_SECONDS, so one answer can
neither bench a host key for years nor be passed on to clients as such.
"""

import math
import time
from email.utils import parsedate_to_datetime

MAX_SECONDS = 3600.0  # one hour: for breakers and for what clients see
_MAX_TEXT = 64  # longer header values are not a number nor a date


def parse_retry_after(value, *, now: float | None = None) -> float | None:
    """Seconds to wait (0 ≤ s ≤ MAX_SECONDS), or None when the value is not a valid Retry-After."""
    if value is None:
        return None
    text = str(value).strip()
    if not text or len(text) > _MAX_TEXT:
        return None
    seconds = _delta(text)
    if seconds is None:
        seconds = _http_date(text, time.time() if now is None else now)
    if seconds is None:
        return None
    return min(max(seconds, 0.0), MAX_SECONDS)


def _delta(text: str) -> float | None:
    # Plain digits with at most one decimal point: no exponent, sign, "inf" or "nan".
    if not text.replace(".", "", 1).isdigit() or not text.isascii():
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def _http_date(text: str, now: float) -> float | None:
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None or when.tzinfo is None:
        return None  # RFC 9110 dates are always GMT; a date without a zone is not one
    try:
        return when.timestamp() - now
    except (OverflowError, OSError, ValueError):
        return None


def header_seconds(seconds: float) -> int:
    """The integer a relay answer's Retry-After carries: at least 1, at most MAX_SECONDS."""
    return int(min(max(1, math.ceil(seconds)), MAX_SECONDS))
