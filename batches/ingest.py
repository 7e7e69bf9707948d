"""Streaming parse of a batch submission body, in bounded memory.

The body is read as a stream (never through DRF's parser) and parsed with
ijson: each element of `requests` is built, handed to the caller and dropped,
so a 50,000-item, 32 MiB body never sits in memory as one document. Top-level
keys other than `requests` are small and returned whole.

Both batch surfaces share one POST URL and are told apart by the top-level
keys, which may come after `requests` in the body. `SubmissionReader` parses the
body once, in stages: head() answers the keys before `requests`; when they
already say which surface it is, the caller stores each element as it is parsed
(surfaces.native.submit.store_native_streaming); otherwise `read_submission` spools each
element (as compact JSON, one per line) to a temporary file, and the surface is
picked afterwards and reads the spool back.

Duplicate keys: the last one wins, as everywhere the relay reads JSON (core.jsonguard). For
`requests` that means a second array replaces the first, never adds to it: elements() raises
RequestsAgain when one begins after elements were handed out, and the caller drops what it kept
and reads on (SubmissionReader.spooled, batches.intake.receive).

Memory: one element (or one other top-level value) is built whole, so it may hold at most
jsonguard.MAX_VALUES parse events; a body of a million empty arrays is refused before it is built.
"""

import hashlib
import json
import tempfile
from collections.abc import Iterator

import ijson
from django.conf import settings

from batches.errors import invalid
from core import jsonguard
from core.errors import RelayError, clipped
from core.http import too_large

# However large RELAY_MAX_REQUEST_BYTES is set, one batch body or input line is never read past this.
HARD_BODY_CAP = 64 * 1024 * 1024


def body_limit() -> int:
    """The most bytes one batch body (or one line of an input file) may have."""
    return min(settings.RELAY_MAX_REQUEST_BYTES, HARD_BODY_CAP)


_SCALARS = {"string", "number", "boolean", "null", "integer", "double"}


class LimitedStream:
    """A file-like view of the request body that refuses to read past `limit` bytes.

    It keeps the chunk read last, with the line it starts on: the parser fails inside the chunk it was
    handed last, so a syntax error can say its line and column (_syntax_error)."""

    def __init__(self, raw, limit: int):
        self.raw = raw
        self.limit = limit
        self.seen = 0
        self.sha256 = hashlib.sha256()  # of the exact bytes read: idempotent create compares bodies
        self.last = b""  # the chunk read last
        self.before = 0  # bytes before it
        self.line = 1  # the line it starts on
        self.line_start = 0  # the offset where that line starts

    def read(self, n: int = -1) -> bytes:
        chunk = self.raw.read(64 * 1024 if n is None or n < 0 else n)
        self.seen += len(chunk)
        if self.seen > self.limit:
            raise too_large(self.limit, status=400)  # the native contract: "A larger body gets 400" (decision 0003)
        self.sha256.update(chunk)
        prev = self.last
        if prev:
            self.line += prev.count(b"\n")
            newline = prev.rfind(b"\n")
            if newline >= 0:
                self.line_start = self.before + newline + 1
            self.before += len(prev)
        self.last = chunk
        return chunk

    def where(self, offset: int) -> tuple[int, int]:
        """(line, column), both from 1, of byte `offset` of the last chunk; the column counts bytes."""
        line = self.line + self.last.count(b"\n", 0, offset)
        newline = self.last.rfind(b"\n", 0, offset)
        start = self.before + newline + 1 if newline >= 0 else self.line_start
        return line, self.before + offset - start + 1


# yajl draws where it failed: the text around the error (CR and LF shown as spaces), placed so that
# the failing byte sits under a caret in column 40. _yajl_offset finds that byte in the chunk.
_CARET = 40
_FLAT = bytes.maketrans(b"\r\n", b"  ")


def _yajl_offset(chunk: bytes, drawn: bytes) -> int | None:
    """The offset in `chunk` that yajl's drawn line `drawn` shows under its caret, or None."""
    flat = chunk.translate(_FLAT)
    for offset in range(min(_CARET - 10, len(flat)) + 1):  # near the start: the text is indented to fit
        if b" " * (_CARET - offset) + flat[: offset + 30] == drawn:
            return offset
    if not drawn.startswith(b" " * 10):
        return None
    at = flat.find(drawn[10:])  # elsewhere: 10 spaces, then the 30 bytes before the failing one and 30 from it
    return at + 30 if at >= 0 else None


def _syntax_error(exc: Exception, stream: LimitedStream) -> RelayError:
    """One plain sentence saying where the body stops being JSON, without the parser's drawing."""
    text = exc.args[0] if exc.args else str(exc)
    raw = text if isinstance(text, bytes) else str(text).encode("utf-8", "replace")
    lines = raw.split(b"\n")
    reason = lines[0].decode("utf-8", "replace").strip()
    for prefix in ("parse error: ", "lexical error: "):
        reason = reason.removeprefix(prefix)
    if reason == "premature EOF":  # found at the end of the body (the last read was empty)
        offset = len(stream.last)
    else:
        offset = _yajl_offset(stream.last, lines[1]) if len(lines) > 2 else None
    if offset is None:
        where = f"near byte {stream.seen}"
    else:
        line, column = stream.where(offset)
        where = f"at line {line}, column {column}"
    reason = _YAJL_REASONS.get(reason, reason).rstrip(".")
    return RelayError(400, "invalid_json", f"invalid request body: JSON syntax error {where}: {clipped(reason)}.")


_YAJL_REASONS = {
    "premature EOF": "the body ends before the JSON value does",
    "trailing garbage": "there is more text after the JSON value",
}


class _ListTarget:
    """The target of ijson's C items coroutine: completed items are appended to `items`."""

    def __init__(self):
        self.items: list = []
        self.send = self.items.append


def _item_builder():
    """A sink for the events of `requests` elements that builds each element, and the list it fills.

    ijson's C backend (yajl2_c, which ijson picks when it is installed; ijson.backend says which
    loaded) builds elements in C, one coroutine for the whole body; another backend gets
    ijson.ObjectBuilder's Python equivalent.
    """
    target = _ListTarget()
    basecoro = getattr(ijson, "backend", "") == "yajl2_c" and getattr(
        ijson.get_backend("yajl2_c"), "items_basecoro", None
    )
    if basecoro:
        return basecoro(target, "requests.item", map_type=None).send, target.items
    return _PyItemBuilder(target.items).send, target.items


class _PyItemBuilder:
    def __init__(self, out: list):
        self.out = out
        self.builder = None
        self.depth = 0

    def send(self, event_tuple) -> None:
        _, event, value = event_tuple
        if self.builder is None:
            self.builder, self.depth = ijson.ObjectBuilder(), 0
        self.builder.event(event, value)
        if event in ("start_map", "start_array"):
            self.depth += 1
        elif event in ("end_map", "end_array"):
            self.depth -= 1
        if self.depth == 0:
            self.out.append(self.builder.value)
            self.builder = None


# What _steps yields, with the top-level keys seen so far, when the `requests` array starts.
REQUESTS_START = object()


class RequestsAgain(Exception):
    """A second `requests` array began after elements of the first were handed out: the last one wins,
    so the caller drops what it kept of the first and calls elements() again for the new one."""


def _too_many_values(where: str) -> RelayError:
    return invalid(
        f"Invalid request body: {where} holds more than {jsonguard.MAX_VALUES} JSON values; "
        "a value this large would take a server worker hundreds of megabytes to build.",
        code="too_many_values",
    )


def _steps(stream):
    """A generator: `(REQUESTS_START, top so far)` when `requests` starts, then `(idx, obj)` for each of
    its elements; returns the other top-level keys, with `requests` reported as present (key
    "requests" → number of elements) when it is an array.

    The events of an element go to a builder in C (_item_builder), so the Python loop below does
    one call and one test per event of the 50,000 elements' million events.
    """
    top: dict = {}
    builder = None
    builder_key = None
    depth = 0
    count = 0
    in_item = False
    cap = jsonguard.MAX_VALUES
    limit_n = 0  # the event number the element (or top-level value) being built may not pass
    send_item, built = _item_builder()
    try:
        events = ijson.parse(stream, use_float=True)
        first = next(events, None)
        if first is None or first[1] != "start_map":
            raise RelayError(400, "invalid_request", "invalid request body: expected a JSON object")
        for n, ev in enumerate(events):
            if in_item:
                send_item(ev)
                if built:
                    yield count, built.pop()
                    count += 1
                    in_item = False
                elif n > limit_n:
                    raise _too_many_values(f"requests[{count}]")
                continue
            prefix, event, value = ev
            if builder is not None:
                if n > limit_n:
                    raise _too_many_values(clipped(builder_key))
                builder.event(event, value)
                if event in ("start_map", "start_array"):
                    depth += 1
                elif event in ("end_map", "end_array"):
                    depth -= 1
                if depth == 0:
                    top[builder_key] = builder.value
                    builder = None
                continue
            if prefix == "requests.item":
                if event != "start_map":
                    raise RelayError(400, "invalid_request", f"requests[{count}] must be a JSON object")
                in_item = True
                limit_n = n + cap
                send_item(ev)
            elif prefix == "requests":
                if event == "start_array":
                    # A `requests` key again: its elements replace the earlier ones' (last one wins).
                    count = 0
                    top["requests"] = None
                    yield REQUESTS_START, dict(top)
                elif event == "end_array":
                    top["requests"] = count
                elif event in _SCALARS or event == "start_map":
                    raise RelayError(400, "invalid_request", "requests must be an array")
            elif prefix and "." not in prefix and event not in ("map_key",):
                if event in ("start_map", "start_array"):
                    builder, builder_key, depth = ijson.ObjectBuilder(), prefix, 1
                    limit_n = n + cap
                    builder.event(event, value)
                elif event in _SCALARS:
                    top[prefix] = value
    except ijson.JSONError as exc:
        raise _syntax_error(exc, stream) from exc
    except UnicodeDecodeError as exc:  # yajl hands back a key or string holding a lone surrogate as raw bytes
        raise RelayError(400, "invalid_json", f"invalid request body: not valid UTF-8 text ({exc.reason})") from exc
    return top


def _guard(value, path: str) -> None:
    """core.jsonguard's checks on one element or the top-level keys: a 400 naming the field.

    Raised before the element is re-encoded, so a lone surrogate or a 10,000-deep
    element never reaches json.dumps (it would crash there)."""
    try:
        jsonguard.check(value, path)
    except jsonguard.JSONGuardError as exc:
        raise invalid(f"Invalid request body: {exc.message}.", param=exc.path or None, code=exc.code) from exc


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


# Spooled elements stay in memory up to this size, then go to a temporary file.
_SPOOL_MEMORY = 4 * 1024 * 1024


class Submission:
    """A parsed POST /v1/batches body: the top-level keys, and the `requests` elements spooled in order.

    `count` is the number of elements sent; only the first `keep` are spooled,
    so an oversized batch can still be refused with its real size. Use as a
    context manager: the spool is deleted on exit.
    """

    def __init__(self, top: dict, count: int, spool, sha256: str):
        self.top = top
        self.count = count
        self.sha256 = sha256
        self._spool = spool

    def elements(self) -> Iterator[bytes]:
        """Each spooled element as compact JSON bytes (no newline inside), in order."""
        self._spool.seek(0)
        for line in self._spool:
            yield line[:-1]

    def jsonl_chunks(self, size: int = 1024 * 1024) -> Iterator[bytes]:
        """The spooled elements as JSON Lines (each element and its newline), in chunks of `size` bytes."""
        self._spool.seek(0)
        while chunk := self._spool.read(size):
            yield chunk

    def close(self) -> None:
        self._spool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# Spooled lines are handed to the spool in writes of about this size, not two writes per element.
_SPOOL_WRITE = 256 * 1024


class SubmissionReader:
    """A batch body parsed as a stream, in stages: head(), then elements(), which parses to the end.

    head() answers the top-level keys that come before `requests`, so a caller that can tell from
    them what to do with the elements (surfaces.native.submit.store_native_streaming) can store each element as it
    is parsed instead of spooling the whole body first. `top`, `count` and `sha256` are known once
    elements() is exhausted.
    """

    def __init__(self, raw_stream, limit: int, keep: int):
        self.stream = LimitedStream(raw_stream, limit)
        self.keep = keep
        self.count = 0
        self.top: dict | None = None
        self._steps = _steps(self.stream)
        self._started = False

    @property
    def sha256(self) -> str:
        return self.stream.sha256.hexdigest()

    def _next(self):
        """The next step of the parse, or None once the body is parsed (self.top is then set)."""
        if self.top is not None:
            return None
        try:
            return next(self._steps)
        except StopIteration as done:
            _guard(done.value, "")
            self.top = done.value
            return None

    def head(self) -> dict | None:
        """The top-level keys before `requests` (parsed up to its first element), or None when the
        body has no `requests` array: it is then parsed to its end. Call once, before elements()."""
        assert not self._started
        self._started = True
        step = self._next()
        return None if step is None else step[1]

    def elements(self) -> Iterator[bytes]:
        """Each kept element (the first `keep`) as compact JSON bytes with no newline inside, checked
        by core.jsonguard (a 400 naming the field); the body is parsed to its end when this ends."""
        if not self._started:
            self.head()
        keep = self.keep
        handed_out = False
        for step in iter(self._next, None):
            if step[0] is REQUESTS_START:  # a second `requests` key: it replaces the first (last one wins)
                self.count = 0
                if handed_out:
                    raise RequestsAgain
                continue
            idx, obj = step
            self.count += 1
            # Checked by its own encoding (core.jsonguard.encode), before anything is kept: a lone
            # surrogate or a 10,000-deep element is refused here, naming the field.
            try:
                data = jsonguard.encode(obj, f"requests[{idx}]")
            except jsonguard.JSONGuardError as exc:
                raise invalid(f"Invalid request body: {exc.message}.", param=exc.path or None, code=exc.code) from exc
            if idx < keep:
                handed_out = True
                yield data

    def spooled(self) -> Submission:
        """Parse the rest of the body, spooling each kept element as a line, and answer the Submission."""
        spool = tempfile.SpooledTemporaryFile(max_size=_SPOOL_MEMORY)  # noqa: SIM115 - Submission closes it
        pending: list[bytes] = []
        pending_size = 0
        try:
            while True:
                try:
                    for data in self.elements():
                        # JSON escapes newlines inside strings, so one element is one line.
                        pending.append(data)
                        pending_size += len(data) + 1
                        if pending_size >= _SPOOL_WRITE:
                            pending.append(b"")
                            spool.write(b"\n".join(pending))
                            pending.clear()
                            pending_size = 0
                    break
                except RequestsAgain:  # a later `requests` array: it replaces what was spooled
                    spool.seek(0)
                    spool.truncate()
                    pending.clear()
                    pending_size = 0
            if pending:
                pending.append(b"")
                spool.write(b"\n".join(pending))
        except BaseException:
            spool.close()
            raise
        return Submission(self.top, self.count, spool, self.sha256)


def read_submission(raw_stream, limit: int, keep: int) -> Submission:
    """Parse the body once, as a stream; RelayError(400) on malformed JSON or an oversized body."""
    return SubmissionReader(raw_stream, limit, keep).spooled()
