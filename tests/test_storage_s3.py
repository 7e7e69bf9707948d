"""The `s3` payload store (batches/storage_s3.py) against an S3 server on loopback: moto's server mode,
started for the session (scripts/s3.sh), or the server RELAY_TEST_S3_ENDPOINT names (MinIO, say).

Each test gets a bucket of its own. The interface is the one the `dir` and `db` stores answer; large
payloads go multipart in bounded memory; batches run by real workers keep their payloads in the bucket;
retention and orphan cleanup remove objects; an unreachable store is a clear error, nothing half-written.
"""

import hashlib
import io
import json
import os
import socket
import subprocess
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from batches import retention, storage, storage_s3_checks
from batches.models import Batch, File, Item
from tests.workers import wait_for

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024
CHAT = "/v1/chat/completions"
runs_items = pytest.mark.django_db(transaction=True)  # items claimed and finished in this process commit
# moto takes any keys; another server (RELAY_TEST_S3_ENDPOINT) takes those in the environment.
KEYS = {
    "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "relay-test"),
    "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", "relay-test-secret"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    given = os.environ.get("RELAY_TEST_S3_ENDPOINT")
    if given:
        yield given
        return
    try:
        import moto  # noqa: F401
    except ImportError:
        pytest.skip("moto[server] is not installed (requirements-dev.txt): no S3 server on loopback to test against")
    port = _free_port()
    script = ROOT / "scripts" / "s3.sh"
    subprocess.run(["bash", str(script), str(port)], check=True, cwd=ROOT, capture_output=True, timeout=90)
    yield f"http://127.0.0.1:{port}"
    subprocess.run(["bash", str(script), "stop", str(port)], cwd=ROOT, capture_output=True, timeout=30)


class Bucket:
    def __init__(self, endpoint: str):
        import boto3

        self.endpoint = endpoint
        self.name = f"relay-test-{uuid.uuid4().hex[:12]}"
        self.prefix = "relay/"
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **_boto_keys())
        self.client.create_bucket(Bucket=self.name)

    def settings(self) -> dict:
        return {
            "RELAY_BATCH_PAYLOAD_STORE": "s3",
            "RELAY_S3_BUCKET": self.name,
            "RELAY_S3_ENDPOINT_URL": self.endpoint,
            "RELAY_S3_REGION": "us-east-1",
            "RELAY_S3_PREFIX": self.prefix,
            **KEYS,
        }

    def keys(self, under: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=self.prefix + under)
        return sorted(o["Key"][len(self.prefix) :] for page in pages for o in page.get("Contents", ()))

    def uploads(self) -> list:
        return self.client.list_multipart_uploads(Bucket=self.name).get("Uploads", [])

    def head(self, rel: str) -> dict:
        return self.client.head_object(Bucket=self.name, Key=self.prefix + rel)


def _boto_keys() -> dict:
    return {"aws_access_key_id": KEYS["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": KEYS["AWS_SECRET_ACCESS_KEY"]}


@pytest.fixture
def bucket(s3_endpoint, settings):
    b = Bucket(s3_endpoint)
    for name, value in b.settings().items():
        setattr(settings, name, value)
    return b


def record(custom_id: str, content: str = "hi") -> dict:
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": content}]}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


# --- the interface ------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_storage_interface_round_trips_through_the_bucket(bucket):
    batch_id = str(uuid.uuid4())
    writer = storage.input_writer(batch_id)
    assert writer.uses_db is False
    inputs = [json.dumps({"n": i, "pad": "x" * i}).encode() for i in range(50)]
    refs = [writer.add(i, data) for i, data in enumerate(inputs)]
    writer.close()
    assert bucket.keys() == [f"{batch_id}/input.jsonl"]
    assert all(ref.startswith(f"s3:{batch_id}/input.jsonl#") for ref in refs)
    assert storage.read(refs[7]) == inputs[7]
    assert storage.read_input(refs[49]) == inputs[49]
    storage.close_inputs()

    result_refs = [storage.write_result(batch_id, f"item-{i}", b'{"ok": %d}' % i) for i in range(3)]
    again = storage.write_result(batch_id, "item-0", b'{"ok": "retry"}')
    assert again != result_refs[0]  # an attempt never overwrites another's result
    assert storage.read(result_refs[1]) == b'{"ok": 1}'
    missing = f"s3:{batch_id}/results/never-written"
    past_the_end = f"s3:{batch_id}/input.jsonl#{10**6}:5"
    with pytest.raises(storage.PayloadMissing, match="truncated"):
        storage.read(past_the_end)
    got = storage.read_many([refs[3], result_refs[2], missing, refs[4], "s3:x#bad", refs[0], again])
    assert got[0] == inputs[3] and got[1] == b'{"ok": 2}' and got[3] == inputs[4] and got[5] == inputs[0]
    assert got[6] == b'{"ok": "retry"}'
    assert isinstance(got[2], storage.PayloadMissing) and isinstance(got[4], storage.PayloadMissing)
    with pytest.raises(storage.PayloadMissing):
        storage.read(missing)

    lines = b"".join(b'{"line": %d}\n' % i for i in range(1000))
    fw = storage.file_writer("file-a", limit=10 * MiB)
    for i in range(0, len(lines), 777):
        fw.write(lines[i : i + 777])
    ref = fw.close()
    assert ref == "s3:files/file-a" and fw.size == len(lines)
    assert b"".join(storage.iter_file(ref, chunk_size=4096)) == lines
    assert [n for n, _ in storage.iter_lines(ref, max_line=100)] == list(range(1, 1001))
    too_big = storage.file_writer("file-b", limit=10)
    with pytest.raises(storage.FileTooLarge):
        too_big.write(b"x" * 11)
    too_big.discard()
    assert "files/file-b" not in bucket.keys("files/")

    storage.delete_file(ref)
    with pytest.raises(storage.PayloadMissing):
        next(storage.iter_file(ref))
    storage.delete_batch(batch_id)
    assert bucket.keys() == []


@pytest.mark.django_db
def test_a_discarded_input_leaves_nothing_and_read_back_returns_what_was_written(bucket):
    writer = storage.input_writer("b1")
    writer.add(0, b'{"a": 1}')
    writer.add(1, b'{"b": 2}')
    with writer.read_back() as copy:
        writer.discard()
        assert copy.read() == b'{"a": 1}\n{"b": 2}\n'
    assert bucket.keys() == [] and bucket.uploads() == []


def _stream(total: int, chunk: int = 256 * 1024):
    """`total` bytes of JSONL made as they are asked for (never all at once), and their sha256. Each chunk is a
    line numbering it, then lines of a fixed filler: no two chunks are alike (a part sent twice, lost or out of
    order changes the digest), and a chunk is two allocations, not thousands of lines built one by one (under
    tracemalloc, which the 70 MiB test runs, that cost most of its time)."""
    digest = hashlib.sha256()
    filler = b"".join(b'{"n": %d, "pad": "%s"}\n' % (n, b"y" * (n % 50)) for n in range(chunk // 30))

    def chunks():
        sent = n = 0
        while sent < total:
            data = (b'{"chunk": %d}\n' % n + filler)[: min(chunk, total - sent)]
            digest.update(data)
            sent += len(data)
            n += 1
            yield data

    return chunks(), digest


@pytest.mark.django_db
def test_a_70_mib_file_goes_multipart_and_streams_both_ways_in_bounded_memory(bucket):
    total = 70 * MiB
    chunks, digest = _stream(total)
    writer = storage.file_writer("big")
    tracemalloc.start()
    try:
        for data in chunks:
            writer.write(data)
        ref = writer.close()
        peak_up = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        back, size = hashlib.sha256(), 0
        for data in storage.iter_file(ref):
            back.update(data)
            size += len(data)
        peak_down = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"s3 store, 70 MiB file: traced peak {peak_up / MiB:.2f} MiB writing, {peak_down / MiB:.2f} MiB reading")
    assert size == total and back.hexdigest() == digest.hexdigest()
    # A multipart object's ETag is "<md5 of the parts' md5s>-<parts>": the 64 MiB spooled first, then the rest.
    assert bucket.head("files/big")["ETag"].strip('"').endswith("-2")
    assert bucket.uploads() == []
    assert peak_up < 8 * MiB, f"upload peak {peak_up} bytes"
    assert peak_down < 8 * MiB, f"download peak {peak_down} bytes"


@pytest.mark.django_db
def test_a_multipart_upload_cut_short_is_aborted_and_leaves_no_object(bucket, monkeypatch):
    from batches import storage_s3

    # S3's smallest parts: the cut-short upload is the same at 6 MiB as past the real 64 MiB (the test above).
    monkeypatch.setattr(storage_s3, "MULTIPART_THRESHOLD", 6 * MiB)
    monkeypatch.setattr(storage_s3, "PART_SIZE", 5 * MiB)
    chunks, _ = _stream(20 * MiB)
    writer = storage.file_writer("cut", limit=12 * MiB)
    with pytest.raises(storage.FileTooLarge):
        for data in chunks:
            writer.write(data)
    assert len(bucket.uploads()) == 1  # the upload had begun (past the threshold, a part sent) …
    writer.discard()
    assert bucket.uploads() == [] and bucket.keys() == []  # … and is aborted: nothing is left


@pytest.mark.django_db
def test_a_store_failing_mid_multipart_leaves_neither_object_nor_upload(bucket, monkeypatch):
    from batches import storage_s3

    monkeypatch.setattr(storage_s3, "MULTIPART_THRESHOLD", 6 * MiB)  # S3's smallest parts, for speed
    monkeypatch.setattr(storage_s3, "PART_SIZE", 5 * MiB)
    chunks, _ = _stream(20 * MiB)
    writer = storage.file_writer("mid")
    while not bucket.uploads():
        writer.write(next(chunks))
    [upload] = bucket.uploads()  # under way; now the store loses it (as a lifecycle rule would)
    bucket.client.abort_multipart_upload(Bucket=bucket.name, Key=upload["Key"], UploadId=upload["UploadId"])
    with pytest.raises(storage.PayloadStoreUnavailable):
        for data in chunks:
            writer.write(data)
        writer.close()
    writer.discard()  # what every caller does next: harmless, the writer cleaned up already
    assert bucket.uploads() == [] and bucket.keys() == []


# --- an unreachable or misconfigured store -------------------------------------------------------------


@pytest.mark.integration  # no database, but a server on loopback
def test_system_checks_name_what_is_wrong(bucket, settings):
    assert storage_s3_checks.check_settings() == []
    assert storage_s3_checks.check_reachable(databases=["default"]) == []
    assert storage_s3_checks.check_reachable() == []  # the network is asked only where databases are
    settings.RELAY_S3_BUCKET = ""
    assert [e.id for e in storage_s3_checks.check_settings()] == ["batches.E301"]
    settings.RELAY_S3_BUCKET = "no-such-bucket-here"
    [error] = storage_s3_checks.check_reachable(databases=["default"])
    assert error.id == "batches.E304" and "no-such-bucket-here" in error.hint
    settings.RELAY_S3_BUCKET = bucket.name
    settings.RELAY_S3_ENDPOINT_URL = f"http://127.0.0.1:{_free_port()}"
    [error] = storage_s3_checks.check_reachable(databases=["default"])
    assert error.id == "batches.E304" and "EndpointConnectionError" in error.msg


@pytest.mark.django_db
def test_an_unreachable_store_answers_503_in_the_api_shape_and_stores_nothing(bucket, settings, catalog):
    settings.RELAY_S3_ENDPOINT_URL = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    c = Client()
    auth = {"HTTP_AUTHORIZATION": f"Bearer {catalog.key}"}
    upload = io.BytesIO(json.dumps(record("a")).encode() + b"\n")
    upload.name = "in.jsonl"
    resp = c.post("/v1/files", data={"file": upload, "purpose": "batch"}, **auth)
    assert resp.status_code == 503, resp.content
    assert resp.json()["error"]["code"] == "payload_store_unavailable"
    assert not File.objects.exists()

    body = {"shape": "openai", "requests": [record("a")["body"]] * 3}
    resp = c.post("/v1/batches", data=json.dumps(body), content_type="application/json", **auth)
    assert resp.status_code == 503, resp.content
    assert resp.json()["error"]["code"] == "payload_store_unavailable"
    assert not Batch.objects.exists() and not Item.objects.exists()


@pytest.mark.django_db
def test_a_missing_bucket_is_a_503_too_and_nothing_is_left(bucket, settings, catalog):
    settings.RELAY_S3_BUCKET = "relay-test-missing-bucket"
    c = Client()
    upload = io.BytesIO(b"x" * 1000)
    upload.name = "in.jsonl"
    resp = c.post("/v1/files", data={"file": upload, "purpose": "batch"}, HTTP_AUTHORIZATION=f"Bearer {catalog.key}")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "payload_store_unavailable"
    assert not File.objects.exists()


# --- retention and orphan cleanup -------------------------------------------------------------------------


def _run_items() -> None:
    from batches.lifecycle import claim as claims
    from batches.worker import execute

    while (item := claims.claim("t")) is not None:
        execute.run_item(item)


def _stored_file(catalog, data: bytes) -> File:
    from batches.surfaces.openai import files
    from core import auth

    owner = auth.principal_for_key(catalog.key)
    return files.write_file(owner, purpose="batch", filename="in.jsonl", chunks=[data])


def _native(catalog, n: int) -> Batch:
    from batches import ingest
    from batches.surfaces.native import submit
    from core import auth

    body = {"shape": "openai", "requests": [record(str(i), f"hi {i}")["body"] for i in range(n)]}
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**8, 50_000) as submission:
        return submit.store_native(auth.principal_for_key(catalog.key), submission)


@runs_items
def test_retention_removes_a_batchs_objects_and_an_expired_files_object(bucket, settings, catalog, fake):
    from datetime import timedelta

    batch = _native(catalog, 3)
    _run_items()
    batch.refresh_from_db()
    assert batch.status == "completed"
    stored = bucket.keys(f"{batch.id}/")
    assert f"{batch.id}/input.jsonl" in stored and len(stored) == 4  # the inputs and three results

    file = _stored_file(catalog, json.dumps(record("a")).encode() + b"\n")
    File.objects.filter(pk=file.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    settings.RELAY_NATIVE_BATCH_RETENTION_SECONDS = 3600
    swept = retention.sweep(now=timezone.now() + timedelta(hours=2))  # bytes go as each delete commits
    assert swept["native_batches"] == 1 and swept["files"] == 1
    assert bucket.keys() == []


@runs_items
def test_orphan_cleanup_removes_unreferenced_objects_and_keeps_referenced_and_fresh_ones(
    bucket, settings, catalog, fake, tmp_path
):
    import uuid6

    settings.RELAY_BATCH_PAYLOAD_DIR = str(tmp_path)  # this test's directory store: empty
    settings.RELAY_ORPHAN_GRACE_SECONDS = 3600
    kept = _native(catalog, 2)
    _run_items()
    gone = str(uuid6.uuid7())  # a batch whose row never committed: its inputs and a result remain
    writer = storage.input_writer(gone)
    writer.add(0, b"{}")
    writer.close()
    storage.write_result(gone, "item", b"{}")
    file = _stored_file(catalog, b"{}\n")
    unreferenced = storage.file_writer(str(uuid6.uuid7()))
    unreferenced.write(b"{}\n")
    lost = unreferenced.close()
    vanished = _stored_file(catalog, b"{}\n")  # its row now points elsewhere: its object is unreferenced too
    File.objects.filter(pk=vanished.pk).update(ref="s3:files/never-stored")
    abandoned = bucket.client.create_multipart_upload(
        Bucket=bucket.name, Key=f"{bucket.prefix}{uuid6.uuid7()}/input.jsonl"
    )
    before = bucket.keys()

    fresh = retention.find_orphans()  # everything was just written: within the grace period
    assert fresh.objects == [] and fresh.uploads == []
    assert fresh.missing_files == [f"file-{vanished.pk.hex}"]

    later = retention.find_orphans(now=time.time() + 2 * 3600)
    assert sorted(later.objects) == sorted([f"s3:{gone}/", lost, vanished.ref])
    assert later.uploads == [(abandoned["Key"][len(bucket.prefix) :], abandoned["UploadId"])]
    assert later.count == 4 and later.bytes > 0
    retention.clean_orphans(later)
    assert bucket.uploads() == []
    assert bucket.keys() == sorted(
        k for k in before if not k.startswith(gone) and f"s3:{k}" not in (lost, vanished.ref)
    )
    assert storage.read(Item.objects.filter(batch_id=kept.pk).first().result_ref)  # kept: its batch exists
    assert b"".join(storage.iter_file(file.ref)) == b"{}\n"
    out = io.StringIO()
    call_command("payload_orphans", stdout=out)
    assert "0 orphaned payload(s)" in out.getvalue()


# --- end to end: real workers with the s3 store ---------------------------------------------------------


@pytest.fixture
def s3_workers(workers, bucket, tmp_path):
    """Start a fleet whose processes use the bucket, as a deployment sets them: by the environment."""
    env = {**bucket.settings(), "RELAY_BATCH_PAYLOAD_DIR": str(tmp_path / "unused")}
    return lambda name: workers(name, extra_env=env)


@pytest.mark.django_db(transaction=True)
def test_a_native_and_an_openai_file_batch_run_by_workers_keep_their_payloads_in_the_bucket(
    bucket, catalog, fake, s3_workers, tmp_path, settings
):
    settings.RELAY_BATCH_PAYLOAD_DIR = str(tmp_path / "web")  # nothing may land in a directory
    s3_workers("s3")
    c = Client()
    auth = {"HTTP_AUTHORIZATION": f"Bearer {catalog.key}"}

    body = {"shape": "openai", "requests": [record(str(i), f"native {i}")["body"] for i in range(12)]}
    resp = c.post("/v1/batches", data=json.dumps(body), content_type="application/json", **auth)
    assert resp.status_code == 202, resp.content
    native_id = resp.json()["id"]

    lines = b"".join(json.dumps(record(f"r{i}", f"openai {i}")).encode() + b"\n" for i in range(8))
    upload = io.BytesIO(lines)
    upload.name = "input.jsonl"
    resp = c.post("/v1/files", data={"file": upload, "purpose": "batch"}, **auth)
    assert resp.status_code == 200, resp.content
    input_file = resp.json()["id"]
    resp = c.post(
        "/v1/batches",
        data=json.dumps({"input_file_id": input_file, "endpoint": CHAT, "completion_window": "24h"}),
        content_type="application/json",
        **auth,
    )
    assert resp.status_code == 200, resp.content
    openai_id = resp.json()["id"]

    wait_for(lambda: Batch.objects.get(pk=native_id).completed_at, 90, what="the native batch")
    resp = c.get(f"/v1/batches/{native_id}/results", **auth)
    results = json.loads(b"".join(resp.streaming_content) if resp.streaming else resp.content)["results"]
    assert [r["state"] for r in results] == ["completed"] * 12
    assert all(f"native {r['idx']}" in json.dumps(r["response"]) for r in results)

    done = wait_for(
        lambda: (b := c.get(f"/v1/batches/{openai_id}", **auth).json())["status"] == "completed" and b,
        90,
        what="openai",
    )
    resp = c.get(f"/v1/files/{done['output_file_id']}/content", **auth)
    out = [json.loads(line) for line in b"".join(resp.streaming_content).splitlines()]
    assert sorted(o["custom_id"] for o in out) == [f"r{i}" for i in range(8)]
    assert all(f"openai {o['custom_id'][1:]}" in json.dumps(o["response"]["body"]) for o in out)

    # Every payload is an object in the bucket; none is a file or a database row.
    keys = bucket.keys()
    for batch in Batch.objects.all():
        assert f"{batch.id}/input.jsonl" in keys
        refs = Item.objects.filter(batch_id=batch.pk).values_list("input_ref", "result_ref")
        assert all(i.startswith("s3:") and r.startswith("s3:") for i, r in refs)
    assert all(f.ref.startswith("s3:files/") and f.ref[3:] in keys for f in File.objects.all())
    assert File.objects.count() == 2  # the upload and the output file
    assert not any((tmp_path / "web").glob("**/*.jsonl")) and not any((tmp_path / "unused").glob("**/*"))
