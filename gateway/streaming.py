"""Streamed live calls: server-sent events passed through in the provider's own format.

What a streamed call adds to a live one (gateway.inference answers it, gateway.pipeline makes it):

- `upstream_body()`: OpenAI's chat and completions streams report usage only when asked
  (`stream_options.include_usage`), so the relay always asks, and remembers whether the client did;
- `Events`: the stream is cut into whole events as it arrives and passed on, byte for byte, as soon as
  an event is complete (a TCP read may end mid-event; a client never gets half of one). On the side,
  the usage the provider reported so far is read from the few events that carry it (OpenAI's final
  chunk, Responses' `response.completed`, Anthropic's `message_start` and `message_delta`); the
  usage-only chunk the client did not ask for is dropped. The text of the content deltas is measured on
  the side too, so a stream that ends before the provider's usage (the client hangs up, the stream breaks)
  is billed an estimate rather than nothing (`Events.relayed_output`, gateway.pipeline.finish_stream);
- `relay()`: the body of the streamed answer, which closes the upstream call and records the usage
  event (once, through gateway.pipeline.finish_stream) when the stream ends, breaks, or the client
  hangs up.

Every other event is passed on without being parsed: the few that may carry usage are found by a byte
search first, and a delta's text is measured by byte searches for its few field names, so a long stream
costs a few searches per event, not one JSON parse.
"""

import atexit
import logging
import os
import queue
import re
import select
import socket
import threading
from collections.abc import Iterator

import orjson

from core import scrub
from gateway import pipeline, upstream
from usage.tokens import CHARS_PER_TOKEN, Tokens, parse_usage

log = logging.getLogger(__name__)

# Inbound paths that stream (the providers stream these and nothing else: not embeddings, not counting).
STREAMED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
# OpenAI's chunk shapes, whose usage comes in a final chunk of its own when asked for.
_CHUNK_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

# An event's end: a blank line. Only where it ends is used, so the pattern starts at its first `\n` (the
# same ends as `\r?\n\r?\n`): with a literal first, the regex engine skips to each `\n` at C speed (4.3 us
# a chunk scanned before, 0.2 us now).
_EVENT_END = re.compile(rb"\n\r?\n")
# A usage object in an event's data: the only events worth parsing (`"usage": null` is not one).
_HAS_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_IS_ERROR = re.compile(rb'^event:\s*error|"error"\s*:\s*\{|"type"\s*:\s*"(?:error|response\.failed)"', re.M)
# Every match of _IS_ERROR holds one of these: two byte searches first (1 us a chunk), the pattern (14 us a
# chunk: no literal to skip to) only on an event that holds one.
_ERROR_WORDS = (b"error", b"response.failed")
# Where each stream shape carries generated text (answer, tool-call arguments, refusals, reasoning), in the
# events that add to it: chat chunks' deltas, completions' choices, Responses' `response.*.delta` events
# (`delta` is a string only there; the `.done` and `response.completed` events repeat the whole text under
# other names), Anthropic's `content_block_delta` (gated by name: `content_block_start` may hold text too).
# Found by plain byte search (compact JSON, as the providers send it, and with a space after the colon).
_DELTA_FIELDS = {
    "/v1/chat/completions": ("content", "arguments", "refusal", "reasoning_content", "reasoning"),
    "/v1/completions": ("text",),
    "/v1/responses": ("delta",),
    "/v1/messages": ("text", "partial_json", "thinking"),
}
_DELTA_KEYS = {path: tuple(f'"{name}":"'.encode() for name in names) for path, names in _DELTA_FIELDS.items()}
_DELTA_KEYS_SPACED = {path: tuple(f'"{name}": "'.encode() for name in names) for path, names in _DELTA_FIELDS.items()}
_ANTHROPIC_DELTA = b"content_block_delta"
# Responses' audio deltas carry base64 audio under `delta`, not text: not measured as text.
_AUDIO_DELTA = b'"response.audio.delta"'
# An event longer than this without its end is passed on as it is, unparsed: the relay holds at most
# this much of one event, whatever an upstream sends.
MAX_EVENT_BYTES = 1024 * 1024
# What the relay takes in one go when events are already waiting (it fell behind the provider).
COALESCE_BYTES = 64 * 1024


def upstream_body(path: str, body: dict) -> tuple[dict, bool]:
    """(the body to send upstream, whether the client asked for usage itself). On OpenAI's chunk shapes
    `stream_options.include_usage` is set: the relay bills from the provider's count, never a guess."""
    if path not in _CHUNK_PATHS:
        return body, True
    options = body.get("stream_options")
    asked = isinstance(options, dict) and options.get("include_usage") is True
    if asked:
        return body, True
    options = dict(options) if isinstance(options, dict) else {}
    options["include_usage"] = True
    return dict(body, stream_options=options), False


class Events:
    """Cuts a stream into whole SSE events, reads usage on the side, drops what the client must not see."""

    def __init__(self, adapter: str, path: str, *, strip_usage_chunk: bool):
        self.adapter = adapter
        self.path = path
        self.strip_usage_chunk = strip_usage_chunk and path in _CHUNK_PATHS
        self.tokens = Tokens()
        # Whether the provider's own final count arrived (OpenAI's usage chunk, Responses' closing event,
        # Anthropic's message_delta): until it does, `tokens` is at most Anthropic's opening count.
        self.final = False
        # Output tokens of the deltas passed on so far, estimated from their text (`_measure`).
        self.relayed_output = 0
        self._delta_keys = _DELTA_KEYS.get(path, ())
        self._delta_keys_spaced = _DELTA_KEYS_SPACED.get(path, ())
        self.error = ""  # an error event the provider sent mid-stream (its first 500 bytes)
        self._anthropic_usage: dict = {}
        self._pending = b""
        self._skipping = False  # inside an oversized event: passed on until its end

    def feed(self, data: bytes) -> bytes:
        """What of the stream so far can go to the client now: every event completed by `data`."""
        pending = self._pending + data if self._pending else data
        out = []
        start = 0
        while True:
            end = _EVENT_END.search(pending, start)
            if end is None:
                break
            event = pending[start : end.end()]
            start = end.end()
            if self._skipping:
                self._skipping = False
                out.append(event)
            elif self._keep(event):
                out.append(event)
        rest = pending[start:]
        if len(rest) > MAX_EVENT_BYTES:
            out.append(rest)  # not an event the relay can read: passed on as it came
            rest, self._skipping = b"", True
        self._pending = rest
        if not out:
            return b""
        return out[0] if len(out) == 1 else b"".join(out)

    def flush(self) -> bytes:
        """The end of the stream: what is left (an event without its blank line), parsed and passed on."""
        rest, self._pending = self._pending, b""
        if rest and not self._skipping and not self._keep(rest):
            return b""
        return rest

    def _measure(self, event: bytes) -> None:
        """Add the output tokens of a delta event's text to `relayed_output`. Each non-empty text counts at
        least one token (OpenAI streams one token per chunk), a longer one a token per CHARS_PER_TOKEN bytes
        (Anthropic's deltas carry several tokens each), rounded down because a one-token chunk is often five
        to seven characters (a leading space, a word, punctuation). Bytes of the JSON text, escapes and all:
        no decoding, and a non-Latin character (two or three UTF-8 bytes, often a token of its own) is not
        undercounted by much. Measured against the fake provider's counts in tests/test_stream_estimate.py."""
        if not self._delta_keys or (self.adapter == "anthropic" and _ANTHROPIC_DELTA not in event):
            return
        if self.path == "/v1/responses" and _AUDIO_DELTA in event:
            return
        for key in self._delta_keys if b'": "' not in event else self._delta_keys + self._delta_keys_spaced:
            at = event.find(key)
            while at != -1:
                begin = at + len(key)
                end = _string_end(event, begin)
                if end == -1:
                    break
                if end > begin:
                    self.relayed_output += max(1, (end - begin) // CHARS_PER_TOKEN)
                at = event.find(key, end + 1)

    def _keep(self, event: bytes) -> bool:
        has_usage = _HAS_USAGE.search(event) is not None
        if not self.error and (_ERROR_WORDS[0] in event or _ERROR_WORDS[1] in event) and _IS_ERROR.search(event):
            self.error = event[:500].decode("utf-8", "replace").strip()
        if not has_usage:
            self._measure(event)
            return True
        data = _data(event)
        try:
            value = orjson.loads(data) if data else None
        except orjson.JSONDecodeError:
            return True
        if not isinstance(value, dict):
            return True
        if self.adapter == "anthropic":
            self._anthropic(value)
            return True
        if isinstance(value.get("response"), dict):  # Responses: response.completed / .incomplete / .failed
            if isinstance(value["response"].get("usage"), dict):
                self.tokens = parse_usage(self.adapter, self.path, value["response"])
                self.final = True
            return True
        self._measure(event)  # a chunk may carry the last delta and the usage together
        if isinstance(value.get("usage"), dict):
            self.tokens = parse_usage(self.adapter, self.path, value)
            self.final = True
            if self.strip_usage_chunk and value.get("choices") == []:
                return False  # the usage-only chunk the relay asked for, not the client
        return True

    def _anthropic(self, value: dict) -> None:
        # message_start carries the input side (and a first output count); each message_delta the
        # cumulative counts so far. The latest value of each field is the provider's count.
        # Only message_delta's count is final (it comes once, at the end).
        usage = value.get("usage")
        if value.get("type") == "message_start" and isinstance(value.get("message"), dict):
            usage = value["message"].get("usage")
        elif value.get("type") == "message_delta" and isinstance(usage, dict):
            self.final = True
        if isinstance(usage, dict):
            self._anthropic_usage.update({k: v for k, v in usage.items() if v is not None})
            self.tokens = parse_usage("anthropic", self.path, {"usage": self._anthropic_usage})


def _string_end(data: bytes, begin: int) -> int:
    """The index of the quote closing the JSON string that starts at `begin` (-1: not in `data`)."""
    end = data.find(b'"', begin)
    while end != -1:
        slashes = 0
        while data[end - 1 - slashes] == 0x5C:  # backslashes before the quote: an odd count escapes it
            slashes += 1
        if not slashes % 2:
            return end
        end = data.find(b'"', end + 1)
    return -1


def _data(event: bytes) -> bytes:
    """The event's data: its `data:` lines joined (one leading space of each dropped, as SSE says)."""
    lines = []
    for line in event.splitlines():
        if line.startswith(b"data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(lines)


def client_gone(sock) -> bool:
    """Whether the client closed its connection (it reads as an end: a zero-byte peek). Called by the
    upstream watchdog while the relay waits on the provider, so a client that hangs up during a silent
    stretch of a stream is noticed within the watchdog's poll, not at the next write. Bytes the client
    sent (a pipelined request) are not an end. Never blocks: the socket is polled first (a socket with a
    timeout would otherwise wait that long in `recv`, whatever the flags)."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        if not poller.poll(0):
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError, TimeoutError):
        return False
    except (OSError, ValueError):
        return True  # reset, or closed under us: gone


def relay(outcome: "pipeline.Outcome", events: Events, record) -> Iterator[bytes]:
    """The streamed answer's body: each piece the provider sends, cut to whole events, as soon as it
    comes. When the generator ends — the provider's end, a broken stream, or the client hanging up
    (the server closes the generator) — the upstream call is closed at once and the usage event goes to
    `record` with what the provider reported so far."""
    stream: upstream.UpstreamStream = outcome.stream.response
    failure = ""
    finished = False
    try:
        while True:
            piece = stream.read()
            if not piece:
                break
            # Behind the provider (events arrive faster than the client takes them): what has arrived goes
            # out in one piece. Caught up: at once, one event at a time.
            while len(piece) < COALESCE_BYTES and stream.more_waiting():
                more = stream.read()
                if not more:
                    break
                piece += more
            out = events.feed(piece)
            if out:
                # No host key leaves (decision 0004), streamed or not.
                yield scrub.scrub_bytes(out, load=False)
        tail = events.flush()
        if tail:
            yield scrub.scrub_bytes(tail, load=False)
        finished = True
    except upstream.UpstreamError as exc:
        # Bytes have gone to the client: no status to change, no key to fail over to. The stream ends
        # where it broke; the event records why.
        failure = exc.kind
        log.warning("request %s: the upstream stream ended early: %s: %s", outcome.event["request_id"], exc.kind, exc)
    finally:
        stream.close()
        if not finished and not failure:
            failure = "client_gone"  # GeneratorExit: the server closed the answer mid-stream
        try:
            # Without the provider's final count the stream is billed an estimate, unless the provider ended
            # it with an error event of its own (it reports what it bills for those, or bills nothing).
            relayed = None if events.final or (finished and events.error) else events.relayed_output
            record(
                pipeline.finish_stream(
                    outcome, events.tokens, failure=failure, stream_error=events.error, relayed_output=relayed
                )
            )
        except Exception:  # the server swallows what a closing generator raises: say it
            log.exception("request %s: the stream's usage could not be settled", outcome.event["request_id"])


# --- the usage events of streams ------------------------------------------------------------------
# A stream's event is written by one writer thread per process, not by the thread that served the
# stream: the web server runs many threads so that streams do not starve other requests
# (docs/decisions/0016-streaming-server-model.md), and 200 streams ending together must not open 200
# PostgreSQL connections (the server's limit is 100 by default). The writer keeps one connection,
# closed again after WRITER_IDLE_S without work; at exit it writes what is queued.

WRITER_IDLE_S = 5.0
_queue: "queue.SimpleQueue | None" = None
_writer_pid: int | None = None
_writer_lock = threading.Lock()


def record_later(event: dict) -> None:
    """Queue a stream's usage event for the process's writer thread (started at the first event)."""
    global _queue, _writer_pid
    with _writer_lock:
        if _writer_pid != os.getpid():  # first event in this process (or a forked child)
            _queue, _writer_pid = queue.SimpleQueue(), os.getpid()
            threading.Thread(target=_write_events, args=(_queue,), name="stream-usage-writer", daemon=True).start()
            atexit.register(_drain, _queue)
        q = _queue
    q.put(event)


def _write_events(q: "queue.SimpleQueue") -> None:
    from django.db import connections

    while True:
        try:
            event = q.get(timeout=WRITER_IDLE_S)
        except queue.Empty:
            connections.close_all()  # this thread's: no connection held while nothing streams
            continue
        if event is None:
            return
        _write(event)


def _write(event: dict) -> None:
    from usage import budgets
    from usage.services import record_event

    try:
        record_event(**event, fetch=False)
    except Exception:
        _close_broken_connection()
        log.exception("usage event %s of a stream could not be recorded", event.get("request_id"))
    try:
        # What the provider reported is billed, however the stream ended: charged to the caller's budgets.
        budgets.charge_event(event)
    except Exception:
        _close_broken_connection()
        log.exception("request %s: the stream's cost could not be charged to its budgets", event.get("request_id"))


def _close_broken_connection() -> None:
    """After a failed write the connection may be broken (PostgreSQL restarted): the next event opens another."""
    from django.db import connections

    for connection in connections.all(initialized_only=True):
        connection.close_if_unusable_or_obsolete()


def _drain(q: "queue.SimpleQueue") -> None:
    """At the process's exit (a web worker recycled or stopped): what is queued is written, not lost."""
    while True:
        try:
            event = q.get_nowait()
        except queue.Empty:
            return
        if event is not None:
            _write(event)
