"""Reading request bodies within a byte budget, without trusting Content-Length; whole numbers a client sends."""

import re

from core import jsonguard
from core.errors import RelayError

_CHUNK = 64 * 1024
_ASCII_DIGITS = re.compile(r"[0-9]+")


def ascii_int(text) -> int | None:
    """A whole number written in ASCII digits only, else None: str.isdigit() and int() also take
    "+5", " 5", "5_0", fullwidth and Arabic-Indic digits, which no client means as a number (decision 0014)."""
    if not isinstance(text, str) or not _ASCII_DIGITS.fullmatch(text):
        return None
    return int(text)


def read_body(django_request, limit: int) -> bytes:
    declared = ascii_int(django_request.META.get("CONTENT_LENGTH") or "")
    if declared is not None and declared > limit:
        raise too_large(limit)
    chunks, size = [], 0
    while True:
        chunk = django_request.read(_CHUNK)
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(limit: int, status: int = 413) -> RelayError:
    """The one "body too large" error. 413, except where a spec fixes another status (a native batch: 400)."""
    return RelayError(status, "request_too_large", f"request body exceeds {limit} bytes")


def parse_json_object(raw: bytes) -> dict:
    """The body as a JSON object, checked by core.jsonguard (NUL, lone surrogates, depth, non-finite numbers)."""
    try:
        value = jsonguard.loads(raw)
    except jsonguard.JSONGuardError as exc:
        raise guard_error(exc) from exc
    if not isinstance(value, dict):
        raise RelayError(400, "invalid_request", "request body must be a JSON object")
    return value


def guard_error(exc: "jsonguard.JSONGuardError", *, prefix: str = "") -> RelayError:
    """A 400 in the relay's envelope for a value core.jsonguard refused; `param` names the field."""
    param = (prefix + exc.path) or None
    if exc.code == "invalid_json":
        return RelayError(400, "invalid_json", f"invalid request body: {exc.message}", param=param)
    return RelayError(400, exc.code, f"invalid request body: {exc.message}", param=param)
