"""The Anthropic surface step by step, in process (no worker): create checks, errors in Anthropic's envelope,
ownership, items that wait and retry, expiry, cancel, delete, and what operators see. Items run through the real
pipeline against the fake upstream (lifecycle.claim, worker.execute.run_item, sweeper.sweep, as the
Celery tasks call them)."""

import io
import json
from datetime import timedelta

import pytest
from django.test import Client, override_settings
from django.utils import timezone

from batches import ingest, sweeper
from batches.lifecycle import claim as claims
from batches.lifecycle import states, stop
from batches.models import Batch, Item
from batches.surfaces.anthropic import create as anthropic_create
from batches.surfaces.anthropic import read as anthropic_read
from batches.worker import execute
from core import auth
from devkit.upstream import Reply
from policies.models import Policy
from tests.workers import wait_for
from usage.models import UsageEvent

# Tests that run items need committed rows: the heartbeat thread reads them on its own connection.
runs_items = pytest.mark.django_db(transaction=True)
in_process = pytest.mark.django_db


def req(custom_id, content="hello", model="claude-sonnet", **params):
    return {
        "custom_id": custom_id,
        "params": {"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": content}], **params},
    }


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
        return anthropic_create.create(principal, sub)


def run_all():
    while (item := claims.claim("test-runner")) is not None:
        execute.run_item(item)


def shown(batch) -> dict:
    return anthropic_read.serialize(anthropic_read.shown(batch.pk), "http://relay/v1/messages/batches/")


def lines(batch) -> dict:
    b = Batch.objects.get(pk=batch.pk)
    return {line["custom_id"]: line["result"] for line in map(json.loads, anthropic_read.iter_results(b))}


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
    execute.run_item(claims.claim("test-runner"))
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert sweeper.sweep()["expired"] == 1
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "expired" and b.expired_at and b.completed_at  # nothing was running: it ends at once
    assert shown(b)["processing_status"] == "ended"
    assert shown(b)["request_counts"] == {"processing": 0, "succeeded": 1, "errored": 0, "canceled": 0, "expired": 2}
    assert sorted(r["type"] for r in lines(b).values()) == ["expired", "expired", "succeeded"]
    assert sweeper.sweep()["expired"] == 0


@runs_items
def test_cancel_ends_at_once_when_nothing_runs_and_delete_removes_the_rows(catalog):
    batch = create(catalog, [req("a"), req("b")])
    assert stop.cancel(Batch.objects.get(pk=batch.pk)) is True
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "cancelled" and b.cancelling_at and b.completed_at
    assert shown(b)["request_counts"]["canceled"] == 2 and shown(b)["cancel_initiated_at"]
    assert {r["type"] for r in lines(b).values()} == {"canceled"}
    anthropic_read.delete(b)
    assert not Batch.objects.filter(pk=b.pk).exists() and not Item.objects.filter(batch_id=b.pk).exists()


@in_process
def test_sweeper_ends_an_anthropic_batch_whose_completion_check_was_missed(catalog):
    batch = create(catalog, [req("a")])
    Item.objects.filter(batch_id=batch.pk).update(state="completed", finished_at=timezone.now())  # a crash after
    sweeper.sweep()
    assert Batch.objects.get(pk=batch.pk).status == "completed"


# --- operators: which surface a batch came from -------------------------------------------------


@runs_items
def test_admin_and_usage_api_show_the_surface(catalog, fake, django_user_model, settings):
    from django.urls import reverse

    client = Client()
    batch = create(catalog, [req("a")])
    run_all()
    admin = {"HTTP_AUTHORIZATION": f"Bearer {settings.RELAY_ADMIN_TOKEN}"}
    events = client.get("/api/usage/events", {"batch_surface": "anthropic"}, **admin).json()["events"]
    assert [(e["batch_id"], e["batch_surface"]) for e in events] == [(str(batch.pk), "anthropic")]
    assert client.get("/api/usage/events", {"batch_surface": "openai"}, **admin).json()["events"] == []
    assert client.get("/api/usage/events", {"batch_surface": "x"}, **admin).status_code == 400
    summary = client.get("/api/usage/summary", {"batch_surface": "anthropic"}, **admin).json()["rows"]
    assert [row["requests"] for row in summary] == [1]

    client.force_login(django_user_model.objects.create_user("root", is_staff=True, is_superuser=True))
    listing = client.get(reverse("admin:batches_batch_changelist"), {"q": batch.public_id}).content.decode()
    assert batch.public_id in listing and "anthropic" in listing
    page = client.get(reverse("admin:batches_batch_change", args=[batch.pk])).content.decode()
    assert "Anthropic-compatible batch" in page
    assert client.get(reverse("admin:batches_batch_changelist"), {"surface__exact": "anthropic"}).status_code == 200


@in_process
def test_the_transition_table_and_constraints_speak_the_anthropic_vocabulary(catalog):
    from django.db import IntegrityError, transaction

    from batches.models import ANTHROPIC_STATUSES

    table = states.TRANSITIONS["anthropic"]
    assert set(table) == set(ANTHROPIC_STATUSES) and all(t <= set(ANTHROPIC_STATUSES) for t in table.values())
    with pytest.raises(states.IllegalTransition):
        states.sources("anthropic", "finalizing")
    batch = create(catalog, [req("a")])
    for status, fields in (("validating", {}), ("completed", {}), ("expired", {"completed_at": timezone.now()})):
        with pytest.raises(IntegrityError), transaction.atomic():  # a tested escape of lifecycle, to hit the CHECKs
            Batch.objects.filter(pk=batch.pk).update(status=status, **fields)
