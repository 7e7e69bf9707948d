"""The project's fake provider (relay.demo_upstream), tuned for benchmarks and run as its own process.

    python -m bench.fake_upstream [--delay-ms 100]

Binds 127.0.0.1 on a free port (port 0) and prints `READY http://127.0.0.1:<port>` on stdout.
Differences from the plain demo upstream, all for benchmarking:
- every reply waits `delay` seconds (changeable at run time: POST /_bench/config {"delay_ms": 100});
- it keeps no copy of the requests it saw (the test server records them all: 50,000 would grow memory);
- a listen backlog of 512 (socketserver's default of 5 drops SYNs under bursts, which costs a 1 s retry);
- GET /_bench/stats → {"requests", "max_in_flight", "in_flight"}; POST /_bench/reset zeroes them.
It stays a ThreadingHTTPServer (one thread per connection), like the suite's fake.
"""

import argparse
import json
import signal
import sys
from collections import deque

from relay.demo_upstream import DemoUpstream, Reply, _Handler


class BenchUpstream(DemoUpstream):
    request_queue_size = 512

    def __init__(self, host: str = "127.0.0.1", port: int = 0, delay: float = 0.0):
        super().__init__(host, port)
        self.RequestHandlerClass = _BenchHandler
        self.delay = delay
        self.received = deque(maxlen=0)  # appends are dropped: constant memory
        self.count = 0

    def next_reply(self, key: str) -> Reply:
        with self.lock:
            self.count += 1
        return Reply(delay=self.delay)


class _BenchHandler(_Handler):
    server: BenchUpstream

    def _json(self, status: int, obj: dict) -> None:
        payload = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _stats(self) -> dict:
        srv = self.server
        with srv.lock:
            return {"requests": srv.count, "max_in_flight": srv.max_in_flight, "in_flight": srv.in_flight}

    def do_GET(self):
        if self.path == "/_bench/stats":
            return self._json(200, self._stats())
        return self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self):
        if not self.path.startswith("/_bench/"):
            return super().do_POST()
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        srv = self.server
        if self.path == "/_bench/config":
            srv.delay = float(body.get("delay_ms", srv.delay * 1000)) / 1000.0
            return self._json(200, {"delay_ms": srv.delay * 1000})
        if self.path == "/_bench/reset":
            with srv.lock:
                srv.count = 0
                srv.max_in_flight = srv.in_flight
            return self._json(200, self._stats())
        return self._json(404, {"error": {"message": f"no route {self.path}"}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    server = BenchUpstream(port=args.port, delay=args.delay_ms / 1000.0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"READY {server.url}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.stopping.set()
        server.server_close()


if __name__ == "__main__":
    main()
