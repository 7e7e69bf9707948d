"""The webhook lane: no tenant's receivers can slow another tenant's deliveries or the control queue.

In process: the lane's fair, capped pick; the per-owner endpoint cap; an endpoint paused automatically (and
its owner told why, and resuming it); the DNS look-up's own timeout; retention of settled deliveries. End to
end with the real processes (item worker, control worker, webhook lane, beat): a tenant whose endpoints sit
on a server that accepts connections and never answers, while another tenant's batch runs and its webhook
arrives. In-process details of one delivery: tests/test_webhooks_api.py; the flow: tests/test_webhooks.py."""

import json
import socket
import threading
import time
from datetime import timedelta

import pytest
import requests
import uuid6
from django.test import Client
from django.utils import timezone

from batches.models import Batch
from batches.webhooks import delivery as deliveries
from batches.webhooks import events, guard, housekeeping, lane, services
from batches.webhooks.models import Delivery, DeliveryAttempt, Event, WebhookEndpoint
from core.auth import principal_for_key
from core.models import ServiceAccount
from core.services import create_relay_key
from tests.webhook_receiver import Receiver
from tests.workers import wait_for

CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}


class Silent:
    """A server on loopback that accepts every connection and never answers (nor reads): a receiver that hangs."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/hooks"

    def _serve(self):
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted.append(conn)  # held open, never read, never answered

    def close(self):
        self._stop.set()
        self.thread.join(2)
        for conn in self.accepted:
            conn.close()
        self.sock.close()


@pytest.fixture
def silent():
    s = Silent()
    yield s
    s.close()


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


def api(method: str, path: str, key: str, body=None):
    client = Client()
    extra = {"HTTP_AUTHORIZATION": f"Bearer {key}"}
    if method == "get":
        return client.get(path, **extra)
    return getattr(client, method)(path, data=json.dumps(body or {}), content_type="application/json", **extra)


def another_key(catalog, name: str) -> str:
    sa = ServiceAccount.objects.create(project=catalog.project, name=name, policy=catalog.policy)
    return create_relay_key(service_account=sa)[1]


def endpoint_of(key: str, url: str, name: str = "hooks") -> WebhookEndpoint:
    endpoint, _ = services.create_endpoint(
        principal_for_key(key), {"url": url, "name": name, "event_types": ["batch.completed"]}
    )
    return endpoint


def due(endpoint: WebhookEndpoint, n: int) -> list:
    """`n` pending deliveries of a test-free event to `endpoint`, due now."""
    now = timezone.now()
    ids = []
    for _ in range(n):
        event_id = uuid6.uuid7()
        event = Event.objects.create(
            id=event_id,
            type="batch.completed",
            owner_hash=endpoint.owner_hash,
            body=events.body(event_id, "batch.completed", now, {"id": f"batch_{uuid6.uuid7().hex}"}),
        )
        d = Delivery.objects.create(id=uuid6.uuid7(), event=event, endpoint=endpoint, next_attempt_at=now)
        ids.append(d.id)
    return ids


# --- in process ----------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_pick_serves_owners_in_turn_within_the_endpoint_and_owner_caps(catalog, settings):
    settings.RELAY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    settings.RELAY_WEBHOOK_ENDPOINT_IN_FLIGHT = 2
    settings.RELAY_WEBHOOK_OWNER_IN_FLIGHT = 4
    noisy = [endpoint_of(catalog.key, f"http://127.0.0.1:9/{i}", f"n{i}") for i in range(3)]
    backlog = {e.pk: due(e, 6) for e in noisy}
    WebhookEndpoint.objects.filter(pk=noisy[2].pk).update(failing_since=timezone.now())  # failing: probed, one at once
    quiet = endpoint_of(another_key(catalog, "sa-quiet"), "http://127.0.0.1:9/q")
    (theirs,) = due(quiet, 1)
    for turn in range(4):  # whoever goes first, the quiet owner's one delivery is in the first round
        assert theirs in lane.pick(2, turn)
    picked = lane.pick(100, 0)
    mine = [d for d in picked if d != theirs]
    assert theirs in picked and len(mine) == 4  # the noisy owner: its cap, however many are due
    per_endpoint = {e.pk: sum(d in backlog[e.pk] for d in mine) for e in noisy}
    assert max(per_endpoint.values()) <= 2 and per_endpoint[noisy[2].pk] <= 1
    # Leased (in flight in some lane), they count against the caps of every later pick.
    assert len(deliveries.claim(mine, "lane-a")) == 4
    assert lane.pick(100, 1) == [theirs]
    # A lane that died: its leases run out and the caps free up.
    Delivery.objects.filter(lease_owner__startswith="lane-a:").update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert len([d for d in lane.pick(100, 2) if d != theirs]) == 4
    # A paused endpoint's deliveries are never picked.
    WebhookEndpoint.objects.filter(owner_hash=quiet.owner_hash).update(paused_at=timezone.now())
    assert theirs not in lane.pick(100, 3)


@pytest.mark.django_db
def test_an_owner_may_register_at_most_max_endpoints(catalog, settings, receiver):
    settings.RELAY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    settings.RELAY_WEBHOOK_MAX_ENDPOINTS = 3
    body = {"url": receiver.url, "name": "n", "event_types": ["batch.completed"]}
    for _ in range(3):
        assert api("post", "/v1/webhook_endpoints", catalog.key, body).status_code == 200
    refused = api("post", "/v1/webhook_endpoints", catalog.key, body)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "webhook_endpoint_limit_reached" and error["type"] == "invalid_request_error"
    assert "at most 3 per owner" in error["message"]
    assert WebhookEndpoint.objects.count() == 3  # nothing written
    assert api("post", "/v1/webhook_endpoints", another_key(catalog, "sa-b"), body).status_code == 200  # per owner
    made = api("get", "/v1/webhook_endpoints", catalog.key).json()["data"][0]
    assert api("delete", f"/v1/webhook_endpoints/{made['id']}", catalog.key).status_code == 200
    assert api("post", "/v1/webhook_endpoints", catalog.key, body).status_code == 200  # room again


@pytest.mark.django_db
def test_an_endpoint_failing_long_enough_is_paused_its_owner_sees_why_and_resume_clears_it(catalog, settings, receiver):
    settings.RELAY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    settings.RELAY_WEBHOOK_PAUSE_AFTER_SECONDS = 0
    settings.RELAY_WEBHOOK_PAUSE_AFTER_FAILURES = 3
    endpoint = endpoint_of(catalog.key, receiver.url)
    (d,) = due(endpoint, 1)
    receiver.default = (503, 0, {}, b"down")
    outcomes = []
    for _ in range(3):
        Delivery.objects.update(next_attempt_at=timezone.now())
        outcomes.append(deliveries.deliver(d))
    assert outcomes == ["retry", "retry", "paused"]
    shown = api("get", f"/v1/webhook_endpoints/{endpoint.public_id}", catalog.key).json()
    assert shown["paused_at"] is not None
    assert "3 in a row" in shown["paused_reason"] and "answered 503" in shown["paused_reason"]
    assert lane.pick(100, 0) == [] and Delivery.objects.get().outcome == "pending"  # kept, not sent
    receiver.default = (200, 0, {}, b"ok")
    resumed = api("post", f"/v1/webhook_endpoints/{endpoint.public_id}/resume", catalog.key).json()
    assert resumed["paused_at"] is None and resumed["paused_reason"] is None
    assert lane.pick(100, 0) == [d] and deliveries.deliver(d) == "delivered"
    assert WebhookEndpoint.objects.get().consecutive_failures == 0


@pytest.mark.django_db
def test_an_endpoint_an_operator_paused_is_resumed_by_the_operator_never_by_its_owner(catalog, settings):
    settings.RELAY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    endpoint = endpoint_of(catalog.key, "http://127.0.0.1:9/x")
    (waiting,) = due(endpoint, 1)
    services.pause(endpoint)
    refused = api("post", f"/v1/webhook_endpoints/{endpoint.public_id}/resume", catalog.key)
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "endpoint_paused_by_operator"
    assert WebhookEndpoint.objects.get().paused_at is not None and lane.pick(100, 0) == []
    services.resume(WebhookEndpoint.objects.get())  # the admin's action
    assert WebhookEndpoint.objects.get().paused_by_operator is False and lane.pick(100, 0) == [waiting]


def test_a_hung_dns_look_up_ends_at_its_own_timeout(settings, monkeypatch):
    settings.RELAY_WEBHOOK_ALLOWED_HOSTS = []
    settings.RELAY_WEBHOOK_DNS_TIMEOUT_SECONDS = 0.2
    release = threading.Event()
    real = socket.getaddrinfo

    def hung_resolver(host, *args, **kwargs):  # the system resolver, waiting on a name server that never answers
        if host == "hooks.example.com":
            release.wait(10)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hung_resolver)
    try:
        with pytest.raises(guard.Unresolvable, match="did not resolve within 0.2 s"):
            guard.resolve("https://hooks.example.com/x")
        assert deliveries.prepare("https://hooks.example.com/x").startswith("refused: host hooks.example.com did not")
        # Many of one tenant's look-ups hung at once (each given up on, still running) …
        refusals = []
        hung = [
            threading.Thread(target=lambda: refusals.append(deliveries.prepare("https://hooks.example.com/y")))
            for _ in range(40)
        ]
        for t in hung:
            t.start()
        for t in hung:
            t.join()
        assert len(refusals) == 40 and all("did not resolve" in r for r in refusals)
        # … and another tenant's name still resolves: no shared pool of resolver threads for them to fill.
        settings.RELAY_WEBHOOK_ALLOWED_HOSTS = ["localhost"]
        assert guard.resolve("http://localhost:9/x").addresses
    finally:
        release.set()


@pytest.mark.django_db
def test_retention_prunes_old_delivered_and_failed_deliveries_never_pending_ones(catalog, settings):
    settings.RELAY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    settings.RELAY_WEBHOOK_RETENTION_SECONDS = 3600
    endpoint = endpoint_of(catalog.key, "http://127.0.0.1:9/x")
    old_ok, old_failed, old_pending, new_ok = due(endpoint, 4)
    now, long_ago = timezone.now(), timezone.now() - timedelta(hours=2)
    Delivery.objects.filter(pk=old_ok).update(outcome="delivered", delivered_at=long_ago, last_attempt_at=long_ago)
    Delivery.objects.filter(pk=old_failed).update(outcome="failed", last_attempt_at=long_ago)
    Delivery.objects.filter(pk=old_pending).update(last_attempt_at=long_ago)
    Delivery.objects.filter(pk=new_ok).update(outcome="delivered", delivered_at=now, last_attempt_at=now)
    for pk in (old_ok, old_failed):
        DeliveryAttempt.objects.create(delivery_id=pk, number=1, started_at=long_ago, duration_ms=1)
    assert housekeeping.prune(now) == 2
    assert set(Delivery.objects.values_list("id", flat=True)) == {old_pending, new_ok}
    assert DeliveryAttempt.objects.count() == 0 and Event.objects.count() == 2  # their events went with them
    assert housekeeping.prune(now) == 0
    settings.RELAY_WEBHOOK_RETENTION_SECONDS = 0  # keep everything
    Delivery.objects.filter(pk=new_ok).update(last_attempt_at=long_ago)
    assert housekeeping.prune(now) == 0


@pytest.mark.django_db
def test_a_paused_endpoints_backlog_is_kept_for_its_resume_but_not_past_retention(catalog, settings):
    settings.RELAY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    settings.RELAY_WEBHOOK_RETENTION_SECONDS = 3600
    paused, live = (
        endpoint_of(catalog.key, "http://127.0.0.1:9/p", "p"),
        endpoint_of(catalog.key, "http://127.0.0.1:9/l"),
    )
    WebhookEndpoint.objects.filter(pk=paused.pk).update(paused_at=timezone.now(), paused_reason="test")
    old, recent = due(paused, 2)
    theirs = due(live, 1)
    now = timezone.now()
    Delivery.objects.filter(pk__in=[old, *theirs]).update(schedule_from=now - timedelta(hours=2))
    assert lane.pick(100, 0) == theirs  # the paused endpoint's deliveries are never picked
    housekeeping.prune(now)
    states = dict(Delivery.objects.values_list("id", "outcome"))
    # Past retention on a paused endpoint: failed (pruned a retention later); the recent one waits for a resume;
    # a live endpoint's pending delivery is never touched, however old.
    assert states == {old: "failed", recent: "pending", theirs[0]: "pending"}
    assert Delivery.objects.get(pk=old).last_error == "the endpoint stayed paused past retention"


# --- end to end: a tenant's silent receivers, another tenant's batch ------------------------------------------


@pytest.fixture(scope="module")
def worker_env():
    return {"RELAY_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1", "RELAY_WEBHOOK_POLL_SECONDS": "0.5"}


@pytest.mark.django_db(transaction=True)
def test_a_tenants_silent_receivers_delay_neither_another_tenants_webhooks_nor_the_control_queue(
    live_server, catalog, worker, settings, silent, receiver
):
    """Tenant A registers as many endpoints as it may on a server that accepts and never answers, then ends
    batches: its deliveries hang. Tenant B's batch must still validate, run and finalize, and B's webhook must
    arrive, while A's are still hanging (on the control queue, 4 slots × 10 s per delivery stalled both)."""
    assert worker.alive(), worker.output()
    settings.RELAY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    a_key, b_key = catalog.key, another_key(catalog, "sa-b")
    for i in range(settings.RELAY_WEBHOOK_MAX_ENDPOINTS):
        endpoint_of(a_key, silent.url, f"silent-{i}")
    endpoint_of(b_key, receiver.url)

    def submit(key: str) -> str:
        resp = requests.post(
            live_server.url + "/v1/batches",
            json={"shape": "openai", "requests": [CHAT]},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert resp.status_code == 202, resp.text
        return resp.json()["id"]

    a_batches = [submit(a_key) for _ in range(3)]
    wait_for(lambda: len(silent.accepted) >= 4, 60, what="tenant A's deliveries to hang on the silent server")
    a_endpoints = WebhookEndpoint.objects.filter(owner_hash=principal_for_key(a_key).owner_hash)
    b_batch = submit(b_key)
    t0 = time.monotonic()
    wait_for(
        lambda: Batch.objects.filter(pk=b_batch, status="completed").exists(), 45, what="tenant B's batch to complete"
    )
    arrived = wait_for(lambda: receiver.received, 45, what="tenant B's webhook")
    took = time.monotonic() - t0
    assert json.loads(arrived[0].body)["data"] == {"id": b_batch}
    # Meanwhile none of A's was answered, and A never held more than its owner's share of the lane.
    a_deliveries = Delivery.objects.filter(endpoint__in=a_endpoints)
    assert a_deliveries.count() == 3 * settings.RELAY_WEBHOOK_MAX_ENDPOINTS
    assert not a_deliveries.filter(outcome="delivered").exists()
    assert a_deliveries.filter(lease_expires_at__gt=timezone.now()).count() <= settings.RELAY_WEBHOOK_OWNER_IN_FLIGHT
    assert Batch.objects.filter(pk__in=a_batches, status="completed").count() == 3
    print(f"tenant B's batch and webhook took {took:.1f} s with tenant A's {len(silent.accepted)} hanging POSTs")
