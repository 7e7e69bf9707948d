"""Host-key values never leave the relay (issue 12).

A provider may echo the credential it was sent (a 401 body such as
`Incorrect API key provided: sk-live-…`). Every byte string that came from a
provider passes through here before it reaches a caller, a result or error
file, an item's kept error body, or a log line; each known host-key value in it
is replaced by REDACTED.

Known values: every value the pipeline decrypted to call a provider
(`remember()`: all pool keys of the route, so the key actually sent is always
covered, even one rotated a second ago). With `load=True` (the default) also
all HostKey values in the catalog, reloaded at most every RELOAD_SECONDS. The
pipeline and log lines use `load=False`: no database query on the hot path or
inside logging.
"""

import logging
import threading
import time

log = logging.getLogger(__name__)

REDACTED = "[host key redacted]"
# Shorter values are not scrubbed: replacing a 3-character "key" everywhere would mangle bodies.
MIN_LENGTH = 8
RELOAD_SECONDS = 60.0
_MAX_REMEMBERED = 10_000

_lock = threading.Lock()
_remembered: set[str] = set()
_catalog: frozenset[str] = frozenset()
_loaded_at = float("-inf")


def remember(value: str) -> None:
    """Record a host-key value the relay is about to send to a provider."""
    if not value or len(value) < MIN_LENGTH or value in _remembered:
        return
    with _lock:
        if len(_remembered) >= _MAX_REMEMBERED:
            _remembered.clear()
        _remembered.add(value)


def _reload_catalog() -> None:
    global _catalog, _loaded_at
    if time.monotonic() - _loaded_at < RELOAD_SECONDS:
        return
    _loaded_at = time.monotonic()
    from relay.crypto import SecretUnavailable
    from relay.models import HostKey

    values = set()
    try:
        for key in HostKey.objects.all():
            try:
                values.add(key.get_value())
            except (SecretUnavailable, ValueError):
                continue
    except Exception:  # no database (a management command, a test without db): keep what is known
        log.debug("could not load host keys for scrubbing", exc_info=True)
        return
    _catalog = frozenset(v for v in values if len(v) >= MIN_LENGTH)


def known_values(*, load: bool = True) -> list[str]:
    """Longest first, so a key that contains another is replaced whole."""
    if load:
        _reload_catalog()
    with _lock:
        values = set(_remembered) | _catalog
    return sorted(values, key=len, reverse=True)


def forget_all() -> None:
    """Tests: start from an empty state (and reload the catalog on next use)."""
    global _catalog, _loaded_at
    with _lock:
        _remembered.clear()
        _catalog = frozenset()
        _loaded_at = float("-inf")


def scrub_text(text: str, *, load: bool = True) -> str:
    if not text:
        return text
    for value in known_values(load=load):
        if value in text:
            text = text.replace(value, REDACTED)
    return text


def scrub_bytes(data: bytes, *, load: bool = True) -> bytes:
    if not data:
        return data
    for value in known_values(load=load):
        raw = value.encode("utf-8", "ignore")
        if raw in data:
            data = data.replace(raw, REDACTED.encode())
    return data


def scrub_headers(headers: dict, *, load: bool = True) -> dict:
    return {name: scrub_text(value, load=load) if isinstance(value, str) else value for name, value in headers.items()}


class ScrubFilter(logging.Filter):
    """A logging filter (settings.LOGGING) that removes known host-key values from every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            values = known_values(load=False)
            if not values:
                return True
            message = record.getMessage()
            if record.exc_info and not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            clean = scrub_text(message, load=False)
            if clean != message:
                record.msg, record.args = clean, ()
            if record.exc_text:
                record.exc_text = scrub_text(record.exc_text, load=False)
        except Exception:  # a filter must never lose the record
            pass
        return True
