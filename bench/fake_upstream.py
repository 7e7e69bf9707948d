"""The project's fake provider (devkit.upstream), tuned for benchmarks and run as its own process.

    python -m bench.fake_upstream [--delay-ms 100]

Binds 127.0.0.1 on a free port (port 0) and prints `READY http://127.0.0.1:<port>` on stdout.
Differences from the plain demo upstream, all for benchmarking:
- every reply waits `delay` seconds (changeable at run time: POST /_bench/config {"delay_ms": 100}), and a
  streamed one `event_delay_ms` between two of its events (POST /_bench/config {"event_delay_ms": 10});
- it keeps no copy of the requests it saw (the test server records them all: 50,000 would grow memory);
- a listen backlog of 512 (socketserver's default of 5 drops SYNs under bursts, which costs a 1 s retry);
- GET /_bench/stats → {"requests", "max_in_flight", "in_flight", "rate_limited", "served_ms_mean"} (the
  mean time from a call's headers read to its answer written); POST /_bench/reset zeroes them;
- per-key rate limiting, like a provider's tier: a key whose value starts with `sk-bench-rl-` may make
  `key_rps` requests per second (sliding 1 s window, default 5; `--key-rps`, or POST /_bench/config
  {"key_rps": 5}); beyond that it gets 429 with `Retry-After` (whole seconds, at least 1) and an
  OpenAI-style `rate_limit_exceeded` error body, as OpenAI answers. Every answer to such a key carries
  OpenAI's `x-ratelimit-{limit,remaining,reset}-requests` headers, as OpenAI's do (`--no-limit-headers`,
  or POST /_bench/config {"limit_headers": false}, leaves them out: a provider that says nothing until
  its 429). Other keys are never limited.
- the providers' batch APIs (devkit.batches, as in the demo upstream; GET and DELETE fall through to it):
  POST /_bench/config {"batch_seconds": 120} sets how long a job takes (default RELAY_DEMO_BATCH_SECONDS), and
  GET /_bench/batches → {"log": [...]} every batch-API request seen ({"t", "method", "path", "op", "job", …}).
It stays a ThreadingHTTPServer (one thread per connection), like the suite's fake.
"""

import argparse
import json
import math
import signal
import sys
import time
from collections import deque

from devkit.upstream import DemoUpstream, Reply, _Handler, openai_limit_headers

LIMITED_PREFIX = "sk-bench-rl-"


class BenchUpstream(DemoUpstream):
    request_queue_size = 512

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, delay: float = 0.0, key_rps: float = 5.0, limit_headers=True
    ):
        super().__init__(host, port)
        self.limit_headers = limit_headers
        self.RequestHandlerClass = _BenchHandler
        self.delay = delay
        self.event_delay = 0.0  # streamed answers: seconds between two events (POST /_bench/config {"event_delay_ms"})
        self.received = deque(maxlen=0)  # appends are dropped: constant memory
        self.count = 0
        # Served latency of provider calls: from the request's headers read to the answer written.
        self.served_s = 0.0
        self.served_n = 0
        self.key_rps = key_rps
        self.rate_limited = 0
        self.accepted_at: dict[str, deque] = {}  # limited key -> times of its accepted requests

    def next_reply(self, key: str) -> Reply:
        with self.lock:
            self.count += 1
            if key.startswith(LIMITED_PREFIX):
                now = time.monotonic()
                wait = self._over_limit(key, now)
                headers = self._limit_headers(key, now)
                if wait is not None:
                    self.rate_limited += 1
                    return Reply(
                        status=429,
                        headers={**headers, "Retry-After": max(1, math.ceil(wait))},
                        body={
                            "error": {
                                "message": f"Rate limit reached: {self.key_rps:g} requests per second per key.",
                                "type": "requests",
                                "code": "rate_limit_exceeded",
                            }
                        },
                    )
                return Reply(delay=self.delay, headers=headers)
        return Reply(delay=self.delay, event_delay=self.event_delay)

    def _limit_headers(self, key: str, now: float) -> dict:
        """OpenAI's request-quota headers for the key's sliding window (called with the lock held)."""
        if not self.limit_headers:
            return {}
        times = self.accepted_at.get(key) or deque()
        reset_ms = max(1, math.ceil(((times[0] + 1.0 - now) if times else 1.0) * 1000))
        return openai_limit_headers(f"{self.key_rps:g}", max(0, int(self.key_rps) - len(times)), reset_ms)

    def _over_limit(self, key: str, now: float) -> float | None:
        """Sliding 1 s window of accepted requests per key (called with the lock held)."""
        times = self.accepted_at.setdefault(key, deque())
        while times and times[0] <= now - 1.0:
            times.popleft()
        if len(times) >= self.key_rps:
            return times[0] + 1.0 - now
        times.append(now)
        return None


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
            return {
                "requests": srv.count,
                "max_in_flight": srv.max_in_flight,
                "in_flight": srv.in_flight,
                "rate_limited": srv.rate_limited,
                "served_ms_mean": 1000 * srv.served_s / srv.served_n if srv.served_n else None,
            }

    def do_GET(self):
        if self.path == "/_bench/stats":
            return self._json(200, self._stats())
        if self.path == "/_bench/batches":  # the batch-API requests logged (devkit.batches' `log`)
            return self._json(200, {"log": self.server.batches.requests()})
        return super().do_GET()  # the batch APIs (retrieve, list, file content); 501 for anything else

    def do_POST(self):
        if not self.path.startswith("/_bench/"):
            started = time.monotonic()
            try:
                return super().do_POST()
            finally:
                served = time.monotonic() - started
                with self.server.lock:
                    self.server.served_s += served
                    self.server.served_n += 1
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        srv = self.server
        if self.path == "/_bench/config":
            srv.delay = float(body.get("delay_ms", srv.delay * 1000)) / 1000.0
            srv.key_rps = float(body.get("key_rps", srv.key_rps))
            srv.limit_headers = bool(body.get("limit_headers", srv.limit_headers))
            srv.event_delay = float(body.get("event_delay_ms", srv.event_delay * 1000)) / 1000.0
            if "batch_seconds" in body:  # how long a batch job of the batch APIs takes (RELAY_DEMO_BATCH_SECONDS)
                srv.batches.job_seconds = float(body["batch_seconds"])
            return self._json(
                200,
                {
                    "delay_ms": srv.delay * 1000,
                    "key_rps": srv.key_rps,
                    "limit_headers": srv.limit_headers,
                    "event_delay_ms": srv.event_delay * 1000,
                },
            )
        if self.path == "/_bench/reset":
            with srv.lock:
                srv.count = 0
                srv.rate_limited = 0
                srv.served_s, srv.served_n = 0.0, 0
                srv.accepted_at.clear()
                srv.max_in_flight = srv.in_flight
            return self._json(200, self._stats())
        return self._json(404, {"error": {"message": f"no route {self.path}"}})


def serve(server: BenchUpstream) -> None:
    """Serve until SIGTERM or Ctrl-C, after telling the parent where (`READY <url>`, read by bench.harness)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"READY {server.url}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.stopping.set()
        server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--key-rps", type=float, default=5.0)
    parser.add_argument("--no-limit-headers", action="store_true", help="no x-ratelimit-* headers: 429s only")
    args = parser.parse_args()
    server = BenchUpstream(
        port=args.port, delay=args.delay_ms / 1000.0, key_rps=args.key_rps, limit_headers=not args.no_limit_headers
    )
    serve(server)


if __name__ == "__main__":
    main()
