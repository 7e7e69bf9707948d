"""Anthropic's Message Batches API end to end: the official `anthropic` SDK, unchanged, against the live server
and a real Celery worker (items, the sweeper); real PostgreSQL and Redis; the fake upstream. Then each step in
process: create checks, errors in Anthropic's envelope, ownership, expiry, usage and discount."""

import io
import json
import threading
from datetime import timedelta

import anthropic
import pytest
from django.test import Client, override_settings
from django.utils import timezone

from batches import anthropic_batches, ingest, services
from batches.models import Batch, Item
from policies.models import Policy
from relay import auth
from relay.demo_upstream import Reply
from relay.services import create_relay_key
from tests.workers import wait_for
from usage.models import UsageEvent

# Tests that run items need committed rows: the worker (or the heartbeat thread) reads them on its own connection.
runs_items = pytest.mark.django_db(transaction=True)
in_process = pytest.mark.django_db

UPSTREAM_400 = {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: too large"}}


def req(custom_id, content="hello", model="claude-sonnet", **params):
    return {
        "custom_id": custom_id,
        "params": {"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": content}], **params},
    }


@pytest.fixture
def client(live_server, catalog, worker):
    assert worker.alive(), worker.output()
    with anthropic.Anthropic(base_url=live_server.url, api_key=catalog.key, max_retries=0) as sdk:
        yield sdk


def wait_ended(client, batch_id, timeout=30.0):
    def ended():
        b = client.messages.batches.retrieve(batch_id)
        return b if b.processing_status == "ended" else None

    return wait_for(ended, timeout, interval=0.2, what=f"message batch {batch_id} to end")


def results(client, batch_id) -> dict:
    return {r.custom_id: r.result for r in client.messages.batches.results(batch_id)}


# --- the whole flow through the SDK --------------------------------------------------------------


@runs_items
def test_sdk_create_retrieve_list_results_cancel_delete(client, catalog, fake, live_server):
    # One request gets the upstream's 400 (the first call to arrive): which one, the fake tells us.
    fake.script("upstream-anthropic-0", [Reply(status=400, body=UPSTREAM_400)])
    created = client.messages.batches.create(
        requests=[req("q-1", "first question"), req("q-2", "second question"), req("q-3", "third question")]
    )
    assert created.id.startswith("msgbatch_") and created.type == "message_batch"
    assert created.processing_status == "in_progress" and created.results_url is None
    assert created.expires_at - created.created_at == timedelta(hours=24)
    assert created.request_counts.processing == 3 and created.ended_at is None and created.archived_at is None

    done = wait_ended(client, created.id)
    assert done.request_counts.succeeded == 2 and done.request_counts.errored == 1
    assert done.request_counts.processing == done.request_counts.canceled == done.request_counts.expired == 0
    assert done.ended_at >= done.created_at and done.cancel_initiated_at is None
    assert done.results_url == f"{live_server.url}/v1/messages/batches/{done.id}/results"

    # Results, joined to the requests by custom_id.
    got = results(client, done.id)
    assert set(got) == {"q-1", "q-2", "q-3"}
    first = next(r for r in fake.received if r["key"] == "upstream-anthropic-0")
    bad = {"first question": "q-1", "second question": "q-2", "third question": "q-3"}[
        first["body"]["messages"][0]["content"]
    ]
    assert got[bad].type == "errored"
    assert got[bad].to_dict()["error"] == UPSTREAM_400  # the upstream's 400 body, kept as it answered
    for custom_id, content in (("q-1", "first question"), ("q-2", "second question"), ("q-3", "third question")):
        if custom_id != bad:
            result = got[custom_id]
            assert result.type == "succeeded" and result.message.type == "message"
            assert content in result.message.content[0].text
    assert first["path"] == "/v1/messages" and first["body"]["model"] == "claude-sonnet-4"  # routed like /v1/messages

    # One usage event per request, at the batch discount.
    pk = Batch.objects.get(surface="anthropic").pk
    events = UsageEvent.objects.filter(batch_id=str(pk))
    assert events.count() == 3 and {e.source for e in events} == {"batch"}

    # A batch whose requests the upstream holds: cancel → canceling → ended, every request canceled.
    gate = threading.Event()
    fake.script("upstream-anthropic-0", [Reply(gate=gate) for _ in range(3)])
    try:
        held = client.messages.batches.create(requests=[req(f"h-{i}") for i in range(3)])
        held_pk = anthropic_batches.parse_id(held.id)
        wait_for(lambda: Item.objects.filter(batch_id=held_pk, state="running").count() == 3, 20, what="3 running")
        with pytest.raises(anthropic.BadRequestError) as exc:
            client.messages.batches.delete(held.id)  # only an ended batch can be deleted
        assert exc.value.body["type"] == "invalid_request_error" or exc.value.status_code == 400
        with pytest.raises(anthropic.AnthropicError, match="results_url"):
            client.messages.batches.results(held.id)  # the SDK's own check: no results before the end
        canceling = client.messages.batches.cancel(held.id)
        assert canceling.processing_status == "canceling" and canceling.cancel_initiated_at is not None
        cancelled = wait_ended(client, held.id, timeout=15)
    finally:
        gate.set()
    assert cancelled.request_counts.canceled == 3 and cancelled.request_counts.succeeded == 0
    assert {r.type for r in results(client, held.id).values()} == {"canceled"}
    again = client.messages.batches.cancel(held.id)  # cancel is idempotent: an ended batch is returned as it is
    assert again.processing_status == "ended"

    # List, newest first, in pages: after_id goes to older batches, before_id back to newer ones.
    third = client.messages.batches.create(requests=[req("x")])
    page = client.messages.batches.list(limit=2)
    assert [b.id for b in page.data] == [third.id, held.id] and page.has_more is True
    assert page.first_id == third.id and page.last_id == held.id
    older = page.get_next_page()
    assert [b.id for b in older.data] == [created.id] and older.has_more is False
    assert [b.id for b in client.messages.batches.list(limit=1)] == [third.id, held.id, created.id]  # auto-paging
    newer = client.messages.batches.list(before_id=created.id, limit=1)
    assert [b.id for b in newer.data] == [held.id] and newer.has_more is True
    wait_ended(client, third.id)

    # Delete an ended batch: gone, and its id is a 404 from then on.
    deleted = client.messages.batches.delete(done.id)
    assert deleted.id == done.id and deleted.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.batches.retrieve(done.id)
    assert exc.value.body["error"]["type"] == "not_found_error"
    assert not Item.objects.filter(batch_id=pk).exists() and events.count() == 3  # usage stays


@runs_items
def test_anthropic_prefix_bearer_auth_and_ownership(live_server, catalog, fake, worker):
    assert worker.alive(), worker.output()
    # auth_token: the SDK sends `Authorization: Bearer`; base_url with the /anthropic prefix.
    with anthropic.Anthropic(base_url=live_server.url + "/anthropic", auth_token=catalog.key, max_retries=0) as sdk:
        created = sdk.messages.batches.create(requests=[req("a")])
        done = wait_ended(sdk, created.id)
        assert done.results_url == f"{live_server.url}/anthropic/v1/messages/batches/{done.id}/results"
        assert [r.result.type for r in sdk.messages.batches.results(done.id)] == ["succeeded"]
    _, other = create_relay_key(service_account=catalog.sa)
    with anthropic.Anthropic(base_url=live_server.url, api_key=other, max_retries=0) as theirs:
        for call in (
            theirs.messages.batches.retrieve,
            theirs.messages.batches.cancel,
            theirs.messages.batches.delete,
            theirs.messages.batches.results,
        ):
            with pytest.raises(anthropic.NotFoundError):
                call(created.id)
        assert theirs.messages.batches.list().data == []


# --- in process: create checks and errors --------------------------------------------------------


def post(body, key=None, path="/v1/messages/batches", **headers):
    extra = {f"HTTP_{name.upper().replace('-', '_')}": value for name, value in headers.items()}
    if key:
        extra["HTTP_X_API_KEY"] = key
    return Client().post(path, data=json.dumps(body), content_type="application/json", **extra)


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({}, "requests: Field required"),
        ({"requests": []}, "at least 1 item"),
        ({"requests": [req("a")], "extra": 1}, "extra: Extra inputs are not permitted"),
        ({"requests": [{"params": {}}]}, "requests.0.custom_id: Field required"),
        ({"requests": [req("a b")]}, "requests.0.custom_id"),
        ({"requests": [req("a" * 65)]}, "requests.0.custom_id"),
        ({"requests": [req("a"), req("a")]}, "Duplicate custom_id 'a'"),
        ({"requests": [{"custom_id": "a"}]}, "requests.0.params: Field required"),
        ({"requests": [{"custom_id": "a", "params": []}]}, "requests.0.params: Input should be an object"),
        ({"requests": [dict(req("a"), method="POST")]}, "requests.0.method: Extra inputs"),
        ({"requests": "nope"}, "requests must be an array"),
    ],
)
@in_process
def test_bad_create_is_400_in_anthropic_shape_and_stores_nothing(catalog, body, fragment):
    resp = post(body, catalog.key, **{"anthropic-version": "2023-06-01"})
    assert resp.status_code == 400, resp.content
    assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "invalid_request_error"
    assert fragment in resp.json()["error"]["message"]
    assert Batch.objects.count() == 0 and Item.objects.count() == 0


@in_process
def test_errors_are_in_anthropic_shape(catalog):
    resp = post({"requests": [req("a")]})
    assert resp.status_code == 401
    assert resp.json() == {"type": "error", "error": {"type": "authentication_error", "message": "missing relay key"}}
    resp = Client().get("/anthropic/v1/messages/batches/msgbatch_nope", HTTP_X_API_KEY=catalog.key)
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
    resp = Client().put("/v1/messages/batches", HTTP_X_API_KEY=catalog.key)
    assert resp.status_code == 405 and resp.json()["type"] == "error"
    resp = Client().get("/v1/messages/batches?limit=1001", HTTP_X_API_KEY=catalog.key)
    assert resp.status_code == 400 and "limit" in resp.json()["error"]["message"]
    with override_settings(RELAY_BATCH_MAX_ITEMS=2):
        resp = post({"requests": [req("a"), req("b"), req("c")]}, catalog.key)
    assert resp.status_code == 400 and "at most 2" in resp.json()["error"]["message"]
    with override_settings(RELAY_MAX_REQUEST_BYTES=100):
        resp = post({"requests": [req("a", "x" * 200)]}, catalog.key)
    assert resp.status_code == 413 and resp.json()["error"]["type"] == "request_too_large"
    Policy.objects.filter(pk=catalog.policy.pk).update(batch_enabled=False)
    resp = post({"requests": [req("a")]}, catalog.key)
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
    assert Batch.objects.count() == 0


@in_process
def test_ids_belong_to_their_surface(catalog):
    batch = create(catalog, [req("a")])
    assert batch.public_id == f"msgbatch_{batch.id.hex}"
    h = {"HTTP_AUTHORIZATION": f"Bearer {catalog.key}"}
    assert Client().get(f"/v1/messages/batches/{batch.public_id}", **h).status_code == 200
    assert Client().get(f"/v1/batches/batch_{batch.id.hex}", **h).status_code == 404  # not an OpenAI batch
    assert Client().get(f"/v1/batches/{batch.id}", **h).status_code == 404  # nor a native one
    assert Client().get("/v1/batches", **h).json()["data"] == []


# --- in process: the lifecycle step by step ------------------------------------------------------


def create(catalog, requests, key=None):
    principal = auth.principal_for_key(key or catalog.key)
    with ingest.read_submission(io.BytesIO(json.dumps({"requests": requests}).encode()), 10**8, 50_000) as sub:
        return anthropic_batches.create(principal, sub)


def run_all():
    while (item := services.claim("test-runner")) is not None:
        services.run_item(item)


def shown(batch) -> dict:
    return anthropic_batches.serialize(anthropic_batches.shown(batch.pk), "http://relay/v1/messages/batches/")


def lines(batch) -> dict:
    b = Batch.objects.get(pk=batch.pk)
    return {line["custom_id"]: line["result"] for line in map(json.loads, anthropic_batches.iter_results(b))}


@runs_items
def test_create_stores_items_that_wait_and_retry_like_the_openai_surface(catalog, fake, settings):
    batch = create(catalog, [req("a"), req("b", "second")])
    b = Batch.objects.get(pk=batch.pk)
    assert (b.surface, b.inbound_shape, b.status, b.total_items) == ("anthropic", "anthropic", "in_progress", 2)
    assert b.retry_transient and b.wait_for_capacity and b.max_attempts == settings.RELAY_BATCH_MAX_ATTEMPTS
    assert b.discount_percent == settings.RELAY_BATCH_DISCOUNT_PERCENT
    assert list(Item.objects.filter(batch=b).order_by("idx").values_list("custom_id", "max_attempts")) == [
        ("a", settings.RELAY_BATCH_MAX_ATTEMPTS),
        ("b", settings.RELAY_BATCH_MAX_ATTEMPTS),
    ]
    # A transient upstream failure is retried, not errored.
    fake.script(
        "upstream-anthropic-0", [Reply(status=529, body={"type": "error", "error": {"type": "overloaded_error"}})]
    )
    with override_settings(RELAY_BATCH_RETRY_BASE_SECONDS=0, RELAY_BATCH_RETRY_MAX_SECONDS=0):
        wait_for(lambda: run_all() or Batch.objects.get(pk=b.pk).status == "completed", 20, what="completion")
    assert shown(b)["request_counts"] == {"processing": 0, "succeeded": 2, "errored": 0, "canceled": 0, "expired": 0}
    assert shown(b)["processing_status"] == "ended" and shown(b)["ended_at"]
    assert sorted(Item.objects.filter(batch=b).values_list("retries", flat=True)) == [0, 1]
    # One usage event per request, discounted like an OpenAI-surface batch.
    for event in UsageEvent.objects.filter(batch_id=str(b.pk)):
        assert event.source == "batch" and event.cost_nano_usd is None  # claude-sonnet is unpriced in the catalog


@runs_items
def test_relay_side_failures_are_errored_with_anthropic_types(catalog, fake):
    batch = create(catalog, [req("a", model="nope"), req("b", model="gpt-4o"), req("c", stream=True)])
    run_all()
    got = lines(batch)
    assert got["a"]["type"] == "errored" and got["a"]["error"]["type"] == "error"
    assert got["a"]["error"]["error"]["type"] == "not_found_error" and got["a"]["error"]["error"]["code"] == (
        "model_not_found"
    )
    assert got["b"]["error"]["error"]["code"] == "cross_shape_dispatch"  # an openai binding: not /v1/messages
    assert got["c"]["error"]["error"]["code"] == "streaming_unsupported"
    assert Batch.objects.get(pk=batch.pk).status == "completed"
    assert UsageEvent.objects.filter(batch_id=str(batch.pk)).count() == 3


@runs_items
def test_expiry_keeps_what_finished_and_expires_the_rest(catalog, fake):
    batch = create(catalog, [req(f"r{i}") for i in range(3)])
    services.run_item(services.claim("test-runner"))
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert services.sweep()["expired"] == 1
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "expired" and b.expired_at and b.completed_at  # nothing was running: it ends at once
    assert shown(b)["processing_status"] == "ended"
    assert shown(b)["request_counts"] == {"processing": 0, "succeeded": 1, "errored": 0, "canceled": 0, "expired": 2}
    assert sorted(r["type"] for r in lines(b).values()) == ["expired", "expired", "succeeded"]
    assert services.sweep()["expired"] == 0


@runs_items
def test_cancel_ends_at_once_when_nothing_runs_and_delete_removes_the_rows(catalog):
    batch = create(catalog, [req("a"), req("b")])
    assert services.cancel(Batch.objects.get(pk=batch.pk)) is True
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "cancelled" and b.cancelling_at and b.completed_at
    assert shown(b)["request_counts"]["canceled"] == 2 and shown(b)["cancel_initiated_at"]
    assert {r["type"] for r in lines(b).values()} == {"canceled"}
    anthropic_batches.delete(b)
    assert not Batch.objects.filter(pk=b.pk).exists() and not Item.objects.filter(batch_id=b.pk).exists()


@in_process
def test_sweeper_ends_an_anthropic_batch_whose_completion_check_was_missed(catalog):
    batch = create(catalog, [req("a")])
    Item.objects.filter(batch_id=batch.pk).update(state="completed", finished_at=timezone.now())  # a crash after
    services.sweep()
    assert Batch.objects.get(pk=batch.pk).status == "completed"
