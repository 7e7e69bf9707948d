"""The webhook lane's keep-alive pools and kept pins: deliveries to one endpoint share a connection, every
connection still goes to an address the SSRF guard checked (again once the pin's age passes), and the answer's
byte cap holds per request on a reused connection. The delivery flow: tests/test_webhooks_lane.py."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from batches.webhooks import delivery as deliveries
from batches.webhooks import guard, signing
from batches.webhooks.models import WebhookEndpoint
from core import crypto


class KeepAlive:
    """An HTTP/1.1 receiver on loopback that keeps connections open and counts the connections it accepted."""

    def __init__(self, body: bytes = b""):
        self.connections = 0
        self.requests = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                receiver.connections += 1

            def do_POST(self):  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def keepalive(settings):
    settings.RELAY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    guard.forget()
    made = []

    def make(body: bytes = b"") -> KeepAlive:
        made.append(KeepAlive(body))
        return made[-1]

    yield make
    guard.forget()
    for server in made:
        server.close()


_ids = iter(range(10_000, 20_000))


def endpoint_for(url: str) -> WebhookEndpoint:
    # Unsaved: an attempt reads only the URL, the id (its pool) and the sealed secret.
    return WebhookEndpoint(pk=next(_ids), url=url, secret_sealed=crypto.encrypt(signing.new_secret()))


def post(endpoint: WebhookEndpoint, n: int = 1) -> list:
    return [
        deliveries.send(deliveries.prepare(endpoint.url), endpoint, f"msg_{i}", b'{"type": "batch.completed"}')
        for i in range(n)
    ]


def test_deliveries_to_one_endpoint_share_a_keep_alive_connection_and_endpoints_do_not_share(keepalive):
    server = keepalive()
    first, second = endpoint_for(server.url), endpoint_for(server.url)
    answers = post(first, 5)
    assert [a.status_code for a in answers] == [200] * 5 and server.requests == 5
    assert server.connections == 1
    # Another endpoint on the same host gets a pool of its own: one tenant's receiver holding its connections
    # cannot hold another endpoint's.
    assert [a.status_code for a in post(second, 2)] == [200, 200]
    assert server.connections == 2


def test_the_answers_byte_cap_counts_per_request_on_a_reused_connection(keepalive, monkeypatch):
    server = keepalive(body=b"x" * 600)
    monkeypatch.setattr(deliveries, "_WIRE_BYTES", 1000)  # one answer (~700 bytes) fits, two do not
    answers = post(endpoint_for(server.url), 3)
    assert [(a.status_code, a.error) for a in answers] == [(200, "")] * 3
    assert server.connections == 1
    # One answer over the cap is still refused.
    big = keepalive(body=b"x" * 2000)
    (answer,) = post(endpoint_for(big.url))
    assert answer.status_code is None and "more than 1000 bytes" in answer.error


def test_a_kept_pin_is_checked_again_once_its_age_passes(keepalive, monkeypatch):
    server = keepalive()
    # The loopback receiver is treated as not listed (its address is checked), though plain http stays allowed …
    real_parse, real_refusal = guard.parse, guard.netguard.refusal
    monkeypatch.setattr(guard, "parse", lambda url: (real_parse(url)[0], False))
    # … and 127.0.0.1 stands for a public address at first (the guard finds nothing wrong with it) …
    monkeypatch.setattr(guard.netguard, "refusal", lambda ip: None)
    monkeypatch.setattr(guard, "PIN_SECONDS", 3600.0)
    endpoint = endpoint_for(server.url)
    assert [a.status_code for a in post(endpoint)] == [200]
    # … then the name points at an internal address. Within the pin's age the checked pin is used …
    monkeypatch.setattr(guard.netguard, "refusal", real_refusal)
    assert [a.status_code for a in post(endpoint)] == [200]
    # … and once it has passed, the next attempt looks again and is refused before any connection is used.
    for key, (pin, _expires) in list(guard._pins.items()):
        guard._pins[key] = (pin, 0.0)
    (refused,) = post(endpoint)
    assert refused.status_code is None and refused.error.startswith("refused: ") and "loopback" in refused.error
    assert server.requests == 2


def test_a_kept_pin_is_not_used_once_its_host_is_no_longer_listed(keepalive, settings):
    server = keepalive()
    endpoint = endpoint_for(server.url)
    assert [a.status_code for a in post(endpoint)] == [200]
    settings.RELAY_WEBHOOK_ALLOWED_HOSTS = []
    (refused,) = post(endpoint)
    assert refused.error.startswith("refused: ") and server.requests == 1
