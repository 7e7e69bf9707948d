"""Re-run what failed (`POST /v1/batches/{id}/retry_failed`, `POST /v1/messages/batches/{id}/retry_failed`):
each surface end to end against the live server and a real worker fleet (records the fake provider refuses
once fail, their retry completes), then the refusals in each surface's envelope, what counts as failed
(expired yes, cancelled no), atomicity, ownership, and the admin's action and links."""

import dataclasses
import io
import json
import os
from datetime import timedelta

import anthropic
import openai
import pytest
import requests
from django.conf import settings
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from batches import ingest, storage
from batches.lifecycle import stop
from batches.models import Batch, File, Item, Payload
from batches.surfaces import retry
from batches.surfaces.anthropic import create as anthropic_create
from batches.surfaces.native import submit
from batches.surfaces.openai import create as openai_create
from batches.surfaces.openai import finalize, validation
from core import auth
from core.services import create_relay_key, revoke_relay_key
from devkit.upstream import Reply
from policies.models import Policy
from tests.workers import wait_for

e2e = pytest.mark.django_db(transaction=True)
in_process = pytest.mark.django_db

CHAT = "/v1/chat/completions"
OPENAI_REFUSAL = Reply(status=400, body={"error": {"message": "refused once", "type": "invalid_request_error"}})
ANTHROPIC_REFUSAL = Reply(
    status=400, body={"type": "error", "error": {"type": "invalid_request_error", "message": "no"}}
)


def chat_body(content):
    return {"model": "gpt-4o", "messages": [{"role": "user", "content": content}]}


def record(custom_id, content="hello"):
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": chat_body(content)}


def message(custom_id, content="hello"):
    return {
        "custom_id": custom_id,
        "params": {"model": "claude-sonnet", "max_tokens": 64, "messages": [{"role": "user", "content": content}]},
    }


def bodies(batch) -> dict:
    """custom_id (or idx for a native batch) → the stored request body."""
    items = Item.objects.filter(batch_id=batch.pk).order_by("idx")
    return {(i.custom_id or i.idx): json.loads(storage.read(i.input_ref)) for i in items}


# --- end to end: live server, worker fleet, fake provider --------------------------------------------


@pytest.fixture
def live(live_server, catalog, worker):
    assert worker.alive(), worker.output()
    return live_server.url


@e2e
def test_native_retry_reruns_the_discarded_items_and_completes(live, catalog, fake):
    fake.answer_when("FAILME", OPENAI_REFUSAL, times=2)
    h = {"Authorization": f"Bearer {catalog.key}"}
    contents = ["fine 0", "FAILME 1", "fine 2", "FAILME 3"]
    body = {"shape": "openai", "requests": [chat_body(c) for c in contents], "retry": {"max_attempts": 1}}
    parent_id = requests.post(f"{live}/v1/batches", json=body, headers=h, timeout=30).json()["id"]

    def done(batch_id):
        return wait_for(
            lambda: (
                (s := requests.get(f"{live}/v1/batches/{batch_id}", headers=h, timeout=30).json())["CompletedAt"] and s
            ),
            60,
            what=f"native batch {batch_id}",
        )

    assert done(parent_id)["counts"] == {"completed": 2, "discarded": 2}
    resp = requests.post(f"{live}/v1/batches/{parent_id}/retry_failed", headers=h, timeout=30)
    assert resp.status_code == 202, resp.text
    answer = resp.json()
    assert answer["retry_of"] == parent_id and answer["parent_idx"] == [1, 3] and answer["total_items"] == 2
    child = done(answer["id"])
    assert child["counts"] == {"completed": 2} and child["retry_of"] == parent_id
    assert child["retry"] == {"max_attempts": 1, "wait_for_capacity": True}  # the parent's options
    parent = requests.get(f"{live}/v1/batches/{parent_id}", headers=h, timeout=30).json()
    assert parent["retried_by"] == [answer["id"]] and parent["retry_of"] is None
    results = requests.get(f"{live}/v1/batches/{answer['id']}/results", headers=h, timeout=30).json()["results"]
    assert [r["state"] for r in results] == ["completed", "completed"]
    old, new = bodies(Batch.objects.get(pk=parent_id)), bodies(Batch.objects.get(pk=answer["id"]))
    assert [new[0], new[1]] == [old[1], old[3]]  # the same bodies, in the parent's order


@e2e
def test_openai_retry_reruns_the_error_files_records_and_completes(live, catalog, fake):
    fake.answer_when("FAILME", OPENAI_REFUSAL, times=2)
    body = {
        "endpoint": CHAT,
        "completion_window": "24h",
        "metadata": {"job": "nightly"},
        "requests": [record("a"), record("b", "FAILME b"), record("c"), record("d", "FAILME d")],
        "output_expires_after": {"anchor": "created_at", "seconds": 7200},
    }
    h = {"Authorization": f"Bearer {catalog.key}"}
    created_id = requests.post(f"{live}/v1/batches", json=body, headers=h, timeout=30).json()["id"]
    with openai.OpenAI(base_url=live + "/v1", api_key=catalog.key) as sdk:

        def ended(batch_id):
            return wait_for(
                lambda: (b := sdk.batches.retrieve(batch_id)).status in {"completed", "failed", "expired"} and b,
                60,
                what=f"batch {batch_id}",
            )

        def lines(file_id):
            return {x["custom_id"]: x for x in map(json.loads, sdk.files.content(file_id).text.splitlines())}

        parent = ended(created_id)
        assert parent.status == "completed" and sorted(lines(parent.error_file_id)) == ["b", "d"]
        child = sdk.post(f"/batches/{parent.id}/retry_failed", cast_to=openai.types.Batch)
        assert child.id != parent.id and child.status == "validating"
        assert child.retry_of == parent.id
        assert (child.endpoint, child.metadata, child.model) == (CHAT, {"job": "nightly"}, "gpt-4o")
        done = ended(child.id)
        assert done.status == "completed" and done.error_file_id is None
        assert (done.request_counts.total, done.request_counts.completed) == (2, 2)
        assert sorted(lines(done.output_file_id)) == ["b", "d"]
        assert sdk.batches.retrieve(parent.id).retried_by == [child.id]
    p, c = Batch.objects.get(pk=parent.id[6:]), Batch.objects.get(pk=child.id[6:])
    assert bodies(c) == {k: v for k, v in bodies(p).items() if k in ("b", "d")}
    assert (c.policy_id, c.owner_hash, c.output_expiry.seconds) == (p.policy_id, p.owner_hash, 7200)


@e2e
def test_anthropic_retry_reruns_the_errored_requests_and_ends(live, catalog, fake):
    fake.answer_when("FAILME", ANTHROPIC_REFUSAL, times=1)
    with anthropic.Anthropic(base_url=live, api_key=catalog.key, max_retries=0) as sdk:
        created = sdk.messages.batches.create(requests=[message("one"), message("two", "FAILME"), message("three")])

        def ended(batch_id):
            return wait_for(
                lambda: (b := sdk.messages.batches.retrieve(batch_id)).processing_status == "ended" and b,
                60,
                what=f"message batch {batch_id}",
            )

        parent = ended(created.id)
        assert parent.request_counts.errored == 1 and parent.request_counts.succeeded == 2
        child = sdk.post(
            f"/v1/messages/batches/{parent.id}/retry_failed", cast_to=anthropic.types.messages.MessageBatch
        )
        assert child.retry_of == parent.id and child.processing_status == "in_progress"
        assert child.request_counts.processing == 1
        done = ended(child.id)
        assert done.request_counts.succeeded == 1 and done.request_counts.errored == 0
        assert [r.custom_id for r in sdk.messages.batches.results(child.id)] == ["two"]
        assert sdk.messages.batches.retrieve(parent.id).retried_by == [child.id]


# --- in process: finished parents made step by step ----------------------------------------------------


def _end(batch, failed=(), expired=()):
    """Every item final: `failed` indexes discarded as a provider refusal, `expired` ones stopped by the window
    (they stay available and the caller expires the batch), the rest completed; then the batch's own end."""
    now = timezone.now()
    for item in Item.objects.filter(batch_id=batch.pk):
        if item.idx in expired:
            continue
        if item.idx in failed:
            fields = {"state": "discarded", "error_code": "upstream_error", "status_code": 400, "error": "refused"}
        else:
            ref = storage.write_result(str(batch.pk), str(item.pk), b'{"id": "x", "choices": []}')
            fields = {"state": "completed", "result_ref": ref, "status_code": 200}
        Item.objects.filter(pk=item.pk).update(finished_at=now, **fields)
    if not expired:
        stop.complete_if_done(batch.pk)


def _submission(body: dict):
    return ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**8, 50_000)


def native_parent(catalog, n=3, failed=(1,), **extra):
    body = {"shape": "openai", "requests": [chat_body(f"q{i}") for i in range(n)], **extra}
    with _submission(body) as sub:
        batch = submit.store_native(auth.principal_for_key(catalog.key), sub)
    _end(batch, failed)
    return Batch.objects.get(pk=batch.pk)


def openai_parent(catalog, n=3, failed=(1,), expired=(), **extra):
    body = {"endpoint": CHAT, "completion_window": "24h", "requests": [record(f"r{i}") for i in range(n)], **extra}
    with _submission(body) as sub:
        batch = openai_create.create(auth.principal_for_key(catalog.key), sub)
    validation.validate(batch.pk)
    _end(batch, failed, expired)
    if expired:
        assert stop.expire_openai(batch.pk, timezone.now())
    finalize.finalize(batch.pk)
    return Batch.objects.get(pk=batch.pk)


def anthropic_parent(catalog, n=3, failed=(1,), expired=()):
    with _submission({"requests": [message(f"m{i}") for i in range(n)]}) as sub:
        batch = anthropic_create.create(auth.principal_for_key(catalog.key), sub)
    _end(batch, failed, expired)
    if expired:
        assert stop.expire_anthropic(batch.pk, timezone.now())
    return Batch.objects.get(pk=batch.pk)


PARENTS = {"native": native_parent, "openai": openai_parent, "anthropic": anthropic_parent}


def retry_url(batch) -> str:
    base = "/v1/messages/batches" if batch.surface == "anthropic" else "/v1/batches"
    return f"{base}/{batch.public_id}/retry_failed"


def post_retry(batch, key) -> "Client.response":
    return Client().post(retry_url(batch), HTTP_AUTHORIZATION=f"Bearer {key}")


def error_of(resp) -> dict:
    """The error of any surface's envelope, as {"code", "message"} (Anthropic's type stands in for a code)."""
    body = resp.json()
    if body.get("type") == "error":
        assert set(body) == {"type", "error"}, body
    return body["error"]


def snapshot():
    root = settings.RELAY_BATCH_PAYLOAD_DIR
    return Batch.objects.count(), File.objects.count(), Payload.objects.count(), sorted(os.listdir(root))


@in_process
@pytest.mark.parametrize("surface", ["native", "openai", "anthropic"])
def test_an_unfinished_parent_is_refused_in_its_surfaces_shape_and_nothing_is_made(catalog, surface):
    principal = auth.principal_for_key(catalog.key)
    if surface == "native":
        with _submission({"shape": "openai", "requests": [chat_body("x")]}) as sub:
            parent = submit.store_native(principal, sub)
    elif surface == "openai":
        with _submission({"endpoint": CHAT, "completion_window": "24h", "requests": [record("a")]}) as sub:
            parent = openai_create.create(principal, sub)
    else:
        with _submission({"requests": [message("a")]}) as sub:
            parent = anthropic_create.create(principal, sub)
    before = snapshot()
    resp = post_retry(parent, catalog.key)
    assert resp.status_code == (409 if surface == "native" else 400), resp.content
    error = error_of(resp)
    assert "only a finished batch" in error["message"] and parent.public_id in error["message"]
    if surface == "openai":
        assert error["code"] == "batch_not_finished" and "status 'validating'" in error["message"]
    if surface == "anthropic":
        assert error["type"] == "invalid_request_error" and "still in_progress" in error["message"]
    assert snapshot() == before


@in_process
@pytest.mark.parametrize("surface", ["native", "openai", "anthropic"])
def test_a_parent_with_nothing_failed_is_400_and_nothing_is_made(catalog, surface):
    parent = PARENTS[surface](catalog, failed=())
    before = snapshot()
    resp = post_retry(parent, catalog.key)
    assert resp.status_code == 400, resp.content
    assert "no failed or expired records: nothing to retry" in error_of(resp)["message"]
    assert snapshot() == before


@in_process
def test_an_openai_batch_that_failed_validation_says_so(catalog):
    body = {"endpoint": CHAT, "completion_window": "24h", "requests": [record("a"), record("a")]}
    with _submission(body) as sub:
        parent = openai_create.create(auth.principal_for_key(catalog.key), sub)
    validation.validate(parent.pk)
    resp = post_retry(Batch.objects.get(pk=parent.pk), catalog.key)
    assert resp.status_code == 400
    assert error_of(resp)["code"] == "nothing_to_retry" and "failed validation" in error_of(resp)["message"]


@in_process
def test_expired_records_are_retried_and_cancelled_ones_are_not(catalog):
    # Anthropic: one errored, two expired by the window, one succeeded → the three come back.
    parent = anthropic_parent(catalog, n=4, failed=(0,), expired=(2, 3))
    assert parent.status == "expired"
    retried = retry.retry_failed(parent, auth.principal_for_key(catalog.key))
    assert retried.parent_idx == [0, 2, 3]
    assert sorted(bodies(retried.batch)) == ["m0", "m2", "m3"]
    # OpenAI: an expired batch's stopped records are in its error file as batch_expired; they come back too.
    parent = openai_parent(catalog, n=3, failed=(), expired=(1, 2))
    assert parent.status == "expired"
    resp = post_retry(parent, catalog.key)
    assert resp.status_code == 200 and resp.json()["retry_of"] == parent.public_id
    validation.validate(resp.json()["id"][6:])
    assert sorted(bodies(Batch.objects.get(pk=resp.json()["id"][6:]))) == ["r1", "r2"]
    # A cancelled batch: its cancelled records were the caller's choice, so nothing is retried.
    with _submission({"requests": [message("c0"), message("c1")]}) as sub:
        cancelled = anthropic_create.create(auth.principal_for_key(catalog.key), sub)
    stop.cancel(cancelled)
    resp = post_retry(Batch.objects.get(pk=cancelled.pk), catalog.key)
    assert resp.status_code == 400 and "nothing to retry" in error_of(resp)["message"]


@in_process
@pytest.mark.parametrize("surface", ["native", "openai", "anthropic"])
def test_a_parent_whose_payloads_are_gone_answers_410_and_nothing_is_made(catalog, surface):
    parent = PARENTS[surface](catalog)
    storage.delete_batch(str(parent.pk))  # what retention (or a lost volume) leaves: rows without bodies
    before = snapshot()
    resp = post_retry(parent, catalog.key)
    assert resp.status_code == 410, resp.content
    assert "no longer available" in error_of(resp)["message"]
    assert snapshot() == before


@in_process
def test_one_missing_body_among_many_refuses_the_whole_retry(catalog, settings):
    settings.RELAY_BATCH_PAYLOAD_STORE = "db"
    parent = native_parent(catalog, n=5, failed=(1, 3, 4))
    Payload.objects.filter(key=f"{parent.pk}/in/3").delete()
    before = snapshot()
    resp = post_retry(parent, catalog.key)
    assert resp.status_code == 410 and error_of(resp)["code"] == "payloads_unavailable"
    assert snapshot() == before


@in_process
@pytest.mark.parametrize("surface", ["native", "openai", "anthropic"])
def test_the_create_services_own_refusal_comes_back_and_nothing_is_made(catalog, surface):
    parent = PARENTS[surface](catalog, n=3, failed=(0, 2))
    before = snapshot()
    with override_settings(RELAY_BATCH_MAX_ITEMS=1):  # the new batch goes through its surface's own checks
        resp = post_retry(parent, catalog.key)
    assert resp.status_code in (400, 413), resp.content
    assert "at most 1" in error_of(resp)["message"]
    assert snapshot() == before


@in_process
@pytest.mark.parametrize("surface", ["native", "openai", "anthropic"])
def test_only_the_owner_may_retry(catalog, surface):
    parent = PARENTS[surface](catalog)
    _, other = create_relay_key(service_account=catalog.sa)
    before = snapshot()
    resp = post_retry(parent, other)
    assert resp.status_code == 404
    body = resp.json()
    assert body["type"] == "error" if surface == "anthropic" else "message" in body["error"]
    assert Client().post(retry_url(parent)).status_code == 401
    if surface != "native":  # the OpenAI and Anthropic surfaces need batch access, as for GET
        Policy.objects.filter(pk=catalog.policy.pk).update(batch_enabled=False)
        assert post_retry(parent, catalog.key).status_code == 404
    assert snapshot() == before


@in_process
def test_ids_belong_to_their_surface(catalog):
    native, anth = native_parent(catalog), anthropic_parent(catalog)
    h = {"HTTP_AUTHORIZATION": f"Bearer {catalog.key}"}
    assert Client().post(f"/v1/batches/msgbatch_{anth.pk.hex}/retry_failed", **h).status_code == 404
    assert Client().post(f"/v1/batches/batch_{native.pk.hex}/retry_failed", **h).status_code == 404
    assert Client().post(f"/v1/messages/batches/msgbatch_{native.pk.hex}/retry_failed", **h).status_code == 404
    prefixed = Client().post(f"/anthropic/v1/messages/batches/{anth.public_id}/retry_failed", **h)
    assert prefixed.status_code == 200 and prefixed.json()["retry_of"] == anth.public_id


@in_process
def test_a_principal_of_another_project_is_refused(catalog):
    parent = native_parent(catalog)
    stranger = dataclasses.replace(auth.principal_for_key(catalog.key), project_id=catalog.project.pk + 1000)
    with pytest.raises(Exception) as refused:
        retry.retry_failed(parent, stranger)
    assert refused.value.status == 400 and refused.value.code == "principal_mismatch"
    assert not Batch.objects.filter(retry_of=parent).exists()


@in_process
def test_the_parents_options_and_lineage_are_kept_through_retries_of_retries(catalog):
    parent = native_parent(catalog, n=3, failed=(0, 2), retry={"max_attempts": 4, "wait_for_capacity": False})
    first = post_retry(parent, catalog.key).json()
    second = post_retry(parent, catalog.key).json()  # a parent may be retried again: each is its own batch
    child = Batch.objects.get(pk=first["id"])
    assert (child.inbound_shape, child.max_attempts, child.retry_transient, child.wait_for_capacity) == (
        "openai",
        4,
        True,
        False,
    )
    assert (child.principal, child.policy_id, child.retry_of_id) == (parent.principal, parent.policy_id, parent.pk)
    h = {"HTTP_AUTHORIZATION": f"Bearer {catalog.key}"}
    shown = json.loads(b"".join(Client().get(f"/v1/batches/{parent.pk}", **h).streaming_content))
    assert shown["retried_by"] == [first["id"], second["id"]]
    # The child's own failures can be retried in turn; its retry points at it, not at the first parent.
    _end(child, failed=(1,))
    grandchild = post_retry(Batch.objects.get(pk=child.pk), catalog.key).json()
    assert grandchild["retry_of"] == first["id"] and grandchild["total_items"] == 1
    # An OpenAI list shows the lineage of every batch without a query per batch.
    openai_child = post_retry(openai_parent(catalog), catalog.key).json()
    listed = {b["id"]: b for b in Client().get("/v1/batches", **h).json()["data"]}
    assert listed[openai_child["id"]]["retry_of"] == openai_child["retry_of"]
    assert listed[openai_child["retry_of"]]["retried_by"] == [openai_child["id"]]
    # Deleting a parent keeps its retries, which no longer point anywhere.
    Batch.objects.filter(pk=parent.pk).delete()
    assert Batch.objects.get(pk=child.pk).retry_of_id is None


# --- the admin ---------------------------------------------------------------------------------------


@pytest.fixture
def staff(client, django_user_model):
    client.force_login(django_user_model.objects.create_superuser("root", "root@example.com", "pw"))
    return client


def run_action(staff, *batches):
    return staff.post(
        reverse("admin:batches_batch_changelist"),
        {"action": "retry_failed_records", "_selected_action": [b.pk for b in batches]},
        follow=True,
    )


@in_process
def test_admin_action_retries_through_the_same_service_and_links_both_ways(staff, catalog):
    parent = anthropic_parent(catalog, n=3, failed=(0, 1))
    page = run_action(staff, parent).content.decode()
    child = Batch.objects.get(retry_of=parent)
    assert f"Batch {parent.public_id}: retried as" in page and child.public_id in page and "(2 records)" in page
    assert (child.surface, child.total_items, child.principal) == ("anthropic", 2, parent.principal)
    parent_page = staff.get(reverse("admin:batches_batch_change", args=[parent.pk])).content.decode()
    child_page = staff.get(reverse("admin:batches_batch_change", args=[child.pk])).content.decode()
    assert reverse("admin:batches_batch_change", args=[child.pk]) in parent_page and "Retried by:" in parent_page
    assert reverse("admin:batches_batch_change", args=[parent.pk]) in child_page and "Retry of:" in child_page


@in_process
def test_admin_action_reports_what_it_could_not_retry(staff, catalog):
    with _submission({"requests": [message("a")]}) as sub:
        running = anthropic_create.create(auth.principal_for_key(catalog.key), sub)
    clean = native_parent(catalog, failed=())
    page = run_action(staff, running, clean).content.decode()
    assert f"Batch {running.public_id}: not retried" in page and "only a finished batch" in page
    assert f"Batch {clean.public_id}: not retried" in page and "nothing to retry" in page
    # A batch whose credential stopped working is not run under it: its owner retries with a valid one.
    failed = native_parent(catalog, failed=(0,))
    revoke_relay_key(catalog.key_obj)
    page = run_action(staff, failed).content.decode()
    assert "its credential no longer works" in page
    assert not Batch.objects.filter(retry_of__isnull=False).exists()


@in_process
def test_expired_anthropic_window_is_not_a_precondition(catalog):
    """A parent whose own window closed long ago still retries: the child gets a window of its own."""
    parent = anthropic_parent(catalog, failed=(2,))
    Batch.objects.filter(pk=parent.pk).update(expires_at=timezone.now() - timedelta(days=2))
    child = retry.retry_failed(Batch.objects.get(pk=parent.pk), auth.principal_for_key(catalog.key)).batch
    assert child.expires_at > timezone.now() + timedelta(hours=23)


@in_process
def test_answers_match_the_openapi_schema(catalog):
    from tests.test_openapi import check

    schema = json.loads(Client().get("/api/schema/", {"format": "json"}).content)
    h = {"HTTP_AUTHORIZATION": f"Bearer {catalog.key}"}
    native, oai, anth = native_parent(catalog), openai_parent(catalog), anthropic_parent(catalog)
    path = "/v1/batches/{batch_id}/retry_failed"
    for parent in (native, oai):
        child = check(schema, path, "post", Client().post(retry_url(parent), **h))
        assert child["retry_of"] == parent.public_id
        check(schema, path, "post", Client().post(retry_url(Batch.objects.get(pk=parent.pk)), **h))  # again: fine
    check(schema, "/v1/batches/{batch_id}", "get", Client().get(f"/v1/batches/{oai.public_id}", **h))
    check(schema, "/v1/batches/{batch_id}", "get", Client().get(f"/v1/batches/{native.pk}", **h))
    child = check(schema, "/v1/messages/batches/{batch_id}/retry_failed", "post", Client().post(retry_url(anth), **h))
    assert child["retry_of"] == anth.public_id and child["retried_by"] == []
    shown = Client().get(f"/v1/messages/batches/{anth.public_id}", **h)
    assert check(schema, "/v1/messages/batches/{batch_id}", "get", shown)["retried_by"] == [child["id"]]
    storage.delete_batch(str(native.pk))
    check(schema, path, "post", Client().post(retry_url(native), **h))  # 410, declared
    clean = native_parent(catalog, failed=())
    check(schema, path, "post", Client().post(retry_url(clean), **h))  # 400, declared
