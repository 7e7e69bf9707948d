"""Webhooks end to end: an endpoint registered with the `openai` SDK's `client.webhooks.create(...)`, OpenAI,
Anthropic and native batches run by real worker processes (the item worker, the control worker, the webhook
lane that delivers, beat) against real PostgreSQL and Redis, and a receiver on loopback that checks every
delivery with the SDK's `unwrap()` and the `standardwebhooks` package — through a receiver outage, a webhook
lane killed mid-delivery and a Redis flush. In-process details: tests/test_webhooks_api.py."""

import json
from collections import Counter

import openai
import pytest
import requests
from standardwebhooks import Webhook

from batches.models import Batch
from batches.webhooks.models import Delivery, DeliveryAttempt
from core.redis import get_redis
from devkit.upstream import Reply
from tests.webhook_receiver import Receiver
from tests.workers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

ALL_TYPES = ["batch.completed", "batch.failed", "batch.expired", "batch.cancelled", "message_batch.ended"]
# Short schedules, so retries and re-sent messages are seen in seconds.
WEBHOOK_ENV = {
    "RELAY_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
    "RELAY_WEBHOOK_RETRY_BASE_SECONDS": "0.2",
    "RELAY_WEBHOOK_RETRY_MAX_SECONDS": "0.5",
    "RELAY_WEBHOOK_POLL_SECONDS": "0.5",
    "RELAY_WEBHOOK_PROBE_SECONDS": "1",
    # Short attempts, so an interrupted attempt's lease runs out in seconds (2 + 1 + 2 + 5).
    "RELAY_WEBHOOK_TIMEOUT_SECONDS": "2",
    "RELAY_WEBHOOK_DNS_TIMEOUT_SECONDS": "1",
}
CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def worker_env():
    return WEBHOOK_ENV


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture
def sdk(live_server, catalog, worker, settings):
    assert worker.alive(), worker.output()
    settings.RELAY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]  # the live server runs in this process
    with openai.OpenAI(base_url=live_server.url + "/v1", api_key=catalog.key, max_retries=0) as client:
        yield client


def verified(sdk, secret: str, received) -> dict:
    """Every delivery verifies with the SDK's unwrap() and the standardwebhooks package, unchanged."""
    event = sdk.webhooks.unwrap(received.body, received.headers, secret=secret)
    payload = Webhook(secret).verify(received.body, received.headers)
    assert event.id == payload["id"] and event.type == payload["type"] and event.data.id == payload["data"]["id"]
    return payload


def native(live_server, key: str, n: int = 2) -> str:
    resp = requests.post(
        live_server.url + "/v1/batches",
        json={"shape": "openai", "requests": [CHAT] * n},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def jsonl(records) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def record(custom_id: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": CHAT}


def test_one_verified_event_per_batch_end_on_every_surface(sdk, live_server, catalog, fake, receiver):
    endpoint = sdk.webhooks.create(url=receiver.url, name="batch ends", event_types=ALL_TYPES)
    assert endpoint.signing_secret.startswith("whsec_") and endpoint.event_types == ALL_TYPES
    assert sdk.webhooks.retrieve(endpoint.id).signing_secret_hint == endpoint.signing_secret_hint
    secret = endpoint.signing_secret
    expected = {}

    good = sdk.files.create(file=("in.jsonl", jsonl([record("a"), record("b")])), purpose="batch")
    done = sdk.batches.create(input_file_id=good.id, endpoint="/v1/chat/completions", completion_window="24h")
    expected[done.id] = "batch.completed"
    bad = sdk.files.create(file=("bad.jsonl", jsonl([record("a")]) + b"not json\n"), purpose="batch")
    failed = sdk.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h")
    expected[failed.id] = "batch.failed"
    anthropic = requests.post(
        live_server.url + "/v1/messages/batches",
        json={
            "requests": [
                {
                    "custom_id": "q",
                    "params": {
                        "model": "claude-sonnet",
                        "max_tokens": 8,
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                }
            ]
        },
        headers={"x-api-key": catalog.key},
        timeout=30,
    )
    assert anthropic.status_code == 200, anthropic.text
    expected[anthropic.json()["id"]] = "message_batch.ended"
    expected[native(live_server, catalog.key)] = "batch.completed"
    # A native batch cancelled while its items run: its event comes once the running ones have stopped.
    fake.script("*", [Reply(delay=1.0) for _ in range(4)])
    slow = native(live_server, catalog.key, n=4)
    wait_for(lambda: Batch.objects.get(pk=slow).items.filter(state="running").exists(), 60, what="items running")
    cancel = requests.post(
        f"{live_server.url}/v1/batches/{slow}/cancel", headers={"Authorization": f"Bearer {catalog.key}"}, timeout=30
    )
    assert cancel.json() == {"status": "cancelled"}
    expected[slow] = "batch.cancelled"

    receiver.wait_for(len(expected), timeout=60)
    got = {}
    for received in receiver.received:
        payload = verified(sdk, secret, received)
        got.setdefault(payload["data"]["id"], []).append((payload["type"], received.headers["webhook-id"]))
        if payload["data"]["id"] == slow:  # sent once the batch was done, not at the cancel
            assert Batch.objects.get(pk=slow).completed_at.timestamp() <= received.at
    assert {batch_id: [kind for kind, _ in events] for batch_id, events in got.items()} == {
        batch_id: [kind] for batch_id, kind in expected.items()
    }
    assert len({webhook_id for events in got.values() for _, webhook_id in events}) == len(expected)
    anthropic_event = next(json.loads(r.body) for r in receiver.received if b"message_batch.ended" in r.body)
    assert anthropic_event["data"]["processing_status"] == "ended"
    assert sdk.batches.retrieve(done.id).status == "completed" and sdk.batches.retrieve(failed.id).status == "failed"

    listed = requests.get(
        f"{live_server.url}/v1/webhook_endpoints/{endpoint.id}/deliveries",
        headers={"Authorization": f"Bearer {catalog.key}"},
        timeout=30,
    ).json()
    assert {d["status"] for d in listed["data"]} == {"delivered"} and len(listed["data"]) == len(expected)
    sdk.webhooks.delete(endpoint.id)


def test_a_receiver_outage_is_ridden_out_with_the_same_webhook_id(sdk, live_server, catalog, receiver):
    endpoint = sdk.webhooks.create(url=receiver.url, name="flaky", event_types=["batch.completed"])
    receiver.default = (503, 0, {}, b"down for maintenance")
    batch_id = native(live_server, catalog.key, n=1)
    receiver.wait_for(3, timeout=15)  # retried with backoff while it is down
    receiver.default = (200, 0, {}, b"ok")
    delivery = wait_for(
        lambda: Delivery.objects.filter(event__batch_id=batch_id, outcome="delivered").first(), 15, what="delivery"
    )
    attempts = list(DeliveryAttempt.objects.filter(delivery=delivery).order_by("number"))
    assert len(attempts) >= 4 and attempts[-1].status_code == 200 and attempts[0].status_code == 503
    assert attempts[0].response_head == "down for maintenance"
    assert {r.headers["webhook-id"] for r in receiver.received} == {delivery.webhook_id}
    assert len({r.body for r in receiver.received}) == 1
    payload = verified(sdk, endpoint.signing_secret, receiver.received[-1])
    assert payload == {**payload, "type": "batch.completed", "data": {"id": batch_id}}


def test_the_webhook_lane_killed_mid_delivery_and_a_redis_flush_lose_no_event(
    sdk, live_server, catalog, receiver, worker
):
    endpoint = sdk.webhooks.create(url=receiver.url, name="durable", event_types=["batch.completed"])
    # Deliveries are mid-POST in the lane (the receiver holds them) …
    receiver.hold.clear()
    receiver.default = (200, None, {}, b"ok")
    held = [native(live_server, catalog.key, n=1) for _ in range(3)]
    receiver.wait_for(len(held), timeout=15)
    assert worker.procs["control"].poll() is None  # the control worker sends none of them
    # … when the lane is killed and Redis (its wake-ups) flushed; an event raised while no lane runs waits.
    worker.kill("webhooks")
    get_redis().flushdb()
    waiting = native(live_server, catalog.key, n=1)
    wait_for(lambda: Delivery.objects.filter(event__batch_id=waiting).exists(), 15, what="the waiting event")
    receiver.default = (200, 0, {}, b"ok")
    receiver.hold.set()
    worker.restart("webhooks")
    # The new lane finds the waiting one at once and the interrupted ones once their leases run out.
    wait_for(lambda: Delivery.objects.filter(outcome="delivered").count() == len(held) + 1, 40, what="every event")
    seen = Counter()
    for received in receiver.received:
        seen[(verified(sdk, endpoint.signing_secret, received)["data"]["id"], received.headers["webhook-id"])] += 1
    # At least once: the interrupted ones twice, with the same webhook-id; the waiting one once.
    assert {batch_id for batch_id, _ in seen} == {*held, waiting}
    assert all(seen[key] == (1 if key[0] == waiting else 2) for key in seen), seen
