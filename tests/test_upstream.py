"""gateway.upstream: keep-alive per host, and a stopped call really ends its connection.

A raw-socket fake provider records every connection it accepts and the moment the
client closes it, so the tests see what a provider would see."""

import socket
import threading
import time

import pytest

from gateway import upstream

pytest_plugins = ["tests.tls.fixtures"]

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class RawUpstream:
    """Accepts connections; answers each request at once (`fast`) or never (`slow`)."""

    def __init__(self, mode: str):
        self.mode = mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.accepted = 0
        self.requests = 0
        self.closed = threading.Event()  # set when a client ended its connection
        self.got_request = threading.Event()
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1/chat/completions"

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._conn, args=(conn,), daemon=True).start()

    def _conn(self, conn):
        buf = b""
        conn.settimeout(30)
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    self.closed.set()  # the client closed (FIN) its side
                    return
                buf += data
                while b"\r\n\r\n" in buf:
                    head, _, rest = buf.partition(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    if len(rest) < length:
                        break
                    buf = rest[length:]
                    self.requests += 1
                    self.got_request.set()
                    if self.mode == "fast":
                        conn.sendall(OK)
                    # slow: never answer; keep reading to see the close
        except OSError:
            self.closed.set()
        finally:
            conn.close()

    def close(self):
        self.stop.set()
        self.sock.close()


@pytest.fixture
def raw():
    servers = []

    def make(mode):
        s = RawUpstream(mode)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def test_keep_alive_reuses_one_connection_per_host(raw):
    srv = raw("fast")
    for _ in range(5):
        resp = upstream.call(srv.url, {}, b"{}", deadline=time.monotonic() + 10)
        assert resp.status == 200 and resp.body == b"{}"
    assert srv.requests == 5
    assert srv.accepted == 1


def test_cancel_closes_the_connection_before_call_returns(raw):
    srv = raw("slow")
    flag = threading.Event()
    threading.Timer(0.3, flag.set).start()
    with pytest.raises(upstream.UpstreamError) as info:
        upstream.call(srv.url, {}, b"{}", deadline=time.monotonic() + 60, cancel=flag.is_set)
    assert info.value.kind == "cancelled"
    assert srv.got_request.is_set()
    # The provider sees the connection end (no wall-clock bound is asserted, only that it happens).
    assert srv.closed.wait(10)
    assert not upstream._watches  # nothing left in flight


def test_deadline_closes_the_connection(raw):
    srv = raw("slow")
    with pytest.raises(upstream.UpstreamError) as info:
        upstream.call(srv.url, {}, b"{}", deadline=time.monotonic() + 0.4)
    assert info.value.kind == "timeout"
    assert srv.closed.wait(10)


def test_a_stopped_connection_is_not_reused(raw):
    slow = raw("slow")
    flag = threading.Event()
    threading.Timer(0.2, flag.set).start()
    with pytest.raises(upstream.UpstreamError):
        upstream.call(slow.url, {}, b"{}", deadline=time.monotonic() + 60, cancel=flag.is_set)
    slow.mode = "fast"
    resp = upstream.call(slow.url, {}, b"{}", deadline=time.monotonic() + 10)
    assert resp.status == 200
    assert slow.accepted == 2  # a new connection, not the one that was shut down


def test_no_thread_per_call(raw):
    srv = raw("fast")
    upstream.call(srv.url, {}, b"{}", deadline=time.monotonic() + 10)
    before = set(threading.enumerate())
    for _ in range(10):
        upstream.call(srv.url, {}, b"{}", deadline=time.monotonic() + 10)
    # No thread started by the calls (another test's leftover thread may end meanwhile: not counted).
    assert set(threading.enumerate()) - before == set()


def test_a_request_is_one_send_headers_and_body_together(raw, monkeypatch):
    """One `sendall` per call (urllib3 alone sends the header block, then the body)."""
    import http.client

    srv = raw("fast")
    upstream.call(srv.url, {}, b"{}", deadline=time.monotonic() + 10)  # connected: the count is a call's
    sends = []
    real = http.client.HTTPConnection.send

    def counting(self, data):
        sends.append(bytes(data))
        return real(self, data)

    monkeypatch.setattr(http.client.HTTPConnection, "send", counting)
    body = b'{"model": "m", "messages": []}'
    resp = upstream.call(srv.url, {"X-Test": "1"}, body, deadline=time.monotonic() + 10)
    assert resp.status == 200 and srv.requests == 2
    assert len(sends) == 1
    head, _, sent_body = sends[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1") and b"X-Test: 1" in head
    assert sent_body == body


def test_https_verifies_the_provider_certificate(_https_executor, test_pki, monkeypatch):
    """The call goes through urllib3's pool under requests' adapter, set up for TLS as requests sets it
    up: a certificate the session's CA bundle does not vouch for is refused (unreachable, nothing
    sent); with the CA trusted the call is made, over one kept-alive connection, SNI included."""
    _https_executor.reset()
    body = b'{"tool_calls": []}'
    with pytest.raises(upstream.UpstreamError) as info:
        upstream.call(_https_executor.url(), {}, body, deadline=time.monotonic() + 10)
    assert info.value.kind == "unreachable" and "SSLError" in info.value.message
    assert _https_executor.received == []

    session = upstream._shared_session()
    monkeypatch.setattr(session, "verify", str(test_pki.ca_cert))
    session.get_adapter("https://").poolmanager.clear()  # the refusing pool is not reused
    for _ in range(2):
        resp = upstream.call(_https_executor.url(), {"X-Test": "1"}, body, deadline=time.monotonic() + 10)
        assert resp.status == 200 and b"results" in resp.body
    assert [r["headers"]["X-Test"] for r in _https_executor.received] == ["1", "1"]
    assert _https_executor.received[0]["sni"] == "localhost"
    session.get_adapter("https://").poolmanager.clear()


def test_poke_has_a_cancel_seen_without_waiting_for_the_poll(raw, monkeypatch):
    """The watchdog looks at cancel callbacks when poked (the batch heartbeat pokes when it finds its
    item cancelled); with the poll pushed out of reach, only the poke can stop this call before its
    deadline."""
    monkeypatch.setattr(upstream.watch, "_CANCEL_POLL", 3600)  # the watchdog reads it there
    srv = raw("slow")
    flag = threading.Event()

    def cancel_and_poke():
        flag.set()
        upstream.poke()

    threading.Timer(0.3, cancel_and_poke).start()
    with pytest.raises(upstream.UpstreamError) as info:
        upstream.call(srv.url, {}, b"{}", deadline=time.monotonic() + 30, cancel=flag.is_set)
    assert info.value.kind == "cancelled"
    assert srv.closed.wait(10)


def test_a_call_with_a_cancel_is_watched_while_the_watchdog_sleeps_to_a_far_deadline(raw):
    """The watchdog sleeps until the nearest deadline when no call can be cancelled; a call registered
    meanwhile with a cancel callback wakes it, so its cancel is polled (not seen at the other's deadline)."""
    far, near = raw("slow"), raw("slow")
    outcome = {}

    def far_call():
        try:
            # Far enough that a cancel seen only at this deadline would be late (the near call's is 2 s).
            upstream.call(far.url, {}, b"{}", deadline=time.monotonic() + 3)
        except upstream.UpstreamError as exc:
            outcome["far"] = exc.kind

    t = threading.Thread(target=far_call)
    t.start()
    assert far.got_request.wait(10)  # the watchdog now sleeps towards that call's deadline
    flag = threading.Event()
    threading.Timer(0.3, flag.set).start()
    with pytest.raises(upstream.UpstreamError) as info:
        upstream.call(near.url, {}, b"{}", deadline=time.monotonic() + 2, cancel=flag.is_set)
    assert info.value.kind == "cancelled"  # not "timeout": seen by the poll, well before 2 s
    t.join(30)
    assert outcome == {"far": "timeout"}
