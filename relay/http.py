"""Reading request bodies within a byte budget, without trusting Content-Length."""

import json

from relay.errors import RelayError

_CHUNK = 64 * 1024


def read_body(django_request, limit: int) -> bytes:
    declared = django_request.META.get("CONTENT_LENGTH") or ""
    if declared.isdigit() and int(declared) > limit:
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
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise RelayError(400, "invalid_json", f"request body is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise RelayError(400, "invalid_request", "request body must be a JSON object")
    return value
