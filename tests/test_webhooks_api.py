"""Webhooks in process: the Webhook Endpoints API (its answers, refusals, owner scoping), the outbox written
with a batch's final move, and one delivery at a time to a real receiver on loopback — signatures checked
with the `standardwebhooks` package and the `openai` SDK's `unwrap()`, retries, pausing, resend, /metrics.
The end-to-end flow with worker processes: tests/test_webhooks.py."""

import base64
import json
import logging
from datetime import timedelta

import openai
import pytest
import uuid6
from django.db import transaction
from django.test import Client
from django.utils import timezone
from standardwebhooks import Webhook, WebhookVerificationError

from batches.lifecycle import states
from batches.models import Batch, BatchStatus, Surface
from batches.webhooks import delivery as deliveries
from batches.webhooks import housekeeping, services
from batches.webhooks.models import Delivery, DeliveryAttempt, Event, WebhookEndpoint
from core.auth import principal_for_key
from core.models import ServiceAccount
from core.services import create_relay_key
from tests.webhook_receiver import Receiver

pytestmark = pytest.mark.django_db

ALL_TYPES = ["batch.completed", "batch.failed", "batch.expired", "batch.cancelled", "message_batch.ended"]


@pytest.fixture(autouse=True)
def webhook_settings(settings):
    settings.RELAY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    settings.RELAY_WEBHOOK_RETRY_BASE_SECONDS = 2.0
    settings.RELAY_WEBHOOK_RETRY_MAX_SECONDS = 16.0
    settings.RELAY_WEBHOOK_MAX_AGE_SECONDS = 3600
    settings.RELAY_WEBHOOK_PROBE_SECONDS = 30.0
    return settings


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


def api(method: str, path: str, key: str, body=None):
    client = Client()
    extra = {"HTTP_AUTHORIZATION": f"Bearer {key}"}
    if method == "get":
        return client.get(path, body or {}, **extra)
    data = json.dumps(body) if body is not None else ""
    return getattr(client, method)(path, data=data, content_type="application/json", **extra)


def create(key: str, url: str, types=ALL_TYPES, name="hooks"):
    resp = api("post", "/v1/webhook_endpoints", key, {"url": url, "name": name, "event_types": types})
    assert resp.status_code == 200, resp.content
    return resp.json()


def a_batch(catalog, surface=Surface.NATIVE, status=None, key=None) -> Batch:
    principal = principal_for_key(key or catalog.key)
    first = {Surface.NATIVE: BatchStatus.QUEUED, Surface.OPENAI: BatchStatus.IN_PROGRESS}.get(
        surface, BatchStatus.IN_PROGRESS
    )
    now, status = timezone.now(), status or first
    fields = {}
    if surface == Surface.OPENAI:
        fields = {"endpoint": "/v1/chat/completions", "completion_window": "24h", "input_file_id": uuid6.uuid7()}
        fields["in_progress_at"] = now if status == BatchStatus.IN_PROGRESS else None
    return Batch.objects.create(
        id=uuid6.uuid7(),
        inbound_shape="anthropic" if surface == Surface.ANTHROPIC else "openai",
        surface=surface,
        status=status,
        expires_at=None if surface == Surface.NATIVE else now + timedelta(days=1),
        **fields,
        **Batch.attribution(principal),
    )


def end(batch: Batch, to: str) -> bool:
    """The batch's final move, as the lifecycle makes it."""
    if batch.surface == Surface.OPENAI and to in (BatchStatus.COMPLETED, BatchStatus.EXPIRED):
        states.move(batch.pk, Surface.OPENAI, BatchStatus.FINALIZING)
    if batch.surface == Surface.ANTHROPIC and to == BatchStatus.EXPIRED:
        Batch.objects.filter(pk=batch.pk).update(expired_at=timezone.now())
    return states.move(batch.pk, batch.surface, to)


def verify_both(secret: str, received) -> dict:
    """The delivery verifies with the standardwebhooks package and the openai SDK's unwrap(), unchanged."""
    payload = Webhook(secret).verify(received.body, received.headers)
    event = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9").webhooks.unwrap(
        received.body, received.headers, secret=secret
    )
    assert event.id == payload["id"] and event.type == payload["type"]
    return payload


# --- the Webhook Endpoints API ----------------------------------------------------------------------


def test_create_shows_the_secret_once_and_a_hint_after(catalog, receiver):
    made = create(catalog.key, receiver.url)
    assert made["object"] == "webhook_endpoint" and made["id"].startswith("we_")
    assert made["event_types"] == ALL_TYPES and made["name"] == "hooks" and made["url"] == receiver.url
    secret = made["signing_secret"]
    assert secret.startswith("whsec_") and len(base64.b64decode(secret[6:])) == 32
    assert made["signing_secret_hint"].startswith("whsec_") and made["signing_secret_hint"][-4:] in secret
    assert made["created_at"] == made["updated_at"]

    shown = api("get", f"/v1/webhook_endpoints/{made['id']}", catalog.key).json()
    assert "signing_secret" not in shown and shown["signing_secret_hint"] == made["signing_secret_hint"]
    row = WebhookEndpoint.objects.get()
    assert secret not in row.secret_sealed and secret[6:] not in row.secret_sealed  # sealed with the master key
    listed = api("get", "/openai/v1/webhook_endpoints", catalog.key).json()
    assert listed["object"] == "list" and [e["id"] for e in listed["data"]] == [made["id"]]
    assert listed["first_id"] == listed["last_id"] == made["id"] and listed["has_more"] is False
    assert "signing_secret" not in listed["data"][0]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"url": "https://hooks.example.com/x", "event_types": ["batch.completed"]}, "name"),
        ({"name": "n", "event_types": ["batch.completed"]}, "url"),
        ({"name": "n", "url": "https://hooks.example.com/x"}, "event_types"),
        ({"name": "n", "url": "https://127.0.0.2/x", "event_types": ["response.completed"]}, "event_types[0]"),
        ({"name": "n", "url": "https://127.0.0.2/x", "event_types": []}, "event_types"),
        ({"name": " ", "url": "https://127.0.0.2/x", "event_types": ["batch.completed"]}, "name"),
        ({"name": "n", "url": "https://127.0.0.2/x", "event_types": ["batch.completed"], "secret": "x"}, "secret"),
    ],
)
def test_a_missing_or_unknown_field_is_a_400(catalog, body, param):
    resp = api("post", "/v1/webhook_endpoints", catalog.key, body)
    assert resp.status_code == 400, resp.content
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert not WebhookEndpoint.objects.exists()


@pytest.mark.parametrize(
    "url, why",
    [
        ("https://10.0.0.1/hooks", "private"),
        ("https://169.254.169.254/latest", "metadata"),
        ("https://localhost/hooks", "loopback"),
        ("https://[::1]/hooks", "loopback"),
        ("https://127.0.0.2:8443/hooks", "loopback"),
        ("https://0x7f000001/hooks", "loopback"),
        ("http://127.0.0.2/hooks", "https"),
        ("ftp://127.0.0.1/hooks", "https"),
        ("https://user:pw@127.0.0.1/hooks", "user info"),
    ],
)
def test_private_loopback_and_plain_http_urls_are_refused(catalog, url, why, webhook_settings):
    webhook_settings.RELAY_WEBHOOK_ALLOWED_HOSTS = []
    resp = api("post", "/v1/webhook_endpoints", catalog.key, {"url": url, "name": "n", "event_types": ALL_TYPES})
    assert resp.status_code == 400, resp.content
    assert resp.json()["error"]["param"] == "url" and why in resp.json()["error"]["message"]


def test_an_allowed_host_may_use_http_on_loopback_and_updates_are_checked_too(catalog, receiver, webhook_settings):
    made = create(catalog.key, receiver.url)
    bad = api("post", f"/v1/webhook_endpoints/{made['id']}", catalog.key, {"url": "https://192.168.1.9/x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
    assert WebhookEndpoint.objects.get().url == receiver.url


def test_update_changes_what_is_sent_and_updated_at_only_when_something_changed(catalog, receiver):
    made = create(catalog.key, receiver.url)
    WebhookEndpoint.objects.update(updated_at=timezone.now() - timedelta(hours=1))
    before = api("get", f"/v1/webhook_endpoints/{made['id']}", catalog.key).json()["updated_at"]
    same = api("post", f"/v1/webhook_endpoints/{made['id']}", catalog.key, {"name": "hooks"}).json()
    assert same["updated_at"] == before
    changed = api(
        "post", f"/v1/webhook_endpoints/{made['id']}", catalog.key, {"event_types": ["message_batch.ended"]}
    ).json()
    assert changed["event_types"] == ["message_batch.ended"] and changed["name"] == "hooks"
    assert changed["updated_at"] > before


def test_another_owners_endpoint_is_not_found(catalog, receiver):
    made = create(catalog.key, receiver.url)
    other_sa = ServiceAccount.objects.create(project=catalog.project, name="sa-b", policy=catalog.policy)
    _, other_key = create_relay_key(service_account=other_sa)
    for method, path, body in [
        ("get", f"/v1/webhook_endpoints/{made['id']}", None),
        ("post", f"/v1/webhook_endpoints/{made['id']}", {"name": "mine now"}),
        ("delete", f"/v1/webhook_endpoints/{made['id']}", None),
        ("post", f"/v1/webhook_endpoints/{made['id']}/rotate_secret", {}),
        ("post", f"/v1/webhook_endpoints/{made['id']}/test", {"event_type": "batch.completed"}),
        ("get", f"/v1/webhook_endpoints/{made['id']}/deliveries", None),
    ]:
        resp = api(method, path, other_key, body)
        assert resp.status_code == 404, (method, path, resp.content)
        assert resp.json()["error"]["message"].startswith("No webhook endpoint found")
    assert api("get", "/v1/webhook_endpoints", other_key).json()["data"] == []
    assert not receiver.received and WebhookEndpoint.objects.get().name == "hooks"
    assert api("get", "/v1/webhook_endpoints", "sk-wr-not-a-key").status_code == 401


def test_list_pages_newest_first_and_delete(catalog, receiver):
    ids = [create(catalog.key, receiver.url, name=f"e{i}")["id"] for i in range(3)]
    first = api("get", "/v1/webhook_endpoints", catalog.key, {"limit": "2"}).json()
    assert [e["id"] for e in first["data"]] == ids[:0:-1] and first["has_more"] is True
    rest = api("get", "/v1/webhook_endpoints", catalog.key, {"limit": "2", "after": first["last_id"]}).json()
    assert [e["id"] for e in rest["data"]] == [ids[0]] and rest["has_more"] is False
    assert api("get", "/v1/webhook_endpoints", catalog.key, {"limit": "0"}).status_code == 400
    gone = api("delete", f"/v1/webhook_endpoints/{ids[1]}", catalog.key).json()
    assert gone == {"id": ids[1], "object": "webhook_endpoint.deleted", "deleted": True}
    assert api("get", f"/v1/webhook_endpoints/{ids[1]}", catalog.key).status_code == 404


def test_event_types_lists_every_type_the_relay_emits(catalog):
    resp = api("get", "/v1/webhook_event_types", catalog.key)
    assert resp.json() == {"object": "list", "data": ALL_TYPES}
    assert api("get", "/openai/v1/webhook_event_types", catalog.key).json()["data"] == ALL_TYPES


# --- the outbox: written with the final move ---------------------------------------------------------


@pytest.mark.parametrize(
    "surface, status, event_type, data_id",
    [
        (Surface.OPENAI, BatchStatus.COMPLETED, "batch.completed", "batch_{hex}"),
        (Surface.OPENAI, BatchStatus.EXPIRED, "batch.expired", "batch_{hex}"),
        (Surface.OPENAI, BatchStatus.FAILED, "batch.failed", "batch_{hex}"),
        (Surface.ANTHROPIC, BatchStatus.COMPLETED, "message_batch.ended", "msgbatch_{hex}"),
        (Surface.ANTHROPIC, BatchStatus.EXPIRED, "message_batch.ended", "msgbatch_{hex}"),
        (Surface.NATIVE, BatchStatus.COMPLETED, "batch.completed", "{uuid}"),
    ],
)
def test_a_final_move_writes_one_event_per_subscribed_endpoint(catalog, receiver, surface, status, event_type, data_id):
    create(catalog.key, receiver.url, name="all")
    create(catalog.key, receiver.url, types=["batch.cancelled"], name="cancels only")
    first = BatchStatus.VALIDATING if status == BatchStatus.FAILED else None
    batch = a_batch(catalog, surface, status=first)
    with transaction.atomic():
        assert end(batch, status)
    event = Event.objects.get()
    body = json.loads(event.body)
    assert body == {
        "id": event.public_id,
        "object": "event",
        "type": event_type,
        "created_at": int(event.created_at.timestamp()),
        "data": {"id": data_id.format(hex=batch.id.hex, uuid=batch.id)}
        | ({"processing_status": "ended"} if surface == Surface.ANTHROPIC else {}),
    }
    assert [d.endpoint.name for d in Delivery.objects.select_related("endpoint")] == ["all"]
    assert not end(batch, status)  # a second move is refused: still one event
    assert Event.objects.count() == 1


def test_the_event_commits_with_the_move_or_not_at_all(catalog, receiver):
    create(catalog.key, receiver.url)
    batch = a_batch(catalog)
    with pytest.raises(RuntimeError), transaction.atomic():
        assert states.move(batch.pk, Surface.NATIVE, BatchStatus.COMPLETED)
        assert Event.objects.count() == 1
        raise RuntimeError("the caller's transaction fails after the move")
    assert not Event.objects.exists() and Batch.objects.get(pk=batch.pk).status == BatchStatus.QUEUED
    # Moves that are not final write nothing; neither does a batch of an owner without endpoints.
    states.move(batch.pk, Surface.NATIVE, BatchStatus.RUNNING)
    other_sa = ServiceAccount.objects.create(project=catalog.project, name="sa-c", policy=catalog.policy)
    _, other_key = create_relay_key(service_account=other_sa)
    theirs = a_batch(catalog, key=other_key)
    assert states.move(theirs.pk, Surface.NATIVE, BatchStatus.COMPLETED)
    assert not Event.objects.exists()


# --- one delivery at a time ----------------------------------------------------------------------------


def ended_event(catalog, receiver, **create_kw):
    made = create(catalog.key, receiver.url, **create_kw)
    batch = a_batch(catalog, Surface.OPENAI)
    with transaction.atomic():
        end(batch, BatchStatus.COMPLETED)
    return made, batch, Delivery.objects.get()


def test_a_delivery_is_signed_as_standard_webhooks_and_the_openai_sdk_verify(catalog, receiver, caplog):
    made, batch, d = ended_event(catalog, receiver)
    with caplog.at_level(logging.DEBUG):
        assert deliveries.deliver(d.pk) == "delivered"
    (got,) = receiver.received
    assert got.headers["webhook-id"] == d.webhook_id and got.headers["content-type"] == "application/json"
    payload = verify_both(made["signing_secret"], got)
    assert payload["type"] == "batch.completed" and payload["data"] == {"id": f"batch_{batch.id.hex}"}
    assert got.body == Event.objects.get().body.encode()
    with pytest.raises(WebhookVerificationError):  # another secret does not verify it
        Webhook(services.signing.new_secret()).verify(got.body, got.headers)
    d.refresh_from_db()
    assert d.outcome == "delivered" and d.attempts == 1 and d.delivered_at is not None
    attempt = DeliveryAttempt.objects.get()
    assert attempt.status_code == 200 and attempt.response_head == "ok" and attempt.delivered
    assert made["signing_secret"] not in caplog.text and made["signing_secret"][6:] not in caplog.text
    assert deliveries.deliver(d.pk) == "skipped"  # a duplicate message sends nothing
    assert len(receiver.received) == 1


def test_failures_retry_with_backoff_the_same_id_and_body_and_a_fresh_signature(catalog, receiver):
    made, _, d = ended_event(catalog, receiver)
    receiver.script.extend([(500, 0, {}, b"x" * 5000), (302, 0, {"Location": receiver.url}, b""), (204, 0, {}, b"")])
    before = timezone.now()
    assert deliveries.deliver(d.pk) == "retry"
    d.refresh_from_db()
    assert d.outcome == "pending" and d.attempts == 1 and d.last_status_code == 500
    assert before + timedelta(seconds=1) <= d.next_attempt_at <= timezone.now() + timedelta(seconds=2)
    assert deliveries.deliver(d.pk) == "skipped"  # not due yet
    Delivery.objects.update(next_attempt_at=timezone.now())
    assert deliveries.deliver(d.pk) == "retry"  # a 3xx is a failed attempt: the redirect is not followed
    d.refresh_from_db()
    assert "redirects are not followed" in d.last_error and len(receiver.received) == 2
    assert timezone.now() + timedelta(seconds=1) < d.next_attempt_at <= timezone.now() + timedelta(seconds=4)
    Delivery.objects.update(next_attempt_at=timezone.now())
    assert deliveries.deliver(d.pk) == "delivered"
    got = receiver.received
    assert len({r.headers["webhook-id"] for r in got}) == 1 and len({r.body for r in got}) == 1
    for r in got:  # each attempt is signed with its own time: receivers refuse old timestamps
        assert abs(int(r.headers["webhook-timestamp"]) - r.at) <= 1
    verify_both(made["signing_secret"], got[-1])
    log = list(DeliveryAttempt.objects.order_by("number").values_list("number", "status_code", "delivered"))
    assert log == [(1, 500, False), (2, 302, False), (3, 204, True)]
    assert len(DeliveryAttempt.objects.get(number=1).response_head) == 1024  # the answer's first KiB


def test_backoff_gaps_grow_and_never_exceed_the_maximum(webhook_settings):
    for n in range(1, 40):
        ceiling = min(16.0, 2.0 * 2 ** (n - 1))
        for _ in range(20):
            assert ceiling / 2 <= deliveries.gap(n) <= ceiling <= 16.0


def test_an_address_refused_at_delivery_is_a_failed_attempt(catalog, receiver, webhook_settings):
    webhook_settings.RELAY_WEBHOOK_ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
    made = create(catalog.key, f"https://localhost:{receiver.server.server_address[1]}/hooks")
    with transaction.atomic():
        end(a_batch(catalog, Surface.OPENAI), BatchStatus.COMPLETED)
    d = Delivery.objects.get()
    webhook_settings.RELAY_WEBHOOK_ALLOWED_HOSTS = []  # the name is checked again at every delivery
    assert deliveries.deliver(d.pk) == "retry"
    d.refresh_from_db()
    assert d.last_error == (
        "refused: localhost resolves to 127.0.0.1, which is a loopback address; "
        "webhook endpoints must be on public addresses"
    )
    webhook_settings.RELAY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]  # http to a listed host, then no longer listed
    assert api("post", f"/v1/webhook_endpoints/{made['id']}", catalog.key, {"url": receiver.url}).status_code == 200
    webhook_settings.RELAY_WEBHOOK_ALLOWED_HOSTS = []
    Delivery.objects.update(next_attempt_at=timezone.now())
    assert deliveries.deliver(d.pk) == "retry"
    d.refresh_from_db()
    assert d.last_error == "refused: must use https (got http)" and not receiver.received


def test_a_delivery_gives_up_at_max_age_while_the_endpoint_otherwise_answers(catalog, receiver):
    _, _, d = ended_event(catalog, receiver)
    old = timezone.now() - timedelta(seconds=3600)
    # Another delivery to the endpoint answered 2xx within the schedule: the endpoint works, this event fails.
    Delivery.objects.update(schedule_from=old)
    other = a_batch(catalog, Surface.OPENAI)
    with transaction.atomic():
        end(other, BatchStatus.COMPLETED)
    second = Delivery.objects.exclude(pk=d.pk).get()
    assert deliveries.deliver(second.pk) == "delivered"
    receiver.default = (400, 0, {}, b"refused")
    assert deliveries.deliver(d.pk) == "failed"
    d.refresh_from_db()
    assert d.outcome == "failed" and WebhookEndpoint.objects.get().paused_at is None


def test_an_endpoint_failing_every_delivery_for_max_age_is_paused_and_resumed_gets_what_waited(catalog, receiver):
    _, _, d = ended_event(catalog, receiver)
    receiver.default = (503, 0, {}, b"down")
    assert deliveries.deliver(d.pk) == "retry"
    old = timezone.now() - timedelta(seconds=3601)
    WebhookEndpoint.objects.update(failing_since=old)
    Delivery.objects.update(schedule_from=old, next_attempt_at=timezone.now())
    assert deliveries.deliver(d.pk) == "paused"
    endpoint = WebhookEndpoint.objects.get()
    d.refresh_from_db()
    assert endpoint.paused_at is not None and d.outcome == "pending"  # kept
    assert deliveries.deliver(d.pk) == "paused" and len(receiver.received) == 2  # nothing sent while paused
    assert api("get", f"/v1/webhook_endpoints/{endpoint.public_id}", catalog.key).json()["paused_at"] is not None
    receiver.default = (200, 0, {}, b"ok")
    with transaction.atomic():
        assert services.resume(endpoint) == 1
    assert deliveries.deliver(d.pk) == "delivered" and len(receiver.received) == 3


def test_a_failing_endpoint_that_answers_again_releases_its_backlog_and_is_probed(catalog, receiver):
    made = create(catalog.key, receiver.url)
    for _ in range(3):
        with transaction.atomic():
            end(a_batch(catalog, Surface.OPENAI), BatchStatus.COMPLETED)
    all_three = list(Delivery.objects.order_by("id"))
    receiver.default = (503, 0, {}, b"down")
    far = timezone.now() + timedelta(hours=1)
    for d in all_three:
        Delivery.objects.filter(pk=d.pk).update(next_attempt_at=timezone.now())
        assert deliveries.deliver(d.pk) == "retry"
    Delivery.objects.update(next_attempt_at=far)
    # Not tried for a probe interval: the sweep makes its next delivery due now.
    WebhookEndpoint.objects.update(last_failure_at=timezone.now() - timedelta(seconds=31))
    assert housekeeping.probe(timezone.now()) == 1
    (probed,) = Delivery.objects.filter(next_attempt_at__lte=timezone.now())
    assert housekeeping.probe(timezone.now()) == 0  # one probe per interval: its next is due already
    receiver.default = (200, 0, {}, b"ok")
    assert deliveries.deliver(probed.pk) == "delivered"
    # Back: everything that waited is due now, not at its backoff's end.
    assert Delivery.objects.filter(outcome="pending", next_attempt_at__lte=timezone.now()).count() == 2
    assert WebhookEndpoint.objects.get().failing_since is None
    for d in Delivery.objects.filter(outcome="pending"):
        assert deliveries.deliver(d.pk) == "delivered"
    event_ids = {json.loads(body)["id"] for body in Event.objects.values_list("body", flat=True)}
    assert {verify_both(made["signing_secret"], r)["id"] for r in receiver.received[-3:]} == event_ids


def test_a_native_cancel_is_sent_once_the_batch_is_done(catalog, receiver):
    made = create(catalog.key, receiver.url)
    batch = a_batch(catalog, Surface.NATIVE, status=BatchStatus.RUNNING)
    assert states.move(batch.pk, Surface.NATIVE, BatchStatus.CANCELLED)  # running items still stopping
    d = Delivery.objects.get()
    assert d.event.waits_for_batch
    assert deliveries.deliver(d.pk) == "waiting" and not receiver.received
    Batch.objects.filter(pk=batch.pk).update(completed_at=timezone.now())  # its last running item stopped
    Delivery.objects.update(next_attempt_at=timezone.now())
    assert deliveries.deliver(d.pk) == "delivered"
    payload = verify_both(made["signing_secret"], receiver.received[0])
    assert payload["type"] == "batch.cancelled" and payload["data"] == {"id": str(batch.id)}


def test_rotation_keeps_the_old_secret_signing_for_24_hours_only_when_asked(catalog, receiver):
    made, _, d = ended_event(catalog, receiver)
    path = f"/v1/webhook_endpoints/{made['id']}/rotate_secret"
    kept = api("post", path, catalog.key, {"keep_old_secret_active_for_24_hours": True}).json()
    assert kept["signing_secret"] != made["signing_secret"] and kept["updated_at"] >= made["updated_at"]
    assert deliveries.deliver(d.pk) == "delivered"
    both = receiver.received[-1]
    assert len(both.headers["webhook-signature"].split(" ")) == 2
    verify_both(made["signing_secret"], both)
    verify_both(kept["signing_secret"], both)
    fresh = api("post", path, catalog.key).json()  # no body: the old secret stops at once
    services.resend(Delivery.objects.get())
    assert deliveries.deliver(d.pk) == "delivered"
    only = receiver.received[-1]
    verify_both(fresh["signing_secret"], only)
    with pytest.raises(WebhookVerificationError):
        Webhook(kept["signing_secret"]).verify(only.body, only.headers)
    assert api("post", path, catalog.key, {"keep_old_secret_active_for_24_hours": "yes"}).status_code == 400


def test_the_test_route_queues_a_real_signed_sample_at_once_and_the_lane_sends_it_once(catalog, receiver):
    made = create(catalog.key, receiver.url)
    receiver.script.append((418, 0, {}, b"teapot"))
    path = f"/v1/webhook_endpoints/{made['id']}/test"
    resp = api("post", path, catalog.key, {"event_type": "message_batch.ended"})
    assert resp.status_code == 202, resp.content  # queued: no web thread waits for the receiver
    queued = resp.json()
    assert queued["object"] == "webhook_endpoint.delivery" and queued["status"] == "pending" and queued["test"]
    assert queued["event"]["type"] == "message_batch.ended" and queued["attempts"] == 0
    assert not receiver.received
    test_delivery = Delivery.objects.get()
    assert deliveries.deliver(test_delivery.pk) == "failed"  # the lane's attempt: a test is sent once
    shown = api("get", f"/v1/webhook_endpoints/{made['id']}/deliveries/{queued['id']}", catalog.key).json()
    assert shown["status"] == "failed" and shown["last_status_code"] == 418 and shown["next_attempt_at"] is None
    assert shown["latest_attempts"][0]["response_head"] == "teapot"
    payload = Webhook(made["signing_secret"]).verify(receiver.received[0].body, receiver.received[0].headers)
    assert payload["type"] == "message_batch.ended" and payload["data"]["id"].startswith("msgbatch_")
    endpoint = WebhookEndpoint.objects.get()
    assert endpoint.failing_since is None and endpoint.consecutive_failures == 0  # a test says nothing of health
    assert api("post", path, catalog.key, {"event_type": "response.completed"}).status_code == 400
    assert api("post", path, catalog.key, {}).json()["error"]["code"] == "missing_required_parameter"
    assert Delivery.objects.count() == 1  # refused tests write nothing
    ok = api("post", path, catalog.key, {"event_type": "batch.completed"}).json()
    assert deliveries.deliver(Delivery.objects.get(pk=selectors_pk(ok["id"])).pk) == "delivered"
    missing = api("get", f"/v1/webhook_endpoints/{made['id']}/deliveries/wh_{'0' * 32}", catalog.key)
    assert missing.status_code == 404 and missing.json()["error"]["message"].startswith("No delivery found")


def selectors_pk(public_id: str):
    from batches.webhooks import selectors

    return selectors.parse_public_id(public_id, "wh_")


def test_deliveries_are_listed_newest_first_and_resent_with_the_same_webhook_id(catalog, receiver):
    made, batch, d = ended_event(catalog, receiver)
    receiver.script.append((500, 0, {}, b"oops"))
    deliveries.deliver(d.pk)
    listed = api("get", f"/v1/webhook_endpoints/{made['id']}/deliveries", catalog.key).json()
    (shown,) = listed["data"]
    assert shown["id"] == shown["webhook_id"] == d.webhook_id and shown["status"] == "pending"
    assert shown["event"]["data"] == {"id": f"batch_{batch.id.hex}"} and shown["attempts"] == 1
    assert shown["latest_attempts"][0]["status_code"] == 500 and shown["latest_attempts"][0]["response_head"] == "oops"
    Delivery.objects.update(next_attempt_at=timezone.now())
    deliveries.deliver(d.pk)
    resent = api("post", f"/v1/webhook_endpoints/{made['id']}/deliveries/{d.webhook_id}/resend", catalog.key)
    assert resent.status_code == 200 and resent.json()["status"] == "pending"
    assert deliveries.deliver(d.pk) == "delivered"
    assert [r.headers["webhook-id"] for r in receiver.received] == [d.webhook_id] * 3
    missing = api("post", f"/v1/webhook_endpoints/{made['id']}/deliveries/wh_{'0' * 32}/resend", catalog.key)
    assert missing.status_code == 404


def test_metrics_show_deliveries_by_outcome_and_the_oldest_waiting_event(catalog, receiver):
    made, _, d = ended_event(catalog, receiver)
    Delivery.objects.update(created_at=timezone.now() - timedelta(seconds=120))
    page = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer test-admin-token").content.decode()
    assert 'relay_webhook_deliveries{outcome="pending"} 1.0' in page
    assert 'relay_webhook_deliveries{outcome="delivered"} 0.0' in page
    age = next(line for line in page.splitlines() if line.startswith("relay_webhook_oldest_undelivered_age_seconds"))
    assert 119 <= float(age.split()[-1]) <= 180
    assert made["signing_secret"] not in page and made["signing_secret"][6:] not in page
    deliveries.deliver(d.pk)
    page = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer test-admin-token").content.decode()
    assert 'relay_webhook_deliveries{outcome="delivered"} 1.0' in page
    assert "relay_webhook_oldest_undelivered_age_seconds 0.0" in page


def test_a_lease_holds_a_delivery_until_it_runs_out_and_a_lost_lease_records_nothing(catalog, receiver):
    _, _, d = ended_event(catalog, receiver)
    (first,) = deliveries.claim([d.pk], "lane-a")
    assert deliveries.claim([d.pk], "lane-b") == []  # held: a second lane does not send it at once
    assert deliveries.deliver(d.pk) == "skipped"
    # Lane a died mid-POST: once its lease has run out, the delivery is due again and another lane takes it.
    Delivery.objects.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    (second,) = deliveries.claim([d.pk], "lane-b")
    answer = deliveries.attempt(first)  # lane a's POST, answered after all
    assert deliveries.finish(first, answer) == "skipped"  # fenced: a lost lease records nothing
    assert deliveries.finish(second, deliveries.attempt(second)) == "delivered"
    d.refresh_from_db()
    assert d.attempts == 1 and d.lease_owner == "" and d.lease_expires_at is None
    assert DeliveryAttempt.objects.count() == 1


def test_an_attempt_that_outlived_its_lease_cannot_record_over_the_same_lanes_next_claim(catalog, receiver):
    _, _, d = ended_event(catalog, receiver)
    (first,) = deliveries.claim([d.pk], "lane-a")
    Delivery.objects.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    (again,) = deliveries.claim([d.pk], "lane-a")  # the same lane claims it again: a lease of its own
    assert first.lease != again.lease
    assert deliveries.finish(first, deliveries.attempt(first)) == "skipped"
    assert deliveries.finish(again, deliveries.attempt(again)) == "delivered"
    assert DeliveryAttempt.objects.count() == 1


def test_the_admin_shows_deliveries_and_paused_endpoints_and_resends(catalog, receiver, client, django_user_model):
    from django.urls import reverse

    client.force_login(django_user_model.objects.create_superuser("root", "root@example.com", "pw"))
    made, _, d = ended_event(catalog, receiver)
    receiver.script.append((500, 0, {}, b"<html>boom</html>"))
    deliveries.deliver(d.pk)
    WebhookEndpoint.objects.update(paused_at=timezone.now())
    endpoint = WebhookEndpoint.objects.get()
    pages = [
        reverse("admin:webhooks_webhookendpoint_changelist"),
        reverse("admin:webhooks_webhookendpoint_change", args=[endpoint.pk]),
        reverse("admin:webhooks_delivery_changelist"),
        reverse("admin:webhooks_delivery_change", args=[d.pk]),
    ]
    for url in pages:
        page = client.get(url)
        assert page.status_code == 200, url
        text = page.content.decode()
        assert made["signing_secret"] not in text and made["signing_secret"][6:] not in text
    assert "Paused since" in client.get(pages[1]).content.decode()
    detail = client.get(pages[3]).content.decode()
    assert d.webhook_id in detail and "&lt;html&gt;boom&lt;/html&gt;" in detail and "batch.completed" in detail
    client.post(pages[0], {"action": "resume", "_selected_action": [endpoint.pk]})
    assert WebhookEndpoint.objects.get().paused_at is None
    assert deliveries.deliver(d.pk) == "delivered"
    client.post(pages[2], {"action": "resend", "_selected_action": [d.pk]})
    assert Delivery.objects.get().outcome == "pending"
    assert deliveries.deliver(d.pk) == "delivered"
    assert [r.headers["webhook-id"] for r in receiver.received] == [d.webhook_id] * 3


def test_the_answers_match_the_openapi_schema(catalog, receiver):
    from tests.test_openapi import check

    schema = json.loads(Client().get("/api/schema/", {"format": "json"}).content)
    made_resp = api(
        "post", "/v1/webhook_endpoints", catalog.key, {"url": receiver.url, "name": "n", "event_types": ALL_TYPES}
    )
    made = check(schema, "/v1/webhook_endpoints", "post", made_resp)
    one = f"/v1/webhook_endpoints/{made['id']}"
    check(schema, "/v1/webhook_endpoints", "get", api("get", "/v1/webhook_endpoints", catalog.key))
    check(schema, "/v1/webhook_endpoints/{endpoint_id}", "get", api("get", one, catalog.key))
    check(schema, "/v1/webhook_endpoints/{endpoint_id}", "post", api("post", one, catalog.key, {"name": "m"}))
    check(
        schema,
        "/v1/webhook_endpoints/{endpoint_id}/rotate_secret",
        "post",
        api("post", one + "/rotate_secret", catalog.key),
    )
    test = api("post", one + "/test", catalog.key, {"event_type": "batch.failed"})
    check(schema, "/v1/webhook_endpoints/{endpoint_id}/test", "post", test)
    listed = check(
        schema, "/v1/webhook_endpoints/{endpoint_id}/deliveries", "get", api("get", one + "/deliveries", catalog.key)
    )
    shown = api("get", f"{one}/deliveries/{listed['data'][0]['id']}", catalog.key)
    check(schema, "/v1/webhook_endpoints/{endpoint_id}/deliveries/{delivery_id}", "get", shown)
    check(schema, "/v1/webhook_endpoints/{endpoint_id}/resume", "post", api("post", one + "/resume", catalog.key))
    resend = api("post", f"{one}/deliveries/{listed['data'][0]['id']}/resend", catalog.key)
    check(schema, "/v1/webhook_endpoints/{endpoint_id}/deliveries/{delivery_id}/resend", "post", resend)
    check(schema, "/v1/webhook_event_types", "get", api("get", "/v1/webhook_event_types", catalog.key))
    check(
        schema,
        "/v1/webhook_endpoints/{endpoint_id}",
        "get",
        api("get", f"/v1/webhook_endpoints/we_{'0' * 32}", catalog.key),
    )
    check(schema, "/v1/webhook_endpoints/{endpoint_id}", "delete", api("delete", one, catalog.key))
