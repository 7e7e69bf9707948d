"""Results written in groups on the `s3` store (storage.result_group): one object per group, each result a
byte range of it, against moto's server on loopback (tests/test_storage_s3.py starts it). A provider job's
chunk and the item worker's bookkeeper round each PUT one object; every result reads back byte for byte,
alone or with read_many across groups; a group that could not be stored finishes no item; a fenced-out
claim's result never replaces the rescuer's."""

import json
import random
import threading
import uuid

import pytest
from django.db.models import F

from batches import storage
from batches.lifecycle import claim as claims
from batches.models import Batch, Item
from batches.provider import results as provider_results
from batches.surfaces.openai import finalize
from batches.worker import bookkeeper as keeper
from batches.worker.execute import run_item
from core.models import HostBinding
from devkit.upstream import Reply
from tests.test_provider_batches import chat, drive, openai_batch, output_lines
from tests.test_storage_s3 import _native, bucket, s3_endpoint, s3_workers  # noqa: F401 - fixtures
from tests.workers import wait_for

runs_items = pytest.mark.django_db(transaction=True)  # the bookkeeper thread commits on its own connection


def _result_objects(store, batch_id) -> list[str]:
    return [k for k in store.keys(f"{batch_id}/") if "/results/" in k]


@pytest.mark.django_db
def test_a_group_is_one_object_and_each_result_reads_back_byte_for_byte(bucket):  # noqa: F811
    rng = random.Random(29)
    batch_id = str(uuid.uuid4())
    # Any bytes: newlines inside a result, empty results, binary, one past the coalescing gap.
    datas = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300))) for _ in range(120)]
    datas[5], datas[6], datas[7] = b"", b'{"a":\n1}\n', b"x" * (100 * 1024)
    refs = []
    for part in (datas[:60], datas[60:]):
        with storage.result_group(batch_id) as group:
            refs += [group.add(f"item-{i}", data) for i, data in enumerate(part)]
    single = storage.write_result(batch_id, "item-0", b'{"retry": true}')
    with storage.result_group(batch_id):
        pass  # a group with no result writes nothing
    assert len(_result_objects(bucket, batch_id)) == 3  # two groups and the single write
    assert len({ref.partition("#")[0] for ref in refs}) == 2
    assert all(storage.read(ref) == data for ref, data in zip(refs, datas, strict=True))

    order = list(range(len(refs)))
    rng.shuffle(order)
    writer = storage.input_writer(batch_id)
    span = writer.add(0, b'{"in": 0}')
    writer.close()
    asked = [refs[i] for i in order] + [single, span, f"s3:{batch_id}/results/none.jsonl#0:3"]
    got = storage.read_many(asked)
    assert got[: len(order)] == [datas[i] for i in order]
    assert got[-3:-1] == [b'{"retry": true}', b'{"in": 0}'] and isinstance(got[-1], storage.PayloadMissing)

    storage.delete_batch(batch_id)  # grouped objects live under the batch's prefix and go with it
    assert bucket.keys() == []


@pytest.mark.django_db
def test_a_group_whose_put_fails_raises_and_leaves_no_object(bucket):  # noqa: F811
    group = storage.result_group("b1")
    refs = [group.add(f"i{i}", b"{}") for i in range(3)]
    bucket.client.delete_bucket(Bucket=bucket.name)  # the store loses the bucket before the PUT
    with pytest.raises(storage.PayloadStoreUnavailable, match="NoSuchBucket"):
        group.close()
    bucket.client.create_bucket(Bucket=bucket.name)
    assert bucket.keys() == [] and bucket.uploads() == []
    assert all(isinstance(got, storage.PayloadMissing) for got in storage.read_many(refs))


@runs_items
def test_a_provider_jobs_results_are_one_object_per_chunk(bucket, catalog, fake, settings, monkeypatch):  # noqa: F811
    settings.RELAY_PROVIDER_POLL_SECONDS = settings.RELAY_PROVIDER_POLL_MAX_SECONDS = 0
    monkeypatch.setattr(provider_results, "CHUNK", 10)
    fake.batches.job_seconds = 0.1
    HostBinding.objects.update(batch_mode="provider")
    batch = openai_batch(catalog, [chat(f"r{i}", f"question {i}") for i in range(25)])
    drive(batch)
    items = list(Item.objects.filter(batch=batch).order_by("idx"))
    assert [i.state for i in items] == ["completed"] * 25
    assert len(_result_objects(bucket, batch.id)) == 3  # chunks of 10, 10 and 5
    bodies = storage.read_many([i.result_ref for i in items])
    assert [storage.read(i.result_ref) for i in items] == bodies
    answers = [json.loads(b)["choices"][0]["message"]["content"] for b in bodies]
    assert all(f"question {i}" in answer for i, answer in enumerate(answers))

    finalize.finalize(batch.id)  # the output file, its results read a page at a time (read_many)
    out = output_lines(batch)
    assert [json.loads(bodies[i]) == out[f"r{i}"]["response"]["body"] for i in range(25)] == [True] * 25


def _gated():
    """The bookkeeper held busy until the gate opens: what is handed over meanwhile waits in its queue."""
    gate = threading.Event()
    keeper.bookkeeper().submit(lambda: gate.wait(30))
    return gate


def _run_claimed(n: int, owner: str = "t") -> list:
    futures = []
    for _ in range(n):
        item = claims.claim(owner)
        futures.append(run_item(item, check_done=False, hand_over=keeper.bookkeeper().submit))
    return futures


@runs_items
def test_the_bookkeeper_stores_the_results_it_has_in_hand_as_one_object(bucket, catalog, fake):  # noqa: F811
    batch = _native(catalog, 12)
    gate = _gated()
    futures = _run_claimed(12)
    gate.set()
    for future in futures:
        future.result(timeout=60)
    items = list(Item.objects.filter(batch=batch).order_by("idx"))
    assert [i.state for i in items] == ["completed"] * 12
    assert len(_result_objects(bucket, batch.id)) == 1  # twelve results, one PUT
    bodies = storage.read_many([i.result_ref for i in items])
    assert [storage.read(i.result_ref) for i in items] == bodies
    assert all(f"hi {i}" in json.loads(b)["choices"][0]["message"]["content"] for i, b in enumerate(bodies))


@runs_items
def test_a_group_that_could_not_be_stored_finishes_no_item(bucket, catalog, fake, settings):  # noqa: F811
    batch = _native(catalog, 4)
    gate = _gated()
    futures = _run_claimed(4)  # the upstream answered each; their writes wait in the bookkeeper's queue
    settings.RELAY_S3_BUCKET = "relay-test-gone-bucket"  # the store refuses the group's PUT
    gate.set()
    for future in futures:
        with pytest.raises(storage.PayloadStoreUnavailable):
            future.result(timeout=60)
    items = Item.objects.filter(batch=batch)
    assert {(i.state, i.result_ref) for i in items} == {("running", "")}  # the sweeper rescues them later
    settings.RELAY_S3_BUCKET = bucket.name
    assert _result_objects(bucket, batch.id) == []


@runs_items
def test_a_fenced_out_claims_result_never_replaces_the_rescuers(bucket, catalog, fake):  # noqa: F811
    batch = _native(catalog, 1)
    zombie = claims.claim("cut-off-host")
    # Its lease ran out and another host took the item (the rescue, then that host's claim).
    Item.objects.filter(pk=zombie.pk).update(lease_owner="rescuer", attempt=F("attempt") + 1)
    rescuer = Item.objects.get(pk=zombie.pk)
    fake.answer_when("", Reply(body={"by": "rescuer"}), times=1)
    fake.answer_when("", Reply(body={"by": "cut-off host"}), times=1)
    gate = _gated()
    first = run_item(rescuer, check_done=False, hand_over=keeper.bookkeeper().submit)
    late = run_item(zombie, check_done=False, hand_over=keeper.bookkeeper().submit)
    gate.set()
    first.result(timeout=60)
    assert late.result(timeout=60) is False  # its finish is refused by the fence …
    item = Item.objects.get(pk=zombie.pk)
    assert item.state == "completed" and item.lease_owner == "rescuer"
    assert json.loads(storage.read(item.result_ref)) == {"by": "rescuer"}  # … and its result replaced nothing
    assert len(_result_objects(bucket, batch.id)) == 1  # both in the round's one group, side by side


@pytest.mark.django_db(transaction=True)
def test_a_drain_by_a_real_worker_puts_far_fewer_objects_than_results(bucket, catalog, fake, s3_workers):  # noqa: F811
    s3_workers("groups")
    batch = _native(catalog, 200)
    wait_for(lambda: Batch.objects.get(pk=batch.pk).completed_at, 120, what="the drain")
    items = list(Item.objects.filter(batch=batch).order_by("idx"))
    assert [i.state for i in items] == ["completed"] * 200
    objects = _result_objects(bucket, batch.id)
    print(f"200 results in {len(objects)} objects")
    assert len(objects) * 2 <= 200, objects
    bodies = storage.read_many([i.result_ref for i in items])
    assert all(f"hi {i}" in json.loads(b)["choices"][0]["message"]["content"] for i, b in enumerate(bodies))


# --- a native body stored while it is read, on the s3 store (submit.can_stream_native) -------------------


@pytest.mark.django_db
def test_a_native_body_streams_into_the_bucket_and_a_replay_leaves_one_input_object(bucket, catalog, monkeypatch):  # noqa: F811
    from django.test import Client

    from batches.surfaces.native import submit

    streamed = []
    real = submit.store_native_streaming
    monkeypatch.setattr(submit, "store_native_streaming", lambda *a, **k: streamed.append(1) or real(*a, **k))
    auth = {"HTTP_AUTHORIZATION": f"Bearer {catalog.key}"}
    requests = [chat(str(i), f"streamed {i}")["body"] for i in range(5)]
    for body in (
        {"shape": "openai", "requests": requests},
        {"shape": "openai", "requests": requests, "retry": {"max_attempts": 2}},  # after `requests`: a replay
    ):
        resp = Client().post("/v1/batches", data=json.dumps(body), content_type="application/json", **auth)
        assert resp.status_code == 202, resp.content
        batch_id = resp.json()["id"]
        items = list(Item.objects.filter(batch_id=batch_id).order_by("idx"))
        assert [json.loads(storage.read_input(i.input_ref))["messages"][0]["content"] for i in items] == [
            f"streamed {i}" for i in range(5)
        ]
        assert bucket.keys(f"{Batch.objects.get(pk=batch_id).pk}/") == [f"{batch_id}/input.jsonl"]
    storage.close_inputs()
    assert len(streamed) == 2 and bucket.uploads() == []
    assert Item.objects.filter(batch_id=batch_id).first().max_attempts == 2
    assert len([k for k in bucket.keys() if k.endswith("input.jsonl")]) == 2  # the replayed copy is gone
