"""Anthropic's Message Batches API end to end: the official `anthropic` SDK, unchanged, against the live server
and a real Celery worker (items, the sweeper); real PostgreSQL and Redis; the fake upstream. Each step in process:
tests/test_anthropic_lifecycle.py."""

import threading
from datetime import timedelta

import anthropic
import pytest

from batches.models import Batch, Item
from batches.surfaces.anthropic import read as anthropic_read
from core.services import create_relay_key
from devkit.upstream import Reply
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
        held_pk = anthropic_read.parse_id(held.id)
        wait_for(lambda: Item.objects.filter(batch_id=held_pk, state="running").count() == 3, 20, what="3 running")
        with pytest.raises(anthropic.BadRequestError) as exc:
            client.messages.batches.delete(held.id)  # only an ended batch can be deleted
        assert exc.value.body["error"]["type"] == "invalid_request_error" and "cancel it first" in str(exc.value)
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
