"""Relay-native batch API end to end: live HTTP server, a real Celery worker
process, real PostgreSQL and Redis, and the fake upstream."""

import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import requests
from django.conf import settings
from django.test import override_settings
from django.utils import timezone

from batches.models import Batch, Item
from core import auth
from core.models import RelayKey
from core.services import create_relay_key, revoke_relay_key, rotate_relay_key
from devkit.upstream import Reply
from policies.models import Policy
from tests import factories
from tests.workers import wait_for
from usage.models import UsageEvent

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "batch hello"}]}


class Api:
    def __init__(self, url, key):
        self.url, self.key = url, key

    def h(self, key=None):
        return {"Authorization": f"Bearer {key or self.key}"}

    def submit(self, requests_, shape="openai", key=None, raw=None):
        if raw is not None:
            return requests.post(self.url + "/v1/batches", data=raw, headers=self.h(key), timeout=60)
        return requests.post(
            self.url + "/v1/batches", json={"shape": shape, "requests": requests_}, headers=self.h(key), timeout=60
        )

    def status(self, batch_id, key=None):
        return requests.get(f"{self.url}/v1/batches/{batch_id}", headers=self.h(key), timeout=30)

    def results(self, batch_id, key=None):
        return requests.get(f"{self.url}/v1/batches/{batch_id}/results", headers=self.h(key), timeout=60)

    def cancel(self, batch_id, key=None):
        return requests.post(f"{self.url}/v1/batches/{batch_id}/cancel", headers=self.h(key), timeout=30)

    def wait_done(self, batch_id, timeout=30.0, key=None):
        def done():
            body = self.status(batch_id, key).json()
            return body if body["CompletedAt"] else None

        return wait_for(done, timeout, what=f"batch {batch_id} to finish")


@pytest.fixture
def api(live_server, catalog, worker):
    assert worker.alive(), worker.output()
    return Api(live_server.url, catalog.key)


@pytest.fixture
def slots_blocked(api, fake):
    """Occupy all 8 worker slots with items the fake upstream holds, until released."""
    gate = threading.Event()
    fake.script("upstream-openai-0", [Reply(gate=gate) for _ in range(8)])
    blocker = api.submit([CHAT] * 8).json()["id"]
    wait_for(lambda: Item.objects.filter(batch_id=blocker, state="running").count() == 8, 20, what="8 busy slots")
    yield gate
    gate.set()
    api.wait_done(blocker)


def item_errors(api, batch_id):
    return [r.get("error", "") for r in api.results(batch_id).json()["results"]]


# --- the three shapes ---------------------------------------------------------------


def test_openai_batch_completes_with_results_and_usage_events(api, catalog, fake):
    resp = api.submit([CHAT, dict(CHAT, messages=[{"role": "user", "content": "second"}])])
    assert resp.status_code == 202, resp.text
    body = resp.json()
    assert body["status"] == "queued" and body["total_items"] == 2
    assert len(body["id"]) == 36 and body["id"][14] == "7"  # a UUIDv7
    status = api.wait_done(body["id"])
    assert status["Status"] == "completed" and status["counts"] == {"completed": 2}
    assert status["items"] == [{"idx": 0, "state": "completed"}, {"idx": 1, "state": "completed"}]
    assert status["InboundShape"] == "openai" and status["TotalItems"] == 2
    assert status["PolicyID"] == str(catalog.policy.id) and status["ProjectID"] == str(catalog.project.id)
    assert status["PrincipalKind"] == "serviceaccount" and status["CredentialKind"] == "key"
    results = api.results(body["id"]).json()["results"]
    assert [r["idx"] for r in results] == [0, 1]
    assert results[1]["response"]["object"] == "chat.completion"
    assert "second" in results[1]["response"]["choices"][0]["message"]["content"]
    events = UsageEvent.objects.filter(batch_id=body["id"]).order_by("request_id")
    assert events.count() == 2 and {e.source for e in events} == {"batch"}
    assert {e.request_id for e in events} == {str(i.id) for i in Item.objects.filter(batch_id=body["id"])}
    assert all(e.project == "proj-a" and e.cost_nano_usd > 0 for e in events)
    assert {r["body"]["model"] for r in fake.received} == {"gpt-4o-2024-08-06"}


def test_results_and_status_page_by_keyset_behind_a_transaction_pooler(api, monkeypatch):
    """Behind PgBouncer in transaction mode no cursor outlives its transaction (server-side cursors are off):
    the results and the status list are read a page per statement, after the last idx seen, and come out
    byte for byte as from the server-side cursor."""
    from django.db import connection

    from batches.surfaces.native import read

    batch_id = api.submit([CHAT] * 5).json()["id"]
    api.wait_done(batch_id)
    batch = Batch.objects.get(pk=batch_id)
    results, status = b"".join(read.iter_results_json(batch)), b"".join(read.iter_status_json(batch))
    monkeypatch.setitem(connection.settings_dict, "DISABLE_SERVER_SIDE_CURSORS", True)
    monkeypatch.setattr(read, "RESULTS_ROWS", 2)  # three pages
    assert b"".join(read.iter_results_json(batch)) == results
    assert b"".join(read.iter_status_json(batch)) == status
    assert [r["idx"] for r in json.loads(results)["results"]] == [0, 1, 2, 3, 4]


def test_anthropic_batch(api, fake):
    msg = {"model": "claude-sonnet", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    batch = api.submit([msg], shape="anthropic").json()["id"]
    api.wait_done(batch)
    (result,) = api.results(batch).json()["results"]
    assert result["state"] == "completed" and result["response"]["type"] == "message"
    assert fake.received[-1]["path"] == "/v1/messages" and fake.received[-1]["headers"]["x-api-key"]


def test_openai_responses_batch(api, fake):
    batch = api.submit([{"model": "gpt-resp", "input": "hello"}], shape="openai_responses").json()["id"]
    api.wait_done(batch)
    (result,) = api.results(batch).json()["results"]
    assert result["state"] == "completed" and result["response"]["object"] == "response"
    assert fake.received[-1]["path"] == "/v1/responses"


# --- submit validation: 400 and nothing stored ------------------------------------------------


def _nothing_stored(before_dirs):
    assert Batch.objects.count() == 0 and Item.objects.count() == 0
    root = Path(settings.RELAY_BATCH_PAYLOAD_DIR)
    after = set(root.iterdir()) if root.exists() else set()
    assert after == before_dirs


@pytest.mark.parametrize(
    "raw,message",
    [
        (b"{not json", "invalid request body"),
        (b"[]", "expected a JSON object"),
        (b'{"requests": [{"model": "gpt-4o"}]}', "shape is required"),
        (b'{"shape": "gemini", "requests": [{"model": "x"}]}', "unknown shape 'gemini'"),
        (b'{"shape": "openai", "requests": []}', "requests must be non-empty"),
        (b'{"shape": "openai"}', "requests is required"),
        (b'{"shape": "openai", "requests": {"a": 1}}', "requests must be an array"),
        (b'{"shape": "openai", "requests": [1, 2]}', "requests[0] must be a JSON object"),
        (b'{"requests": [{"model": "gpt-4o"}], "shape": "openai", "x": [', "invalid request body"),
    ],
)
def test_bad_submissions_are_400_and_store_nothing(api, raw, message):
    root = Path(settings.RELAY_BATCH_PAYLOAD_DIR)
    before = set(root.iterdir()) if root.exists() else set()
    resp = api.submit(None, raw=raw)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert message in resp.json()["error"]["message"]
    _nothing_stored(before)


def test_too_many_items_names_the_limit(api):
    with override_settings(RELAY_BATCH_MAX_ITEMS=3):
        resp = api.submit([CHAT] * 5)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == (
        "batch: too many items: 5 items, at most 3 per batch (RELAY_BATCH_MAX_ITEMS)"
    )
    assert Batch.objects.count() == 0 and Item.objects.count() == 0


def test_body_over_the_limit_is_400_before_reading(api):
    # Its Content-Length already says so: refused at the edge, before a byte is read (decision 0008),
    # with the native contract's 400 (decision 0003).
    with override_settings(RELAY_MAX_REQUEST_BYTES=2000):
        resp = api.submit([CHAT] * 50)
    assert resp.status_code == 400 and "exceeds 2000 bytes" in resp.json()["error"]["message"]
    assert resp.json()["error"]["code"] == "request_too_large"
    assert Batch.objects.count() == 0


def test_submit_without_credential_is_401(api):
    resp = requests.post(api.url + "/v1/batches", json={"shape": "openai", "requests": [CHAT]}, timeout=10)
    assert resp.status_code == 401 and resp.json()["error"]["message"] == "missing relay key"


# --- ownership -------------------------------------------------------------------------------


def test_only_the_submitter_can_read_or_cancel(api, catalog):
    batch = api.submit([CHAT]).json()["id"]
    _, other = create_relay_key(service_account=catalog.sa)
    for call in (api.status, api.results, api.cancel):
        resp = call(batch, key=other)
        assert resp.status_code == 404 and resp.json() == {
            "error": {"type": "invalid_request_error", "message": "batch not found"}
        }
    assert api.status("not-a-uuid").status_code == 404
    api.wait_done(batch)


def test_rotated_key_cannot_read_what_its_previous_value_submitted(api, catalog):
    batch = api.submit([CHAT]).json()["id"]
    api.wait_done(batch)
    new = rotate_relay_key(catalog.key_obj, grace_seconds=3600)
    assert api.status(batch).status_code == 200  # the old value, still in grace
    assert api.status(batch, key=new).status_code == 404


def test_any_token_of_the_same_user_reads_the_batch(api, catalog):
    alice = factories.user()
    catalog.project.default_policy = catalog.policy
    catalog.project.save()
    t1 = auth.mint_token(alice, catalog.project, 3600)["token"]
    t2 = auth.mint_token(alice, catalog.project, 3600)["token"]
    batch = api.submit([CHAT], key=t1).json()["id"]
    assert api.status(batch, key=t2).status_code == 200
    bob = factories.user("bob")
    t3 = auth.mint_token(bob, catalog.project, 3600)["token"]
    assert api.status(batch, key=t3).status_code == 404
    assert api.status(batch, key=api.key).status_code == 404
    api.wait_done(batch, key=t1)


# --- failure reasons ---------------------------------------------------------------------------


def test_upstream_error_keeps_status_and_body(api, fake):
    fake.script("upstream-openai-0", [Reply(status=400, body={"error": {"message": "max_tokens too large"}})])
    batch = api.submit([CHAT]).json()["id"]
    api.wait_done(batch)
    (r,) = api.results(batch).json()["results"]
    assert r["state"] == "discarded" and r["error"] == "batch item: upstream status 400"
    assert r["status_code"] == 400 and r["error_body"] == {"error": {"message": "max_tokens too large"}}
    event = UsageEvent.objects.get(batch_id=batch)
    assert event.status == 400 and event.error_kind == "upstream_error"


def test_every_key_failing_discards_the_item(api, fake):
    for i in range(3):
        fake.script(f"upstream-openai-{i}", [Reply(status=500, body={"error": {"message": f"down {i}"}})])
    batch = api.submit([CHAT]).json()["id"]
    api.wait_done(batch)
    (r,) = api.results(batch).json()["results"]
    assert r["error"] == "batch item: upstream status 500" and r["error_body"]["error"]["message"] == "down 2"
    assert UsageEvent.objects.get(batch_id=batch).attempts == 3


def test_routing_shape_and_stream_failures(api):
    batch = api.submit(
        [
            dict(CHAT, model="nope"),
            {"model": "claude-sonnet", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
            dict(CHAT, stream=True),
            CHAT,
        ]
    ).json()["id"]
    api.wait_done(batch)
    errors = item_errors(api, batch)
    assert errors[0] == "batch item: model nope does not exist"
    assert errors[1].startswith("batch item: cross-shape dispatch: openai item routed to an anthropic binding")
    assert errors[2].startswith("batch: stream is not supported in batch items")
    assert errors[3] == ""
    assert UsageEvent.objects.filter(batch_id=batch).count() == 4


def test_responses_item_on_openai_binding_of_openai_host_goes_to_chat_completions(api, fake):
    fake.script("*", [Reply(status=400, body={"error": {"message": "messages is required"}})])
    batch = api.submit([{"model": "gpt-4o", "input": "hello"}], shape="openai_responses").json()["id"]
    api.wait_done(batch)
    (r,) = api.results(batch).json()["results"]
    assert fake.received[-1]["path"] == "/v1/chat/completions"
    assert r["error"] == "batch item: upstream status 400"


def test_rate_limit_spent_fails_the_item_without_waiting(api, catalog):
    rl = factories.rate_limit("one-per-minute", ("requests", 1, 60, "fixed-window"))
    Policy.objects.filter(pk=catalog.policy.pk).update(rate_limit=rl)
    batch = api.submit([CHAT, CHAT, CHAT]).json()["id"]
    api.wait_done(batch, timeout=15)
    errors = item_errors(api, batch)
    assert errors.count("") == 1
    assert sum("budget exceeded: requests" in e for e in errors) == 2


@pytest.mark.parametrize("change", ["revoke", "disable", "expire", "rotate"])
def test_key_that_stopped_working_fails_the_items(api, catalog, slots_blocked, change):
    key, plaintext = create_relay_key(service_account=catalog.sa)
    batch = api.submit([CHAT, CHAT], key=plaintext).json()["id"]
    if change == "revoke":
        revoke_relay_key(key)
    elif change == "disable":
        RelayKey.objects.filter(pk=key.pk).update(enabled=False)
    elif change == "expire":
        RelayKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    else:
        rotate_relay_key(key, grace_seconds=0)
    slots_blocked.set()
    wait_for(lambda: Batch.objects.get(pk=batch).completed_at, 20, what="batch")
    expected = {
        "revoke": "api key revoked",
        "disable": "api key disabled",
        "expire": "api key expired",
        "rotate": "api key rotated",
    }[change]
    errors = list(Item.objects.filter(batch_id=batch).values_list("error", flat=True))
    assert errors == [f"batch: credential no longer valid: {expected}"] * 2
    assert UsageEvent.objects.filter(batch_id=batch, error_kind="credential_invalid").count() == 2


@pytest.mark.parametrize("change", ["revoke_one", "revoke_all", "expire"])
def test_token_that_stopped_working_fails_the_items(api, catalog, slots_blocked, change):
    alice = factories.user()
    catalog.project.default_policy = catalog.policy
    catalog.project.save()
    minted = auth.mint_token(alice, catalog.project, 2 if change == "expire" else 3600)
    batch = api.submit([CHAT], key=minted["token"]).json()["id"]
    if change == "revoke_one":
        auth.revoke_token(minted["token"])
    elif change == "revoke_all":
        alice.bump_token_version()
    else:  # the token's lifetime runs out (JWT `exp`: whole seconds)
        wait_for(lambda: time.time() > minted["expires_at"], 5, interval=0.05, what="the token to expire")
    slots_blocked.set()
    wait_for(lambda: Batch.objects.get(pk=batch).completed_at, 20, what="batch")
    expected = "token expired" if change == "expire" else "token revoked"
    assert Item.objects.get(batch_id=batch).error == f"batch: credential no longer valid: {expected}"


@pytest.mark.parametrize("change", ["disable", "delete"])
def test_policy_gone_fails_the_items(api, catalog, slots_blocked, change):
    batch = api.submit([CHAT]).json()["id"]
    if change == "disable":
        Policy.objects.filter(pk=catalog.policy.pk).update(enabled=False)
    else:
        Policy.objects.filter(pk=catalog.policy.pk).delete()
    slots_blocked.set()
    wait_for(lambda: Batch.objects.get(pk=batch).completed_at, 20, what="batch")
    assert Item.objects.get(batch_id=batch).error == "batch: policy_unavailable"


def test_missing_payload_fails_with_load_input(api, slots_blocked):
    import shutil

    batch = api.submit([CHAT]).json()["id"]
    shutil.rmtree(Path(settings.RELAY_BATCH_PAYLOAD_DIR) / batch)
    slots_blocked.set()
    wait_for(lambda: Batch.objects.get(pk=batch).completed_at, 20, what="batch")
    assert Item.objects.get(batch_id=batch).error.startswith("batch: load input: payload")


def test_item_deadline_is_enforced_against_a_dripping_upstream(api, fake):
    fake.script("*", [Reply(drip_seconds=30)])
    started = time.monotonic()
    batch = api.submit([CHAT]).json()["id"]
    api.wait_done(batch, timeout=25)
    assert time.monotonic() - started < 20
    (r,) = api.results(batch).json()["results"]
    assert r["state"] == "discarded" and r["error"] == "batch: item ran longer than 6 seconds"


# --- cancel ----------------------------------------------------------------------------------


def test_cancel_stops_running_items_and_cancels_pending_ones(api, fake):
    gate = threading.Event()
    fake.script("upstream-openai-0", [Reply(gate=gate) for _ in range(8)])
    batch = api.submit([CHAT] * 12).json()["id"]
    wait_for(lambda: Item.objects.filter(batch_id=batch, state="running").count() == 8, 20, what="8 running")
    resp = api.cancel(batch)
    assert resp.status_code == 200 and resp.json() == {"status": "cancelled"}
    status = api.wait_done(batch, timeout=15)  # running ones stop at their next heartbeat
    gate.set()
    assert status["Status"] == "cancelled" and status["counts"] == {"cancelled": 12}
    assert UsageEvent.objects.filter(batch_id=batch).count() == 8  # the ones that had started


# --- scheduling ---------------------------------------------------------------------------------


def test_no_more_than_8_in_flight_per_worker(api, fake):
    fake.script("*", [Reply(delay=0.3) for _ in range(30)])
    batch = api.submit([CHAT] * 30).json()["id"]
    api.wait_done(batch, timeout=30)
    assert 4 <= fake.max_in_flight <= 8


def test_small_batch_after_a_large_one_starts_before_the_large_one_finishes(api, fake):
    # The large batch fills all 8 slots with answers held at a gate, so the small
    # one is submitted while the large one certainly has work left.
    gate = threading.Event()
    fake.script("*", [Reply(gate=gate) for _ in range(8)] + [Reply(delay=0.5) for _ in range(40)])
    large = api.submit([CHAT] * 40).json()["id"]
    wait_for(lambda: Item.objects.filter(batch_id=large, state="running").count() == 8, 20, what="8 busy slots")
    small = api.submit([CHAT, CHAT]).json()["id"]
    gate.set()
    # Freed slots go to the batch with the fewest running items: the small one.
    api.wait_done(small, timeout=20)
    assert Item.objects.filter(batch_id=large, state__in=["available", "running"]).count() >= 8
    api.wait_done(large, timeout=40)
