"""The noisy-neighbour drill's fake provider (bench/noisy.py): the benchmarks' fake (bench/fake_upstream.py:
devkit.upstream with the providers' batch APIs) plus what the drill must see from the provider's side.

    python -m bench.noisy_upstream        prints `READY http://127.0.0.1:<port>` on stdout

- A request whose body holds SLOW_MARKER is held until its caller gives up (a model thinking for longer than
  the relay's RELAY_UPSTREAM_READ_TIMEOUT); it is never answered.
- A streamed chat call whose body holds STREAM_MARKER-<tag> gets a long answer, CHUNK_WORDS words per event,
  one event every EVENT_GAP s, and the server notes how much it had produced when the caller closed the
  connection (it looks for the close between two events, so nothing counts that the caller never read).
- The caller headers a tenant must not choose (PROBED_HEADERS) are noted on every request, the batch APIs'
  included, so the drill can tell which reached the provider.

GET /_noisy/seen → {"headers": [{"path", "header", "value"}…], "streams": {tag: {…}}, "slow_closed": n}.
"""

import argparse
import json
import select
import socket
import threading
import time

from bench.fake_upstream import BenchUpstream, _BenchHandler, serve

SLOW_MARKER = "noisy-slow-thinker"
STREAM_MARKER = "noisy-stream"
PROBED_HEADERS = ("openai-organization", "openai-project", "anthropic-beta")
CHUNK_WORDS = 25
CHUNKS = 80
EVENT_GAP = 0.15
# Three-letter words: one word is one token for every tokenizer the relay might estimate with (a BPE
# vocabulary, or four characters a token), so the provider's count and the relay's estimate compare.
WORDS = "cat dog sun red sky one two big map box hat pen cup art fog ink jam key oak owl".split()


class NoisyUpstream(BenchUpstream):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.RequestHandlerClass = _NoisyHandler
        self.seen_headers: list[dict] = []
        self.streams: dict[str, dict] = {}
        self.slow_closed = 0
        self.never = threading.Event()


def _gone(conn: socket.socket) -> bool:
    """The caller closed its end (EOF is readable) — checked without consuming anything."""
    readable, _, _ = select.select([conn], [], [], 0)
    if not readable:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class _NoisyHandler(_BenchHandler):
    server: NoisyUpstream

    def _note_headers(self) -> None:
        seen = [
            {"path": self.path, "header": name.lower(), "value": value}
            for name, value in self.headers.items()
            if name.lower() in PROBED_HEADERS
        ]
        if seen:
            with self.server.lock:
                self.server.seen_headers.extend(seen)

    def do_GET(self):
        if self.path == "/_noisy/seen":
            srv = self.server
            with srv.lock:
                body = {"headers": list(srv.seen_headers), "streams": dict(srv.streams), "slow_closed": srv.slow_closed}
            return self._json(200, body)
        self._note_headers()
        return super().do_GET()

    def do_POST(self):
        if not self.path.startswith("/_bench/"):
            self._note_headers()
        return super().do_POST()

    def _answer(self, srv, key: str, body: dict, raw: bytes = b""):
        if SLOW_MARKER.encode() in raw:
            self._hold(srv.never, 600)  # returns when the relay gives up and closes the connection
            with srv.lock:
                srv.slow_closed += 1
            self.close_connection = True
            return
        if STREAM_MARKER.encode() in raw and body.get("stream") is True and self.path == "/v1/chat/completions":
            return self._long_stream(srv, body, raw)
        return super()._answer(srv, key, body, raw)

    def _long_stream(self, srv: NoisyUpstream, body: dict, raw: bytes) -> None:
        text = raw.decode(errors="replace")
        start = text.index(STREAM_MARKER)
        tag = text[start : start + 40].split('"')[0].split()[0]
        prompt = " ".join(str(m.get("content", "")) for m in body.get("messages") or [])
        note = {"prompt_words": len(prompt.split()), "chunks": 0, "words": 0, "closed_by_client": False}
        with srv.lock:
            srv.streams[tag] = note
        options = body.get("stream_options")
        with_usage = isinstance(options, dict) and options.get("include_usage") is True
        base = {"id": f"chatcmpl-{tag}", "object": "chat.completion.chunk", "created": int(time.time())}
        base["model"] = body.get("model", "demo")
        extra = {"usage": None} if with_usage else {}

        def event(delta: dict, finish=None, usage=None) -> bytes:
            choices = [] if usage else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
            data = {**base, "choices": choices, **({"usage": usage} if usage else extra)}
            return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

        def send(chunk: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            send(event({"role": "assistant", "content": ""}))
            for i in range(CHUNKS):
                deadline = time.monotonic() + EVENT_GAP
                while time.monotonic() < deadline:
                    if _gone(self.connection) or srv.stopping.is_set():
                        raise BrokenPipeError
                    time.sleep(0.01)
                piece = " ".join(WORDS[(i * CHUNK_WORDS + k) % len(WORDS)] for k in range(CHUNK_WORDS)) + " "
                send(event({"content": piece}))
                with srv.lock:
                    note["chunks"] += 1
                    note["words"] += CHUNK_WORDS
            send(event({}, finish="stop"))
            if with_usage:
                pin, pout = note["prompt_words"], note["words"]
                send(event({}, usage={"prompt_tokens": pin, "completion_tokens": pout, "total_tokens": pin + pout}))
            send(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            with srv.lock:
                note["closed_by_client"] = True
            self.close_connection = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="every other answer waits this long first")
    parser.add_argument("--batch-seconds", type=float, default=1.0, help="how long a provider batch job takes")
    args = parser.parse_args()
    server = NoisyUpstream(port=args.port, delay=args.delay_ms / 1000.0)
    server.batches.job_seconds = args.batch_seconds
    serve(server)


if __name__ == "__main__":
    main()
