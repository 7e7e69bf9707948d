"""A webhook receiver for the tests: a real HTTP server on loopback that keeps every request it gets
(headers and raw body) and answers what the test scripts (a status, a delay, a redirect)."""

import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    path: str
    headers: dict
    body: bytes
    at: float  # time.time() when it arrived


class Receiver:
    def __init__(self):
        self.received: list[Received] = []
        self.script: deque = deque()  # (status, delay seconds, extra headers, body) per request, then `default`
        self.default = (200, 0.0, {}, b"ok")
        self.hold = threading.Event()  # while clear, a request with delay=None waits for it
        self.hold.set()
        self.arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, delay, headers, answer = receiver.script.popleft() if receiver.script else receiver.default
                with receiver.arrived:
                    receiver.received.append(
                        Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body, time.time())
                    )
                    receiver.arrived.notify_all()
                if delay is None:
                    receiver.hold.wait(30)
                elif delay:
                    time.sleep(delay)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks"

    def start(self) -> "Receiver":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()

    def wait_for(self, n: int, timeout: float = 15.0) -> list[Received]:
        """Block until at least `n` requests arrived; all of them."""
        deadline = time.monotonic() + timeout
        with self.arrived:
            while len(self.received) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"the receiver got {len(self.received)} requests, not {n}, in {timeout}s")
                self.arrived.wait(left)
            return list(self.received)
