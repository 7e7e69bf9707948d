"""Streaming parse of a batch submission body, in bounded memory.

The body is read as a stream (never through DRF's parser) and parsed with
ijson: each element of `requests` is built, handed to the caller and dropped,
so a 50,000-item, 32 MiB body never sits in memory as one document. Top-level
keys other than `requests` are small and returned whole.
"""

import json

import ijson

from relay.errors import RelayError

_SCALARS = {"string", "number", "boolean", "null", "integer", "double"}


class LimitedStream:
    """A file-like view of the request body that refuses to read past `limit` bytes."""

    def __init__(self, raw, limit: int):
        self.raw = raw
        self.limit = limit
        self.seen = 0

    def read(self, n: int = -1) -> bytes:
        chunk = self.raw.read(64 * 1024 if n is None or n < 0 else n)
        self.seen += len(chunk)
        if self.seen > self.limit:
            raise RelayError(400, "request_too_large", f"request body exceeds {self.limit} bytes")
        return chunk


def parse(stream, on_item) -> dict:
    """Call `on_item(idx, obj)` for every element of `requests`; return the other top-level keys.

    `requests` is reported as present (key "requests" → number of items) when it is an array.
    """
    top: dict = {}
    builder = None
    builder_key = None
    depth = 0
    count = 0
    try:
        events = ijson.parse(stream, use_float=True)
        first = next(events, None)
        if first is None or first[1] != "start_map":
            raise RelayError(400, "invalid_request", "invalid request body: expected a JSON object")
        for prefix, event, value in events:
            if builder is not None:
                builder.event(event, value)
                if event in ("start_map", "start_array"):
                    depth += 1
                elif event in ("end_map", "end_array"):
                    depth -= 1
                if depth == 0:
                    if builder_key == "requests.item":
                        on_item(count, builder.value)
                        count += 1
                    else:
                        top[builder_key] = builder.value
                    builder = None
                continue
            if prefix == "requests.item":
                if event != "start_map":
                    raise RelayError(400, "invalid_request", f"requests[{count}] must be a JSON object")
                builder, builder_key, depth = ijson.ObjectBuilder(), "requests.item", 1
                builder.event(event, value)
            elif prefix == "requests":
                if event == "start_array":
                    top["requests"] = None
                elif event == "end_array":
                    top["requests"] = count
                elif event in _SCALARS or event == "start_map":
                    raise RelayError(400, "invalid_request", "requests must be an array")
            elif prefix and "." not in prefix and event not in ("map_key",):
                if event in ("start_map", "start_array"):
                    builder, builder_key, depth = ijson.ObjectBuilder(), prefix, 1
                    builder.event(event, value)
                elif event in _SCALARS:
                    top[prefix] = value
    except ijson.JSONError as exc:
        raise RelayError(400, "invalid_json", f"invalid request body: {exc}") from exc
    return top


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
