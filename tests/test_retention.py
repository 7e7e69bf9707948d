"""Retention: expires_after on uploads, output_expires_after on batches, the retention job, payloads
removed with their rows (API, admin, cascade), revoked tokens pruned, and the orphan report."""

import io
import json
import os
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import Client, override_settings
from django.utils import timezone

from batches import retention, storage
from batches.lifecycle import claim as claims
from batches.models import Batch, File, OutputExpiry, Payload
from batches.surfaces.native import submit
from batches.surfaces.openai import finalize, validation
from batches.worker import execute
from core import auth
from core.models import RevokedToken, User
from tests.test_openai_lifecycle import create, record, run_all, storage_file

pytestmark = pytest.mark.django_db
runs_items = pytest.mark.django_db(transaction=True)

JSONL = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


def upload(key, **fields):
    f = io.BytesIO(JSONL)
    f.name = "in.jsonl"
    return Client().post(
        "/v1/files", data={"file": f, "purpose": "batch", **fields}, HTTP_AUTHORIZATION=f"Bearer {key}"
    )


def stored(file: File) -> bool:
    try:
        b"".join(storage.iter_file(file.ref))
    except storage.PayloadMissing:
        return False
    return True


def test_upload_with_expires_after_shows_expires_at(catalog):
    resp = upload(catalog.key, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"})
    assert resp.status_code == 200, resp.content
    body = resp.json()
    assert body["expires_at"] == body["created_at"] + 3600
    got = Client().get(f"/v1/files/{body['id']}", HTTP_AUTHORIZATION=f"Bearer {catalog.key}").json()
    assert got["expires_at"] == body["expires_at"]
    # Without it a file is kept until deleted, as before.
    assert upload(catalog.key).json()["expires_at"] is None


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"}, "expires_after.anchor"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"}, "expires_after.seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "soon"}, "expires_after.seconds"),
        ({"expires_after[seconds]": "3600"}, "expires_after.anchor"),
    ],
)
def test_bad_expires_after_is_400_and_stores_nothing(catalog, fields, param):
    resp = upload(catalog.key, **fields)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param
    assert not File.objects.exists()


def test_output_expires_after_is_accepted_and_validated(catalog):
    ok = create(catalog, [record("a")], output_expires_after={"anchor": "created_at", "seconds": 7200})
    assert OutputExpiry.objects.get(batch_id=ok.id).seconds == 7200
    bad = Client().post(
        "/v1/batches",
        data=json.dumps(
            {
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "requests": [record("a")],
                "output_expires_after": {"anchor": "created_at", "seconds": 10**9},
            }
        ),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {catalog.key}",
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "output_expires_after.seconds"


@runs_items
def test_output_files_expire_and_disappear_within_one_sweep(catalog, fake):
    batch = create(catalog, [record("a"), record("b")], output_expires_after={"anchor": "created_at", "seconds": 3600})
    validation.validate(batch.id)
    run_all()
    finalize.finalize(batch.id)
    batch.refresh_from_db()
    output = File.objects.get(pk=batch.output_file_id)
    assert output.expires_at == output.created_at + timedelta(seconds=3600)
    assert stored(output)

    assert retention.sweep()["files"] == 0  # not yet due
    result = retention.sweep(now=output.expires_at + timedelta(seconds=1))
    assert result["files"] == 1
    assert not File.objects.filter(pk=output.pk).exists() and not stored(output)
    c = Client()
    resp = c.get(f"/v1/files/{output.public_id}", HTTP_AUTHORIZATION=f"Bearer {catalog.key}")
    assert resp.status_code == 404


@pytest.mark.parametrize("store", ["dir", "db"])
def test_expired_uploads_are_removed_row_and_bytes(catalog, store, django_capture_on_commit_callbacks):
    with override_settings(RELAY_BATCH_PAYLOAD_STORE=store):
        principal = auth._principal_from_key(catalog.key)
        gone = storage_file(principal, JSONL)
        kept = storage_file(principal, JSONL)
        forever = storage_file(principal, JSONL)
        now = timezone.now()
        File.objects.filter(pk=gone.pk).update(expires_at=now - timedelta(seconds=1))
        File.objects.filter(pk=kept.pk).update(expires_at=now + timedelta(hours=1))
        # The bytes go once the delete has committed: run those callbacks here.
        with django_capture_on_commit_callbacks(execute=True):
            assert retention.sweep(now=now)["files"] == 1
        assert set(File.objects.values_list("pk", flat=True)) == {kept.pk, forever.pk}
        assert not stored(gone) and stored(kept) and stored(forever)


def test_an_input_file_still_being_validated_waits(catalog):
    batch = create(catalog, raw_lines=[json.dumps(record("a")).encode()])
    assert batch.status == "validating"
    File.objects.filter(pk=batch.input_file_id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert retention.sweep()["files"] == 0  # it stays until validation has copied the records
    validation.validate(batch.id)
    assert retention.sweep()["files"] == 1


@runs_items
def test_native_batches_past_retention_go_with_their_payloads(catalog, fake):
    batch = _native(auth._principal_from_key(catalog.key), 2)
    while (item := claims.claim("t")) is not None:
        execute.run_item(item)
    batch.refresh_from_db()
    assert batch.status == "completed"
    root = Path(settings.RELAY_BATCH_PAYLOAD_DIR) / str(batch.id)
    assert root.is_dir()
    with override_settings(RELAY_NATIVE_BATCH_RETENTION_SECONDS=0):
        assert retention.sweep(now=timezone.now() + timedelta(days=365))["native_batches"] == 0  # 0 keeps
    with override_settings(RELAY_NATIVE_BATCH_RETENTION_SECONDS=3600):
        assert retention.sweep()["native_batches"] == 0
        assert retention.sweep(now=timezone.now() + timedelta(hours=2))["native_batches"] == 1
    assert not Batch.objects.filter(pk=batch.pk).exists() and not root.exists()


def _native(principal, n):
    from batches import ingest

    body = {
        "shape": "openai",
        "requests": [{"model": "gpt-4o", "messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(n)],
    }
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**8, 50_000) as submission:
        return submit.store_native(principal, submission)


@runs_items
@pytest.mark.parametrize("store", ["dir", "db"])
def test_deleting_an_openai_batch_in_the_admin_removes_its_files_and_payloads(catalog, fake, store):
    with override_settings(RELAY_BATCH_PAYLOAD_STORE=store):
        batch = create(catalog, [record("a")])
        validation.validate(batch.id)
        run_all()
        finalize.finalize(batch.id)
        batch.refresh_from_db()
        files = list(File.objects.filter(batch_id=batch.id))
        assert {f.purpose for f in files} == {"batch", "batch_output"}  # the inline input and the output
        assert all(stored(f) for f in files)

        admin = User.objects.create_superuser("root", password="pw")
        c = Client()
        c.force_login(admin)
        resp = c.post(f"/admin/batches/batch/{batch.pk}/delete/", {"post": "yes"})
        assert resp.status_code == 302, resp.content[:500]
        assert not Batch.objects.filter(pk=batch.pk).exists()
        assert not File.objects.filter(batch_id=batch.id).exists()
        assert not any(stored(f) for f in files)
        assert not Payload.objects.filter(key__startswith=f"{batch.id}/").exists()
        assert not (Path(settings.RELAY_BATCH_PAYLOAD_DIR) / str(batch.id)).exists()


@pytest.mark.django_db(transaction=True)
def test_deleting_a_file_in_the_admin_removes_its_bytes(catalog):
    principal = auth._principal_from_key(catalog.key)
    file = storage_file(principal, JSONL)
    admin = User.objects.create_superuser("root", password="pw")
    c = Client()
    c.force_login(admin)
    resp = c.post(f"/admin/batches/file/{file.pk}/delete/", {"post": "yes"})
    assert resp.status_code == 302
    assert not File.objects.filter(pk=file.pk).exists() and not stored(file)


def test_revoked_tokens_are_pruned_after_they_would_have_expired():
    now = timezone.now()
    RevokedToken.objects.create(jti="old", expires_at=now - timedelta(days=2))
    RevokedToken.objects.create(jti="live", expires_at=now + timedelta(days=2))
    RevokedToken.objects.create(jti="just-expired", expires_at=now - timedelta(seconds=10))  # inside the margin
    assert retention.sweep(now=now)["revoked_tokens"] == 1
    assert set(RevokedToken.objects.values_list("jti", flat=True)) == {"live", "just-expired"}


@pytest.mark.django_db(transaction=True)
def test_orphan_report_and_clean(catalog, tmp_path):
    with override_settings(RELAY_BATCH_PAYLOAD_DIR=str(tmp_path), RELAY_ORPHAN_GRACE_SECONDS=60):
        principal = auth._principal_from_key(catalog.key)
        kept = storage_file(principal, JSONL)
        # Orphans: a batch directory and a file no row points at, and db rows of a deleted batch.
        old = time.time() - 3600
        lost_batch = tmp_path / "00000000-0000-4000-8000-000000000001"
        (lost_batch / "results").mkdir(parents=True)
        (lost_batch / "input.jsonl").write_bytes(b"x" * 10)
        lost_file = tmp_path / "files" / "00000000-0000-4000-8000-000000000002"
        lost_file.write_bytes(b"y" * 5)
        for p in (lost_batch, lost_file):
            os.utime(p, (old, old))
        Payload.objects.create(key="00000000-0000-4000-8000-000000000003/in/0", data=b"z")
        # Young: an upload in flight is never an orphan.
        (tmp_path / "files" / "fresh.part").write_bytes(b"w")

        out = io.StringIO()
        call_command("payload_orphans", stdout=out)
        report = out.getvalue()
        assert str(lost_batch) in report and str(lost_file) in report
        assert "db:00000000-0000-4000-8000-000000000003/in/0" in report
        assert "3 orphaned payload(s), 15 bytes on disk" in report
        assert lost_batch.exists()  # a report removes nothing

        call_command("payload_orphans", "--clean", stdout=io.StringIO())
        assert not lost_batch.exists() and not lost_file.exists()
        assert not Payload.objects.exists()
        assert (tmp_path / "files" / "fresh.part").exists() and stored(kept)
        out = io.StringIO()
        call_command("payload_orphans", stdout=out)
        assert "0 orphaned payload(s)" in out.getvalue()


def test_an_expired_file_is_gone_from_the_api_before_the_sweep(client, catalog):
    body = upload(catalog.key).json()
    File.objects.filter(pk=uuid.UUID(hex=body["id"][5:])).update(expires_at=timezone.now() - timedelta(seconds=1))
    h = {"Authorization": f"Bearer {catalog.key}"}
    assert client.get(f"/v1/files/{body['id']}", headers=h).status_code == 404
    assert client.get(f"/v1/files/{body['id']}/content", headers=h).status_code == 404
    assert body["id"] not in [f["id"] for f in client.get("/v1/files", headers=h).json()["data"]]
