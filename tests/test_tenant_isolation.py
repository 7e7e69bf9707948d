"""Tenants isolated: requests the provider refuses for one principal don't bench host keys for others.

Over real HTTP: relay (live server) → fake provider (loopback), two service accounts on one policy.
The fake answers 500 to any request whose body carries a marker, as a provider refusing one
tenant's requests (a prompt it cannot serve) would; every other request succeeds."""

import io
import json
import socket
import socketserver
import threading
import time

import pytest
import requests

from batches.lifecycle import claim as claims
from batches.models import Item
from batches.surfaces.native import submit
from batches.worker import execute
from core import auth
from core.crypto import sha256_hex
from core.models import ServiceAccount
from core.services import create_relay_key
from devkit.upstream import Reply
from policies import breaker
from usage.models import UsageEvent

pytestmark = pytest.mark.django_db(transaction=True)

POISON = "<refused-by-the-provider>"
KEYS = [sha256_hex(f"upstream-openai-{i}")[:12] for i in range(3)]


def chat(content: str) -> dict:
    return {"model": "gpt-4o", "messages": [{"role": "user", "content": content}]}


@pytest.fixture
def tenants(live_server, catalog, fake):
    fake.answer_when(POISON, Reply(status=500, body={"error": {"message": "The server had an error"}}))
    return two_tenants(live_server, catalog)


def two_tenants(live_server, catalog):
    """Tenant A (the catalog's key) and tenant B (a service account of its own) on the same policy and keys,
    each posting chat calls and waiting for the call's usage event."""
    sa_b = ServiceAccount.objects.create(project=catalog.project, name="sa-b", policy=catalog.policy)
    _, key_b = create_relay_key(service_account=sa_b)

    class Tenants:
        url = live_server.url
        a, b = catalog.key, key_b
        tag_a = breaker.principal_tag(auth.principal_for_key(catalog.key))
        tag_b = breaker.principal_tag(auth.principal_for_key(key_b))

        def post(self, key: str, content: str) -> requests.Response:
            resp = requests.post(
                self.url + "/v1/chat/completions",
                json=chat(content),
                headers={"Authorization": f"Bearer {key}"},
                timeout=30,
            )
            _wait_for_event(resp)  # written after the answer: none may land in the next test
            return resp

    return Tenants()


def _wait_for_event(resp) -> None:
    request_id = resp.headers["X-Relay-Request-ID"]
    deadline = time.monotonic() + 10
    while not UsageEvent.objects.filter(request_id=request_id).exists():
        assert time.monotonic() < deadline, f"no usage event for {request_id}"
        time.sleep(0.005)


def states() -> list[str]:
    return [breaker.snapshot(k)["state"] for k in KEYS]


def test_one_tenants_refused_requests_do_not_deny_another(tenants, fake):
    # The measurement: six requests by B that the provider answers 500, then five by A.
    for i in range(6):
        resp = tenants.post(tenants.b, f"{POISON} {i}")
        assert resp.status_code == 500 and resp.headers["X-WR-Origin"] == "upstream"
    assert states() == ["closed"] * 3
    assert all(breaker.suspects(k) == [tenants.tag_b] for k in KEYS)  # B was scored on every key it tried
    for i in range(5):
        resp = tenants.post(tenants.a, f"hello {i}")
        assert resp.status_code == 200, resp.text
    # A's success cleared the scores of the key it used.
    assert breaker.suspects(KEYS[0]) == []


def test_tenant_a_keeps_succeeding_while_b_hammers_the_provider(tenants, fake):
    stop = threading.Event()
    b_answers = []

    def hammer():
        while not stop.is_set():
            b_answers.append(tenants.post(tenants.b, POISON).status_code)

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        a_answers = [tenants.post(tenants.a, f"hello {i}").status_code for i in range(15)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert a_answers == [200] * 15
    assert b_answers and set(b_answers) == {500}
    assert states() == ["closed"] * 3


def test_two_principals_failing_open_the_keys_for_everyone(tenants, fake):
    assert tenants.post(tenants.b, POISON).status_code == 500
    assert states() == ["closed"] * 3
    # A sees the provider fail too: two principals within the window, so it is the keys, not a request.
    assert tenants.post(tenants.a, POISON).status_code == 500
    assert states() == ["open"] * 3
    assert {breaker.snapshot(k)["reason"] for k in KEYS} == {"upstream_server_error"}
    resp = tenants.post(tenants.a, "hello")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_keys"


class _HangUp(socketserver.BaseRequestHandler):
    """Accepts the connection, reads the request, closes without an answer: a network failure after the
    request was sent (which the request itself may have caused, unlike a connect failure)."""

    def handle(self):
        self.request.recv(65536)
        self.request.shutdown(socket.SHUT_RDWR)


def test_a_network_failure_after_sending_scores_the_principal_on_every_key_it_tried(tenants, catalog, fake):
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _HangUp)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        host = catalog.hosts["openai"]
        host.base_url = f"http://127.0.0.1:{server.server_address[1]}"
        host.save()
        resp = tenants.post(tenants.a, "hello")  # one principal, one request
        assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_error"
    finally:
        server.shutdown()
        server.server_close()
    assert states() == ["closed"] * 3
    assert all(breaker.suspects(k) == [tenants.tag_a] for k in KEYS)


def test_a_batchs_refused_records_do_not_bench_the_keys_its_good_records_need(tenants, catalog, fake):
    """A native batch (fail-at-once, fail over on 5xx): its refused records go first, then the good ones.
    One principal: the refused records score it on every key, and no key is benched."""
    principal = auth.principal_for_key(catalog.key)
    contents = [f"{POISON} {i}" for i in range(3)] + [f"good {i}" for i in range(9)]
    body = {"shape": "openai", "requests": [chat(c) for c in contents]}
    batch = submit.submit_native(principal, io.BytesIO(json.dumps(body).encode()))
    while (item := claims.claim("tenant-isolation")) is not None:
        execute.run_item(item)
    items = {i.idx: i for i in Item.objects.filter(batch_id=batch.id)}
    refused = [items[s] for s in sorted(items)[:3]]
    good = [items[s] for s in sorted(items)[3:]]
    assert {(i.state, i.status_code) for i in refused} == {("discarded", 500)}
    assert {i.state for i in good} == {"completed"}, [(i.state, i.error) for i in good]
    # The refused records reached the provider before good ones did, and failed over every key.
    first = fake.received[0]["body"]["messages"][0]["content"]
    assert POISON in first
    assert states() == ["closed"] * 3
