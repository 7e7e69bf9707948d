"""Slow and odd clients against the real web server of embedded mode.

gunicorn is started with relay.webserver.gunicorn_argv — the argv embedded mode
uses — against the test database. Every wait is bounded and every socket and
process is closed by the test itself.
"""

import json
import socket

import pytest
import requests

from relay.webserver import WORKERS
from tests.workers import production_web, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

SLOW_CONNECTIONS = 16


@pytest.fixture(scope="module")
def web(django_db_setup, django_db_blocker):
    from django.db import connection

    # Short body-read limits so the test sees a slow body refused (408) in seconds.
    limits = {"RELAY_BODY_READ_SECONDS": "3", "RELAY_BODY_IDLE_SECONDS": "2"}
    with production_web(connection.settings_dict, log_prefix="relay-web-", env=limits) as server:
        yield server.url, server.port, server.log


def _slow_connection(port: int, key: str, path: str = "/v1/chat/completions") -> socket.socket:
    """Headers, then a few bytes of a body that claims to be 1000 bytes long; then nothing."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: 1000\r\n\r\n".encode()
        + b'{"mo'
    )
    return s


def _read_answer(s: socket.socket) -> bytes:
    """Until the JSON body has arrived or the server closes; each recv bounded by the socket timeout."""
    answer = b""
    while not (b"\r\n\r\n" in answer and answer.rstrip().endswith(b"}")):
        chunk = s.recv(65536)
        if not chunk:
            break
        answer += chunk
    return answer


def test_healthz_answers_while_16_slow_clients_hold_connections(web, catalog):
    url, port, _ = web
    slow = []
    try:
        # A valid key: each of these requests reaches the view, which waits for the body.
        slow = [_slow_connection(port, catalog.key) for _ in range(SLOW_CONNECTIONS)]
        for _ in range(3):
            assert requests.get(url + "/healthz", timeout=20).status_code == 200
        assert requests.get(url + "/v1/models", timeout=20).status_code == 401  # the API too, not only health
    finally:
        for s in slow:
            s.close()


def test_a_body_that_never_arrives_is_answered_408_and_the_thread_freed(web, catalog):
    _, port, _ = web
    s = _slow_connection(port, catalog.key)
    try:
        s.settimeout(30)  # bound: the relay gives up on the body after RELAY_BODY_READ_SECONDS (3 s here)
        answer = _read_answer(s)
    finally:
        s.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b'"request_timeout"' in answer
    # The idle limit (2 s here) fired before the body's deadline (3 s + 1000 bytes' worth): the answer names it.
    assert b"RELAY_BODY_IDLE_SECONDS" in answer and b"for 2 seconds" in answer, answer


def test_declared_oversize_body_is_refused_before_it_is_sent(web):
    _, port, _ = web
    for path in ("/v1/batches", "/v1/chat/completions", "/v1/files"):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        try:
            s.sendall(
                f"POST {path} HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
                f"Content-Length: {10**12}\r\n\r\n".encode()
            )
            answer = _read_answer(s)
        finally:
            s.close()
        # A batch body: the native contract's 400 (decision 0003); any other: 413.
        assert answer.startswith(b"HTTP/1.1 400" if path == "/v1/batches" else b"HTTP/1.1 413"), (path, answer[:200])
        assert b'"error"' in answer


def test_chunked_body_is_read_through_gunicorn(web, catalog, fake):
    url, _, _ = web
    body = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "sent in chunks"}]}).encode()

    def chunks():
        for i in range(0, len(body), 7):
            yield body[i : i + 7]

    resp = requests.post(
        url + "/v1/chat/completions",
        data=chunks(),  # requests sends a generator with Transfer-Encoding: chunked
        headers={"Authorization": f"Bearer {catalog.key}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    assert fake.received[-1]["body"]["messages"][0]["content"] == "sent in chunks"


def test_each_web_worker_loads_its_urls_and_catalog_before_its_first_request(web):
    # relay.wsgi runs relay.webserver.warm_up as gunicorn loads the app in each worker, before the
    # worker accepts a connection: its first request no longer pays the URLconf's imports.
    _, _, log = web

    def warm_ups():
        return [line for line in log.read_text().splitlines() if "web worker warmed up" in line]

    # The server answered its first request once one worker was up; the others may still be warming.
    wait_for(lambda: len(warm_ups()) >= WORKERS, 30, interval=0.05, what="every web worker to warm up")
    lines = warm_ups()
    assert len(lines) == WORKERS, log.read_text()[-3000:]
    assert not any("failed" in line for line in lines), lines
