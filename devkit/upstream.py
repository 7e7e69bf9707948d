"""A DEMO / TEST upstream that speaks the providers' wire formats. Not a model.

It answers OpenAI Chat Completions, Completions, Embeddings and Responses, and
Anthropic Messages with canned, deterministic replies that echo the prompt and
report token usage in each API's own usage shape. `make run` points the demo
catalog at it so the README's curl examples work offline; the test suite uses
the same server (`tests/fakes.py`) and scripts failures into it.

Scripting (tests): `server.script(key, [Reply(...), ...])` queues replies for
calls made with that API key (or "*" for any); unscripted calls succeed.

Run as a process (`python -m devkit.upstream`, as embedded mode does), it reads:
- RELAY_DEMO_UPSTREAM_DELAY_MS: every answer waits this many milliseconds first (default 0), so a
  demo (or the embedded-mode tests) can watch items pending, running, cancelled or expired;
- RELAY_DEMO_UPSTREAM_DELAY_MATCH: when set, only requests whose raw body contains this text wait.
"""

import json
import os
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from devkit.batches import ProviderBatches
from devkit.clouds import Clouds
from devkit.vertex import Vertex

DEMO_BANNER = "[relay demo upstream: canned reply, not a real model]"


@dataclass
class Reply:
    status: int = 200
    body: dict | None = None  # None: the normal canned success body
    headers: dict = field(default_factory=dict)
    delay: float = 0.0  # seconds before answering
    drip_seconds: float = 0.0  # send the body one byte at a time over this long
    hang: bool = False  # accept and never answer (until the server stops)
    gate: threading.Event | None = None  # hold the answer until the test opens the gate
    raw: bytes | None = None  # the body byte for byte (a provider's own escaping), instead of `body`
    # A streamed answer (`"stream": true`): seconds between two of its events, and a gate that holds
    # every event after the first content one until the test opens it (a provider gone quiet mid-stream).
    event_delay: float = 0.0
    stream_gate: threading.Event | None = None


def _tokens(text: str) -> int:
    return max(1, len(text.split()))


def _prompt_text(body: dict) -> str:
    if "messages" in body:
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content")
            if isinstance(content, list):
                parts.extend(c.get("text", "") for c in content if isinstance(c, dict))
            elif content is not None:
                parts.append(str(content))
        return " ".join(parts)
    for key in ("prompt", "input"):
        if key in body:
            value = body[key]
            return value if isinstance(value, str) else json.dumps(value)
    return ""


def canned(path: str, body: dict) -> dict:
    """A success body in the API's own shape, with that API's usage fields."""
    model = body.get("model", "demo")
    prompt = _prompt_text(body)
    answer = f"{DEMO_BANNER} you said: {prompt[:200]}"
    pin, pout = _tokens(prompt), _tokens(answer)
    if path.endswith("/messages/count_tokens"):
        return {"input_tokens": pin}  # Anthropic's count: no usage block, nothing billed
    if path.endswith("/chat/completions"):
        return {
            "id": "chatcmpl-demo",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}],
            "usage": {
                "prompt_tokens": pin,
                "completion_tokens": pout,
                "total_tokens": pin + pout,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }
    if path.endswith("/completions"):
        return {
            "id": "cmpl-demo",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": answer, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": pin, "completion_tokens": pout, "total_tokens": pin + pout},
        }
    if path.endswith("/embeddings"):
        inputs = body.get("input")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        return {
            "object": "list",
            "model": model,
            "data": [
                {"object": "embedding", "index": i, "embedding": [0.1 * (i + 1), 0.2, 0.3]} for i in range(len(inputs))
            ],
            "usage": {"prompt_tokens": pin, "total_tokens": pin},
        }
    if path.endswith("/responses"):
        return {
            "id": "resp_demo",
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": answer}],
                }
            ],
            "usage": {
                "input_tokens": pin,
                "output_tokens": pout,
                "total_tokens": pin + pout,
                "input_tokens_details": {"cached_tokens": 0},
            },
        }
    if path.endswith("/messages"):
        return {
            "id": "msg_demo",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": answer}],
            "stop_reason": "end_turn",
            "usage": {
                "input_tokens": pin,
                "output_tokens": pout,
                "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0,
            },
        }
    return {"error": {"message": f"unknown path {path}", "type": "invalid_request_error"}}


# --- streamed answers: each provider's own server-sent events ---------------------------------------

STREAMED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


def _sse(data: dict, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _deltas(text: str) -> list[str]:
    """The answer in the pieces a model would stream: one word (and its space) each."""
    words = text.split(" ")
    return [w + " " for w in words[:-1]] + [words[-1]]


def canned_events(path: str, body: dict) -> tuple[list[bytes], int]:
    """The streamed form of `canned(path, body)`: (its events, the index of the first content event), in
    the API's own event format with its own usage events. OpenAI's chunk shapes report usage in a final
    chunk of their own only when `stream_options.include_usage` asks for it, as OpenAI does."""
    whole = canned(path, body)
    model = whole.get("model", "demo")
    options = body.get("stream_options")
    with_usage = isinstance(options, dict) and options.get("include_usage") is True
    if path.endswith("/chat/completions") or path.endswith("/completions"):
        chat = path.endswith("/chat/completions")
        answer = whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"]
        base = {"id": whole["id"], "object": "chat.completion.chunk" if chat else "text_completion"}
        base.update(created=whole["created"], model=model)
        extra = {"usage": None} if with_usage else {}

        def chunk(piece: str | None, finish: str | None = None, role: bool = False) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": piece} if piece else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
            return _sse({**base, "choices": [choice], **extra})

        events = [chunk(None, role=True)] if chat else []
        first = len(events)
        events += [chunk(piece) for piece in _deltas(answer)]
        events.append(chunk(None, finish="stop"))
        if with_usage:
            events.append(_sse({**base, "choices": [], "usage": whole["usage"]}))
        events.append(b"data: [DONE]\n\n")
        return events, first
    if path.endswith("/responses"):
        answer = whole["output"][0]["content"][0]["text"]
        text_part = {"type": "output_text", "text": "", "annotations": []}
        item = {"id": "msg_demo", "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        shell = {
            "id": whole["id"],
            "object": "response",
            "created_at": whole["created_at"],
            "model": model,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "metadata": {},
            "output": [],
            "parallel_tool_calls": True,
            "temperature": 1.0,
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "text": {"format": {"type": "text"}},
            "usage": None,
        }
        done_part = dict(text_part, text=answer)
        done_item = dict(item, status="completed", content=[done_part])
        where = {"item_id": "msg_demo", "output_index": 0, "content_index": 0}
        steps = [
            ("response.created", {"response": shell}),
            ("response.in_progress", {"response": shell}),
            ("response.output_item.added", {"output_index": 0, "item": item}),
            ("response.content_part.added", {**where, "part": text_part}),
        ]
        first = len(steps)
        steps += [("response.output_text.delta", {**where, "delta": d, "logprobs": []}) for d in _deltas(answer)]
        steps += [
            ("response.output_text.done", {**where, "text": answer, "logprobs": []}),
            ("response.content_part.done", {**where, "part": done_part}),
            ("response.output_item.done", {"output_index": 0, "item": done_item}),
            (
                "response.completed",
                {"response": dict(shell, status="completed", output=[done_item], usage=whole["usage"])},
            ),
        ]
        return [_sse({"type": name, "sequence_number": i, **data}, name) for i, (name, data) in enumerate(steps)], first
    if path.endswith("/messages"):
        answer = whole["content"][0]["text"]
        usage = whole["usage"]
        start = {k: v for k, v in whole.items() if k not in ("content", "stop_reason", "usage")}
        start.update(content=[], stop_reason=None, stop_sequence=None, usage=dict(usage, output_tokens=1))
        steps = [
            ("message_start", {"message": start}),
            ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            ("ping", {}),
        ]
        first = len(steps)
        steps += [
            ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": d}}) for d in _deltas(answer)
        ]
        steps += [
            ("content_block_stop", {"index": 0}),
            (
                "message_delta",
                {
                    "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                    "usage": {"output_tokens": usage["output_tokens"]},
                },
            ),
            ("message_stop", {}),
        ]
        return [_sse({"type": name, **data}, name) for name, data in steps], first
    raise ValueError(f"{path} does not stream")


KNOWN_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
)


def openai_limit_headers(limit, remaining: int, reset_ms: int) -> dict:
    """OpenAI's request-quota headers, as it sends them on every answer."""
    return {
        "x-ratelimit-limit-requests": limit,
        "x-ratelimit-remaining-requests": remaining,
        "x-ratelimit-reset-requests": f"{reset_ms}ms",
    }


class DemoUpstream(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host="127.0.0.1", port=0):
        super().__init__((host, port), _Handler)
        self.lock = threading.Lock()
        self.scripts: dict[str, deque] = {}
        self.received: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.closed_by_client = 0  # held requests whose caller closed the connection
        # Provider-style rate limiting (tests): requests per second per API key, fixed 1 s windows.
        self.rate_per_key: int | None = None
        self.rate_window = 1.0
        self.rate_windows: dict[str, tuple[int, int]] = {}
        self.rate_stats = {"ok": 0, "limited": 0}
        # Standing answers (tests): a request whose body contains the text always gets the reply.
        self.rules: list[list] = []  # [text, reply, times left (None: always)]
        # The providers' batch APIs (OpenAI Files + Batches, Anthropic Message Batches): devkit.batches.
        self.batches = ProviderBatches(self, canned, KNOWN_PATHS)
        # The clouds' OpenAI-wire endpoints (Azure OpenAI, the Gemini API): devkit.clouds.
        self.clouds = Clouds()
        # Google Vertex AI: its token endpoint, Cloud Storage and batch jobs, and its live calls: devkit.vertex.
        self.vertex = Vertex(self)
        self.stopping = threading.Event()
        self._thread = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def script(self, key: str, replies: list[Reply]) -> None:
        with self.lock:
            self.scripts.setdefault(key, deque()).extend(replies)

    def reset(self) -> None:
        with self.lock:
            self.scripts.clear()
            self.received.clear()
            self.max_in_flight = self.in_flight
            self.closed_by_client = 0
            self.rate_per_key = None
            self.rate_windows.clear()
            self.rate_stats = {"ok": 0, "limited": 0}
            self.rules.clear()
        self.batches.reset()
        self.clouds.reset()
        self.vertex.reset()

    def answer_when(self, text: str, reply: Reply, times: int | None = None) -> None:
        """Requests whose raw body contains `text` get `reply`: every one, or the next `times` of them."""
        with self.lock:
            self.rules.append([text, reply, times])

    def rule_for(self, raw: bytes) -> Reply | None:
        with self.lock:
            for rule in self.rules:
                text, reply, left = rule
                if text.encode() in raw and left != 0:
                    if left is not None:
                        rule[2] = left - 1
                    return reply
        return None

    def limit_rate(self, per_window: int | None, window: float = 1.0) -> None:
        """Enforce `per_window` requests per API key per fixed `window` seconds like a provider: 429 with
        Retry-After beyond it, and OpenAI's x-ratelimit-* headers on every answer. None turns it off."""
        with self.lock:
            self.rate_per_key = per_window
            self.rate_window = window
            self.rate_windows.clear()
            self.rate_stats = {"ok": 0, "limited": 0}

    def rate_decision(self, key: str) -> tuple[bool, dict]:
        """(allowed, headers) for one request under the rate limit; (True, {}) when there is none."""
        now = time.time()
        with self.lock:
            limit = self.rate_per_key
            if limit is None:
                return True, {}
            size = self.rate_window
            window = int(now // size)
            start, count = self.rate_windows.get(key, (window, 0))
            if start != window:
                count = 0
            allowed = count < limit
            if allowed:
                count += 1
            self.rate_windows[key] = (window, count)
            self.rate_stats["ok" if allowed else "limited"] += 1
        reset_ms = max(1, int(((window + 1) * size - now) * 1000))
        headers = openai_limit_headers(limit, limit - count, reset_ms)
        if not allowed:
            headers["Retry-After"] = max(1, -(-reset_ms // 1000))
        return allowed, headers

    def next_reply(self, key: str) -> Reply:
        with self.lock:
            for k in (key, "*"):
                q = self.scripts.get(k)
                if q:
                    return q.popleft()
        return Reply()

    def start(self) -> "DemoUpstream":
        self._thread = threading.Thread(target=self.serve_forever, name="demo-upstream", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: DemoUpstream
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two send() calls; with Nagle on, the body waits for
    # the client's delayed ACK (~40 ms on Linux), a stall no real provider adds.
    disable_nagle_algorithm = True
    # Headers a cloud fake adds to this request's answer (devkit.clouds: Azure's quota headers).
    extra_headers: dict = {}  # noqa: RUF012 - replaced per request, never mutated
    # A cloud fake's framing of streamed events and its content type (devkit.clouds: Bedrock's event stream).
    frame = None
    frame_type = ""

    def log_message(self, fmt, *args):  # keep test output quiet
        pass

    def do_POST(self):
        if self.server.batches.handles(self.path):
            return self.server.batches.serve(self)
        if self.server.vertex.handles(self.path):
            return self.server.vertex.serve(self)
        srv = self.server
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = {}
        key = self.headers.get("x-api-key") or self.headers.get("Authorization", "").removeprefix("Bearer ")
        asked, cloud = self.path, None
        gate = (
            srv.clouds if srv.clouds.handles(self.path) else srv.vertex if srv.vertex.handles_live(self.path) else None
        )
        if gate is not None:  # a cloud's path: checked as its provider does, answered as the call it carries
            cloud = gate.admit(self.path, self.headers, body, raw)
            key, self.path = cloud.key, cloud.path or self.path
        with srv.lock:
            srv.received.append({"path": asked, "headers": dict(self.headers.items()), "body": body, "key": key})
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        try:
            if cloud is not None and cloud.refusal is not None:
                srv.clouds.refuse(self, cloud.refusal)
            else:
                self.extra_headers = cloud.headers if cloud is not None else {}
                self.frame, self.frame_type = (cloud.frame, cloud.content_type) if cloud is not None else (None, "")
                self._answer(srv, key, body, raw)
        finally:
            with srv.lock:
                srv.in_flight -= 1

    def do_GET(self):  # only the batch APIs (and Vertex's storage and jobs) answer GET
        if self.server.batches.handles(self.path):
            return self.server.batches.serve(self)
        if self.server.vertex.handles(self.path):
            return self.server.vertex.serve(self)
        self.send_error(501, f"Unsupported method ({self.command!r})")

    def do_DELETE(self):
        if self.server.batches.handles(self.path):
            return self.server.batches.serve(self)
        if self.server.vertex.handles(self.path):
            return self.server.vertex.serve(self)
        self.send_error(501, f"Unsupported method ({self.command!r})")

    def do_PUT(self):  # the S3 stand-in of the fake Bedrock batch inference (devkit.batches.bedrock)
        if self.server.batches.handles(self.path):
            return self.server.batches.serve(self)
        self.send_error(501, f"Unsupported method ({self.command!r})")

    def _hold(self, event: threading.Event, timeout: float) -> bool:
        """Wait for `event`, noticing a client that closes the connection meanwhile (False), as a
        provider does: a held request whose caller gave up stops counting as in flight."""
        deadline = time.monotonic() + timeout
        while not event.wait(0.05):
            if time.monotonic() >= deadline:
                return True
            readable, _, _ = select.select([self.connection], [], [], 0)
            if readable:
                try:
                    if self.connection.recv(1, socket.MSG_PEEK) == b"":
                        with self.server.lock:
                            self.server.closed_by_client += 1
                        return False
                except OSError:
                    return False
        return True

    def _answer(self, srv: DemoUpstream, key: str, body: dict, raw: bytes = b""):
        allowed, limit_headers = srv.rate_decision(key)
        limit_headers = {**self.extra_headers, **limit_headers}
        if not allowed:
            reply = Reply(
                status=429,
                body={
                    "error": {
                        "message": "Rate limit reached for requests",
                        "type": "requests",
                        "code": "rate_limit_exceeded",
                    }
                },
                headers=limit_headers,
            )
        else:
            reply = srv.rule_for(raw) or srv.next_reply(key)
            reply = Reply(**{**reply.__dict__, "headers": {**limit_headers, **reply.headers}})
        if reply.hang:
            self._hold(srv.stopping, 600)
            return
        if reply.gate is not None and not self._hold(reply.gate, 120):
            return
        if reply.delay:
            srv.stopping.wait(reply.delay)
        if self.path not in KNOWN_PATHS and reply.body is None and reply.raw is None:
            reply = Reply(status=404, body={"error": {"message": f"no route {self.path}", "type": "not_found"}})
        asked = body.get("stream") is True or self.frame is not None  # Bedrock: the path asks, not the body
        streamed = asked and reply.body is None and reply.raw is None and reply.status == 200
        try:
            if streamed and self.path in STREAMED_PATHS:
                return self._stream(srv, reply, *canned_events(self.path, body))
            answer = reply.body if reply.body is not None else canned(self.path, body)
        except (AttributeError, TypeError, ValueError, KeyError):  # a malformed body: a provider answers 400
            reply = Reply(status=400)
            answer = {"error": {"message": "malformed request body", "type": "invalid_request_error"}}
        payload = reply.raw if reply.raw is not None else json.dumps(answer).encode()
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for name, value in reply.headers.items():
            self.send_header(name, str(value))
        self.end_headers()
        if reply.drip_seconds:
            step = reply.drip_seconds / max(1, len(payload))
            for i in range(len(payload)):
                if srv.stopping.is_set():
                    return
                self.wfile.write(payload[i : i + 1])
                self.wfile.flush()
                time.sleep(step)
        else:
            self.wfile.write(payload)

    def _stream(self, srv: DemoUpstream, reply: Reply, events: list[bytes], first: int) -> None:
        """The events as a provider sends them: `text/event-stream`, chunked, one write per event. A caller
        that closes the connection mid-stream ends it (and counts in `closed_by_client`), as a provider
        stops generating for a caller who left."""
        self.send_response(200)
        self.send_header("Content-Type", self.frame_type or "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        for name, value in reply.headers.items():
            self.send_header(name, str(value))
        self.end_headers()
        try:
            for i, event in enumerate(events):
                if srv.stopping.is_set():
                    return
                if i and reply.event_delay:
                    time.sleep(reply.event_delay)
                if i == first + 1 and reply.stream_gate is not None and not self._hold(reply.stream_gate, 120):
                    return  # the caller left while the stream was quiet (counted by _hold)
                event = self.frame(event) if self.frame is not None else event
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            with srv.lock:
                srv.closed_by_client += 1
            self.close_connection = True


def main():  # pragma: no cover - the embedded launcher runs it
    import argparse

    parser = argparse.ArgumentParser(description="Relay demo upstream (canned replies, not a model)")
    parser.add_argument("--port", type=int, default=8090)
    args = parser.parse_args()
    server = DemoUpstream(port=args.port)
    delay_ms = int(os.environ.get("RELAY_DEMO_UPSTREAM_DELAY_MS") or 0)
    if delay_ms > 0:
        # "" is in every body: without a match, every answer waits.
        server.answer_when(os.environ.get("RELAY_DEMO_UPSTREAM_DELAY_MATCH", ""), Reply(delay=delay_ms / 1000))
    print(f"demo upstream on {server.url} — canned replies, not a real model", flush=True)
    server.serve_forever()


if __name__ == "__main__":  # pragma: no cover
    main()
