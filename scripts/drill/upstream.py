"""The drill's fake provider: the project's canned OpenAI and Anthropic answers (devkit.upstream.canned),
each after a delay, each tagged with the address of the host that asked (`"drill": {"peer": …}` in the
body). The tag is what lets the drill tell, from a stored result, which host's call wrote it: a result
written by a host whose claim had been taken from it is a late write the fence let through.

    python -m drill.upstream --host 10.231.0.1 --port 8900 --delay-ms 500

GET /_drill/calls → {"calls": {marker: {peer: n}}}: calls per item marker (the `drill-…` word of the
prompt) and per calling host. Prints `READY <url>` once listening."""

import argparse
import json
import logging
import re
import signal
import sys
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from devkit.upstream import _prompt_text, canned

log = logging.getLogger(__name__)

MARKER = re.compile(r"drill-[A-Za-z0-9_-]+")
PATHS = ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions", "/v1/embeddings")


class DrillUpstream(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 512

    def __init__(self, host: str, port: int, delay: float):
        super().__init__((host, port), _Handler)
        self.delay = delay
        self.lock = threading.Lock()
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def record(self, marker: str, peer: str) -> None:
        with self.lock:
            self.calls[marker][peer] += 1


class _Handler(BaseHTTPRequestHandler):
    server: DrillUpstream
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body in two send()s: no delayed-ACK stall

    def log_message(self, fmt, *args):
        pass

    def _send(self, status: int, obj: dict) -> None:
        payload = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):
        if self.path == "/_drill/calls":
            with self.server.lock:
                calls = {m: dict(p) for m, p in self.server.calls.items()}
            return self._send(200, {"calls": calls})
        return self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return self._send(400, {"error": {"message": "malformed request body", "type": "invalid_request_error"}})
        if self.path not in PATHS:
            return self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
        peer = self.client_address[0]
        found = MARKER.search(_prompt_text(body))
        self.server.record(found.group(0) if found else "-", peer)
        if self.server.delay:
            time.sleep(self.server.delay)
        answer = canned(self.path, body)
        answer["drill"] = {"peer": peer}
        self._send(200, answer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, default=500.0)
    args = parser.parse_args()
    server = DrillUpstream(args.host, args.port, args.delay_ms / 1000.0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"READY http://{args.host}:{args.port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
