"""Item retention of ended OpenAI and Anthropic batches (batches/retention.py, `prune_items`).

OpenAI: past RELAY_OPENAI_ITEM_RETENTION_SECONDS an ended batch loses its items, their attempts and their
stored bodies in every store, while its batch object (GET, list) shows exactly what it showed before —
status, file ids, request_counts (frozen on the row), usage (from the usage events, which stay) — its output
and error files stay downloadable until they expire, and a retry is refused in OpenAI's error shape.

Anthropic: RELAY_ANTHROPIC_RESULTS_RETENTION_SECONDS (29 days) after its creation an ended batch is archived
the same way: the batch (GET, list) shows what it showed before plus `archived_at`, its results download is
refused in Anthropic's error shape (the SDK's results() raises NotFoundError), a retry is refused, DELETE
still works.

A batch not yet past retention, an open batch, and every batch when the setting is 0 keep their items. Items
run through the real pipeline against the fake upstream."""

import io
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import IntegrityError, transaction
from django.test import Client, override_settings
from django.utils import timezone

from batches import retention
from batches.models import Attempt, Batch, File, Item, Payload
from batches.surfaces.openai import finalize, validation
from core.models import User
from devkit.upstream import Reply
from tests.test_anthropic_lifecycle import create as create_anthropic
from tests.test_anthropic_lifecycle import req
from tests.test_openai_lifecycle import create, record, run_all
from tests.test_storage_s3 import bucket, s3_endpoint  # noqa: F401 - the s3 store's fixtures
from usage.models import UsageEvent

runs_items = pytest.mark.django_db(transaction=True)  # items finished in this process commit
HOUR = 3600
REFUSAL = Reply(status=400, body={"error": {"message": "context too long", "type": "invalid_request_error"}})


def auth(catalog) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {catalog.key}"}


def ended_batch(catalog, fake, n=3, refused=1, **extra) -> Batch:
    """An OpenAI batch run to its end: `refused` records answered 400 by the upstream (the error file)."""
    if refused:
        fake.script("upstream-openai-0", [REFUSAL] * refused)
    batch = create(catalog, [record(f"r{i}", f"hello {i}") for i in range(n)], **extra)
    validation.validate(batch.id)
    run_all()
    finalize.finalize(batch.id)
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == "completed", batch.status
    return batch


def shown(catalog, batch) -> dict:
    resp = Client().get(f"/v1/batches/{batch.public_id}", **auth(catalog))
    assert resp.status_code == 200, resp.content
    return resp.json()


def listed(catalog, batch) -> dict:
    data = Client().get("/v1/batches?limit=100", **auth(catalog)).json()["data"]
    return next(b for b in data if b["id"] == batch.public_id)


def content(catalog, file_id: str) -> tuple[int, bytes]:
    resp = Client().get(f"/v1/files/{file_id}/content", **auth(catalog))
    return resp.status_code, b"".join(resp.streaming_content) if resp.status_code == 200 else resp.content


def stored_bodies(batch, store, s3=None) -> int:
    """The batch's own stored bodies (inputs and results) in `store`; its files are under files/."""
    if store == "dir":
        root = Path(settings.RELAY_BATCH_PAYLOAD_DIR) / str(batch.id)
        return sum(1 for p in root.rglob("*") if p.is_file()) if root.exists() else 0
    if store == "db":
        return Payload.objects.filter(key__startswith=f"{batch.id}/").count()
    return len(s3.keys(f"{batch.id}/"))


@runs_items
@pytest.mark.parametrize("store", ["dir", "db", "s3"])
def test_an_ended_batch_loses_its_items_and_bodies_and_shows_the_same_object(catalog, fake, store, request):
    s3 = request.getfixturevalue("bucket") if store == "s3" else None
    with override_settings(RELAY_BATCH_PAYLOAD_STORE=store, RELAY_OPENAI_ITEM_RETENTION_SECONDS=HOUR):
        week = 7 * 24 * HOUR
        batch = ended_batch(catalog, fake, output_expires_after={"anchor": "created_at", "seconds": week})
        before, in_list = shown(catalog, batch), listed(catalog, batch)
        assert before["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
        assert before["usage"]["total_tokens"] > 0 and before["output_file_id"] and before["error_file_id"]
        output, errors = content(catalog, before["output_file_id"]), content(catalog, before["error_file_id"])
        assert output[0] == 200 and errors[0] == 200 and output[1].count(b"\n") == 2
        item_ids = {str(pk) for pk in Item.objects.filter(batch=batch).values_list("id", flat=True)}
        events = list(UsageEvent.objects.filter(batch_id=str(batch.id)).order_by("request_id").values())
        assert {e["request_id"] for e in events} == item_ids  # one billing record per item, by its id
        assert Attempt.objects.filter(item__batch=batch).exists() and stored_bodies(batch, store, s3) > 0

        # Not yet: an hour after it ended is the first sweep that removes anything.
        assert retention.sweep(now=batch.completed_at + timedelta(minutes=59))["items_pruned"] == 0
        assert Item.objects.filter(batch=batch).count() == 3

        out = retention.sweep(now=batch.completed_at + timedelta(hours=1, seconds=1))
        assert (out["openai_batches_pruned"], out["items_pruned"]) == (1, 3)
        pruned = Batch.objects.get(pk=batch.pk)
        assert pruned.items_pruned_at is not None and pruned.frozen_counts["completed"] == 2
        assert not Item.objects.filter(batch=batch).exists() and not Attempt.objects.filter(item_id__in=item_ids)
        assert stored_bodies(batch, store, s3) == 0
        # The object is the same in GET and in the list: status, files, counts, usage, every field.
        assert shown(catalog, batch) == before and listed(catalog, batch) == in_list
        # The billing record is untouched.
        assert list(UsageEvent.objects.filter(batch_id=str(batch.id)).order_by("request_id").values()) == events
        # The results are in the files, which stay until they expire.
        assert content(catalog, before["output_file_id"]) == output
        assert content(catalog, before["error_file_id"]) == errors

        # A retry has nothing to re-run: refused in OpenAI's shape, nothing made.
        batches = Batch.objects.count()
        resp = Client().post(f"/v1/batches/{batch.public_id}/retry_failed", **auth(catalog))
        assert resp.status_code == 410, resp.content
        error = resp.json()["error"]
        assert error["code"] == "payloads_unavailable" and "removed by retention" in error["message"]
        assert Batch.objects.count() == batches

        # Idempotent: the next sweep has nothing to do.
        again = retention.sweep(now=batch.completed_at + timedelta(hours=2))
        assert (again["openai_batches_pruned"], again["items_pruned"]) == (0, 0)

        # The files expire on their own schedule; the batch still names them and keeps its counts.
        expired = retention.sweep(now=batch.completed_at + timedelta(seconds=week + HOUR))
        assert expired["files"] == 2
        assert content(catalog, before["output_file_id"])[0] == 404
        assert shown(catalog, batch) == before


@runs_items
def test_young_open_and_kept_batches_keep_their_items(catalog, fake):
    young = ended_batch(catalog, fake, n=2, refused=0)
    open_batch = create(catalog, [record("open")])
    validation.validate(open_batch.id)  # in_progress, its item never claimed
    failed = create(catalog, raw_lines=[b"not json"])
    validation.validate(failed.id)
    assert Batch.objects.get(pk=failed.pk).status == "failed"
    far = timezone.now() + timedelta(days=365)

    with override_settings(RELAY_OPENAI_ITEM_RETENTION_SECONDS=0):  # 0 keeps every batch's items
        assert retention.sweep(now=far)["items_pruned"] == 0
    assert Batch.objects.filter(frozen_counts__isnull=False).count() == 0

    with override_settings(RELAY_OPENAI_ITEM_RETENTION_SECONDS=30 * 24 * HOUR):
        assert retention.sweep(now=young.completed_at + timedelta(days=29))["openai_batches_pruned"] == 0
        assert Item.objects.filter(batch=young).count() == 2
        failed_before = shown(catalog, failed)
        out = retention.sweep(now=far)
    # The young batch has aged past retention and the failed one ended long ago; the open one never ends here.
    assert out["openai_batches_pruned"] == 2 and out["items_pruned"] == 2
    assert Batch.objects.get(pk=open_batch.pk).frozen_counts is None
    assert Item.objects.filter(batch=open_batch).count() == 1
    assert shown(catalog, failed) == failed_before and failed_before["request_counts"]["total"] == 0


@runs_items
def test_a_removal_is_bounded_per_sweep_and_resumed_by_the_next(catalog, fake, monkeypatch):
    monkeypatch.setattr(retention, "PRUNE_SLICE", 2)
    monkeypatch.setattr(retention, "PRUNE_ITEMS_PER_SWEEP", 3)
    batch = ended_batch(catalog, fake, n=7, refused=2)
    before = shown(catalog, batch)
    root = Path(settings.RELAY_BATCH_PAYLOAD_DIR) / str(batch.id)
    later = batch.completed_at + timedelta(days=31)

    assert retention.sweep(now=later)["items_pruned"] == 3
    b = Batch.objects.get(pk=batch.pk)
    assert b.frozen_counts is not None and b.items_pruned_at is None
    assert Item.objects.filter(batch=batch).count() == 4 and root.is_dir()  # bodies go with the last item
    assert shown(catalog, batch) == before  # mid-removal the counts are the frozen ones, not the rows left
    assert Client().post(f"/v1/batches/{batch.public_id}/retry_failed", **auth(catalog)).status_code == 410

    # Resumed even with the setting turned off since: the counts are frozen already.
    with override_settings(RELAY_OPENAI_ITEM_RETENTION_SECONDS=0):
        assert retention.sweep(now=later)["items_pruned"] == 3
    out = retention.sweep(now=later)
    assert (out["openai_batches_pruned"], out["items_pruned"]) == (1, 1)
    assert Batch.objects.get(pk=batch.pk).items_pruned_at is not None and not root.exists()
    assert shown(catalog, batch) == before == {**before, "request_counts": {"total": 7, "completed": 5, "failed": 2}}


@runs_items
def test_the_admin_shows_a_pruned_batch_and_refuses_its_retry(catalog, fake):
    batch = ended_batch(catalog, fake)
    retention.sweep(now=batch.completed_at + timedelta(days=31))
    admin = User.objects.create_superuser("root", password="pw")
    c = Client()
    c.force_login(admin)
    page = c.get(f"/admin/batches/batch/{batch.pk}/change/")
    assert page.status_code == 200
    assert b"removed by retention" in page.content and b"2 / 1 / 0 / 0 / 0" in page.content
    assert b"RELAY_OPENAI_ITEM_RETENTION_SECONDS): the output and error files hold the results" in page.content
    listing = c.get("/admin/batches/batch/")
    assert listing.status_code == 200 and b"(items removed by retention)" in listing.content
    resp = c.post(
        "/admin/batches/batch/",
        {"action": "retry_failed_records", "_selected_action": [str(batch.pk)]},
        follow=True,
    )
    messages = [str(m) for m in resp.context["messages"]]
    assert any("not retried" in m and "removed by retention" in m for m in messages), messages
    assert Batch.objects.count() == 1


@pytest.mark.django_db
def test_counts_are_frozen_only_on_an_ended_openai_or_anthropic_batch(catalog):
    frozen = {"frozen_counts": {"completed": 0}, "frozen_at": timezone.now()}
    batch = create(catalog, [record("a")])  # validating
    with pytest.raises(IntegrityError), transaction.atomic():
        Batch.objects.filter(pk=batch.pk).update(**frozen)
    with pytest.raises(IntegrityError), transaction.atomic():
        Batch.objects.filter(pk=batch.pk).update(items_pruned_at=timezone.now())
    assert File.objects.filter(pk=batch.input_file_id).exists()

    message_batch = create_anthropic(catalog, [req("a")])  # in_progress
    with pytest.raises(IntegrityError), transaction.atomic():
        Batch.objects.filter(pk=message_batch.pk).update(**frozen)
    Batch.objects.filter(pk=message_batch.pk).update(status="completed", completed_at=timezone.now())
    # Ended, counts and time go together: neither alone.
    for half in ({"frozen_counts": {"completed": 0}}, {"frozen_at": timezone.now()}):
        with pytest.raises(IntegrityError), transaction.atomic():
            Batch.objects.filter(pk=message_batch.pk).update(**half)
    assert Batch.objects.filter(pk=message_batch.pk).update(**frozen) == 1


@runs_items
def test_a_payload_left_under_a_pruned_batch_is_an_orphan(catalog, fake, tmp_path):
    # No grace period: the batch (and its UUIDv7 id) was made just now.
    with override_settings(RELAY_BATCH_PAYLOAD_DIR=str(tmp_path), RELAY_ORPHAN_GRACE_SECONDS=0):
        batch = ended_batch(catalog, fake, refused=0)
        retention.sweep(now=batch.completed_at + timedelta(days=31))
        # A result appended after the removal (a worker fenced out long ago, its write late).
        late = tmp_path / str(batch.id) / "results" / "late.jsonl"
        late.parent.mkdir(parents=True)
        late.write_bytes(b"{}\n")
        old = time.time() - 3600
        for p in (late, late.parent, late.parent.parent):
            os.utime(p, (old, old))
        out = io.StringIO()
        call_command("payload_orphans", "--clean", stdout=out)
        assert str(late.parent.parent) in out.getvalue() and not late.parent.parent.exists()
        assert all(f.exists() for f in (tmp_path / "files").iterdir())  # its output file stays
        assert content(catalog, shown(catalog, batch)["output_file_id"])[0] == 200


# --- Anthropic: results archived 29 days after creation ----------------------------------------------

DAY = 24 * HOUR
ANTHROPIC_400 = Reply(status=400, body={"type": "error", "error": {"type": "invalid_request_error", "message": "no"}})


def ended_message_batch(catalog, fake, n=3, errored=1) -> Batch:
    """An Anthropic batch run to its end: `errored` requests answered 400 by the upstream."""
    if errored:
        fake.script("upstream-anthropic-0", [ANTHROPIC_400] * errored)
    batch = create_anthropic(catalog, [req(f"m{i}", f"hello {i}") for i in range(n)])
    run_all()
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == "completed", batch.status
    return batch


def anthropic_get(catalog, path: str):
    return Client().get(path, HTTP_X_API_KEY=catalog.key)


def message_batch(catalog, batch) -> dict:
    resp = anthropic_get(catalog, f"/v1/messages/batches/{batch.public_id}")
    assert resp.status_code == 200, resp.content
    return resp.json()


def message_batch_listed(catalog, batch) -> dict:
    data = anthropic_get(catalog, "/v1/messages/batches?limit=100").json()["data"]
    return next(b for b in data if b["id"] == batch.public_id)


def anthropic_results(catalog, batch):
    return anthropic_get(catalog, f"/v1/messages/batches/{batch.public_id}/results")


@runs_items
@pytest.mark.parametrize("store", ["dir", "db", "s3"])
def test_an_ended_anthropic_batch_is_archived_29_days_after_creation(catalog, fake, store, request):
    assert settings.RELAY_ANTHROPIC_RESULTS_RETENTION_SECONDS == 29 * DAY  # Anthropic's own 29 days
    s3 = request.getfixturevalue("bucket") if store == "s3" else None
    with override_settings(RELAY_BATCH_PAYLOAD_STORE=store):
        batch = ended_message_batch(catalog, fake)
        before, in_list = message_batch(catalog, batch), message_batch_listed(catalog, batch)
        counts = {"processing": 0, "succeeded": 2, "errored": 1, "canceled": 0, "expired": 0}
        assert before["request_counts"] == counts and before["archived_at"] is None
        assert before["processing_status"] == "ended" and before["results_url"].endswith("/results")
        resp = anthropic_results(catalog, batch)
        assert resp.status_code == 200 and b"".join(resp.streaming_content).count(b"\n") == 3
        item_ids = {str(pk) for pk in Item.objects.filter(batch=batch).values_list("id", flat=True)}
        events = list(UsageEvent.objects.filter(batch_id=str(batch.id)).order_by("request_id").values())
        assert {e["request_id"] for e in events} == item_ids
        assert Attempt.objects.filter(item__batch=batch).exists() and stored_bodies(batch, store, s3) > 0

        # Counted from creation: a minute short of 29 days nothing goes.
        out = retention.sweep(now=batch.created_at + timedelta(days=29, minutes=-1))
        assert (out["anthropic_batches_pruned"], out["items_pruned"]) == (0, 0)
        assert Item.objects.filter(batch=batch).count() == 3 and message_batch(catalog, batch) == before

        out = retention.sweep(now=batch.created_at + timedelta(days=29, seconds=1))
        assert (out["anthropic_batches_pruned"], out["openai_batches_pruned"], out["items_pruned"]) == (1, 0, 3)
        archived = Batch.objects.get(pk=batch.pk)
        assert archived.items_pruned_at is not None and archived.frozen_at is not None
        assert not Item.objects.filter(batch=batch).exists() and not Attempt.objects.filter(item_id__in=item_ids)
        assert stored_bodies(batch, store, s3) == 0

        # The object is the same, but for archived_at (the time its results went); in GET and in the list.
        after = message_batch(catalog, batch)
        assert after["archived_at"] == archived.frozen_at.isoformat().replace("+00:00", "Z")
        assert after == before | {"archived_at": after["archived_at"]}
        assert message_batch_listed(catalog, batch) == in_list | {"archived_at": after["archived_at"]}
        # The billing record is untouched.
        assert list(UsageEvent.objects.filter(batch_id=str(batch.id)).order_by("request_id").values()) == events
        # The admin says so in Anthropic's terms, not in the OpenAI surface's.
        admin = User.objects.create_superuser(f"root-{store}", password="pw")
        c = Client()
        c.force_login(admin)
        page = c.get(f"/admin/batches/batch/{batch.pk}/change/").content
        assert b"RELAY_ANTHROPIC_RESULTS_RETENTION_SECONDS): its results are no longer available" in page
        assert b"output and error files" not in page

        # The results are refused before anything streams, in Anthropic's error shape, naming the archive.
        resp = anthropic_results(catalog, batch)
        assert resp.status_code == 404 and not resp.streaming, resp
        error = resp.json()
        assert error["type"] == "error" and set(error) == {"type", "error"}
        assert error["error"]["type"] == "not_found_error" and error["error"]["code"] == "results_archived"
        assert f"archived at {after['archived_at']}" in error["error"]["message"]
        assert "29 days after a batch is created" in error["error"]["message"]

        # A retry has nothing to re-run: refused in Anthropic's shape, nothing made.
        batches = Batch.objects.count()
        resp = Client().post(f"/v1/messages/batches/{batch.public_id}/retry_failed", HTTP_X_API_KEY=catalog.key)
        assert resp.status_code == 410, resp.content
        error = resp.json()
        assert error["type"] == "error" and error["error"]["code"] == "payloads_unavailable"
        assert "archived at" in error["error"]["message"] and "submit them again" in error["error"]["message"]
        assert Batch.objects.count() == batches

        # Idempotent: the next sweep has nothing to do.
        again = retention.sweep(now=batch.created_at + timedelta(days=60))
        assert (again["anthropic_batches_pruned"], again["items_pruned"]) == (0, 0)
        assert message_batch(catalog, batch) == after

        # Deleting it still works; its usage events stay.
        resp = Client().delete(f"/v1/messages/batches/{batch.public_id}", HTTP_X_API_KEY=catalog.key)
        assert resp.status_code == 200 and resp.json() == {"id": batch.public_id, "type": "message_batch_deleted"}
        assert not Batch.objects.filter(pk=batch.pk).exists()
        assert anthropic_get(catalog, f"/v1/messages/batches/{batch.public_id}").status_code == 404
        assert UsageEvent.objects.filter(batch_id=str(batch.id)).count() == 3


@runs_items
def test_the_anthropic_sdk_sees_an_archived_batch(catalog, fake, live_server):
    import anthropic

    with anthropic.Anthropic(base_url=live_server.url, api_key=catalog.key, max_retries=0) as sdk:
        created = sdk.messages.batches.create(requests=[req("a"), req("b")])
        run_all()
        assert sdk.messages.batches.retrieve(created.id).processing_status == "ended"
        assert {r.custom_id for r in sdk.messages.batches.results(created.id)} == {"a", "b"}
        retention.sweep(now=created.created_at + timedelta(days=30))

        archived = sdk.messages.batches.retrieve(created.id)
        assert archived.archived_at is not None and archived.results_url  # kept: results() asks, and is told
        assert archived.request_counts.succeeded == 2
        with pytest.raises(anthropic.NotFoundError) as refused:
            sdk.messages.batches.results(created.id)
        assert "archived at" in str(refused.value)
        assert sdk.messages.batches.delete(created.id).type == "message_batch_deleted"


@runs_items
def test_anthropic_counts_survive_archiving_for_every_ended_kind(catalog, fake):
    from batches import sweeper
    from batches.lifecycle import claim, stop
    from batches.worker import execute

    expired = create_anthropic(catalog, [req(f"e{i}") for i in range(3)])
    execute.run_item(claim.claim("test-runner"))  # one finishes; the window closes on the other two
    Batch.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    sweeper.sweep()
    cancelled = create_anthropic(catalog, [req("c1"), req("c2")])
    assert stop.cancel(Batch.objects.get(pk=cancelled.pk)) is True
    before = {b.pk: message_batch(catalog, b) for b in (expired, cancelled)}
    assert before[expired.pk]["request_counts"] == {
        "processing": 0, "succeeded": 1, "errored": 0, "canceled": 0, "expired": 2,
    }  # fmt: skip
    assert before[cancelled.pk]["request_counts"]["canceled"] == 2

    out = retention.sweep(now=timezone.now() + timedelta(days=30))
    assert (out["anthropic_batches_pruned"], out["items_pruned"]) == (2, 5)
    for b in (expired, cancelled):
        after = message_batch(catalog, b)
        assert after["archived_at"] and after == before[b.pk] | {"archived_at": after["archived_at"]}


@runs_items
def test_young_open_and_kept_anthropic_batches_keep_their_items(catalog, fake, caplog):
    young = ended_message_batch(catalog, fake, n=2, errored=0)
    open_batch = create_anthropic(catalog, [req("open")])  # never run: in_progress
    far = timezone.now() + timedelta(days=365)

    with override_settings(RELAY_ANTHROPIC_RESULTS_RETENTION_SECONDS=0):  # 0 keeps every batch's results
        assert retention.sweep(now=far)["items_pruned"] == 0
    assert not Batch.objects.filter(frozen_counts__isnull=False).exists()
    assert anthropic_results(catalog, young).status_code == 200

    assert retention.sweep(now=young.created_at + timedelta(days=28))["anthropic_batches_pruned"] == 0
    assert Item.objects.filter(batch=young).count() == 2

    # Past 29 days the ended one goes; the open one (its sweeper missed) is left alone, and reported.
    with caplog.at_level("WARNING", logger="batches.retention"):
        out = retention.sweep(now=far)
    assert (out["anthropic_batches_pruned"], out["items_pruned"]) == (1, 2)
    assert Batch.objects.get(pk=open_batch.pk).frozen_counts is None
    assert Item.objects.filter(batch=open_batch).count() == 1
    assert any(open_batch.public_id in r.getMessage() and "not ended" in r.getMessage() for r in caplog.records)
    assert message_batch(catalog, open_batch)["archived_at"] is None


@runs_items
def test_a_results_stream_cut_short_by_archiving_fails_instead_of_ending_short(catalog, fake, monkeypatch):
    from batches.surfaces import common
    from batches.surfaces.anthropic import read as anthropic_read

    monkeypatch.setattr(common, "RESULT_PAGE", 1)
    batch = ended_message_batch(catalog, fake, n=3, errored=0)
    stream = anthropic_read.iter_results(batch)
    assert b'"custom_id":"m0"' in next(stream)  # the first page read and sent
    retention.sweep(now=batch.created_at + timedelta(days=30))  # the rest go under the stream
    with pytest.raises(anthropic_read.ResultsCutShort):
        list(stream)
    # Whole when nothing raced it (one page at a time, as above).
    whole = ended_message_batch(catalog, fake, n=3, errored=0)
    assert len(list(anthropic_read.iter_results(whole))) == 3


@pytest.mark.django_db
def test_the_sweep_finds_due_batches_through_the_items_kept_index(catalog):
    """The planner can answer every retention look-up from batch_items_kept (its predicate is implied by each
    query's): with sequential scans and sorts off, each plan names it. Sorts too: on a test's handful of rows
    another partial index scanned whole and sorted costs the same, and the planner took it now and then;
    batch_items_kept is the one index that hands the rows over in created_at order for a surface."""
    from django.db import connection

    now = timezone.now()
    queries = []
    for rules in retention.ITEM_RETENTION:
        due = rules.due(now)
        queries += [due.filter(status__in=rules.statuses), due.exclude(status__in=rules.statuses)]
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL enable_sort = off")
        for qs in queries:
            assert "batch_items_kept" in qs.values_list("id", flat=True)[:10].explain(), str(qs.query)
