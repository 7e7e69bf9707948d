"""The item worker's inputs on the `s3` store read ahead (storage.read_input → storage_s3.read_input,
batches/storage_readahead.py), against moto's server on loopback (tests/test_storage_s3.py starts it):
a miss fetches a window of the batch's input object and the records inside it come from memory, shared
by the threads of a process, within a bounded memory. The GETs are counted by a hook on the process's
boto3 client, so they are the requests sent, whichever server answers them."""

import random
import threading
import uuid

import pytest

from batches import storage, storage_s3
from batches.storage_readahead import ReadAhead
from tests.test_storage_s3 import bucket, s3_endpoint  # noqa: F401 - fixtures

KiB = 1024


@pytest.fixture(autouse=True)
def fresh_read_ahead():
    storage_s3.read_ahead.reset()  # windows left by another test (its threads never said they were done)
    yield
    storage_s3.read_ahead.reset()


@pytest.fixture
def gets(bucket):  # noqa: F811
    """The (key, Range) of every GetObject the process's client sends while the test runs."""
    sent: list[tuple[str, str]] = []

    def count(params, **_):
        sent.append((params["Key"], params.get("Range", "")))

    events = storage_s3._client(storage_s3.config()).meta.events
    events.register("before-parameter-build.s3.GetObject", count)
    yield sent
    events.unregister("before-parameter-build.s3.GetObject", count)


def _batch(datas: list[bytes]) -> tuple[str, list[str]]:
    batch_id = str(uuid.uuid4())
    writer = storage.input_writer(batch_id)
    refs = [writer.add(i, data) for i, data in enumerate(datas)]
    writer.close()
    return batch_id, refs


def _records(n: int, seed: int, low: int = 100, high: int = 2000) -> list[bytes]:
    rng = random.Random(seed)
    return [
        b'{"n": %d, "pad": "%s"}' % (i, rng.randbytes(rng.randrange(low, high) // 2).hex().encode()) for i in range(n)
    ]


def _held(ra: ReadAhead) -> int:
    assert ra.held == sum(len(data) for data, _ in ra.windows.values())
    return ra.held


@pytest.mark.django_db
def test_every_input_of_a_500_record_batch_reads_back_with_far_fewer_gets_than_items(bucket, gets):  # noqa: F811
    datas = _records(500, seed=1)
    batch_id, refs = _batch(datas)
    assert [storage.read_input(ref) for ref in refs] == datas
    total = sum(len(d) + 1 for d in datas)  # ~525 KB: windows of 64, 128, 256 and 512 KiB
    print(f"500 inputs, {total} bytes: {len(gets)} GETs")
    assert {key for key, _ in gets} == {f"relay/{batch_id}/input.jsonl"}
    assert 1 <= len(gets) <= 5, gets
    assert gets[0][1] == f"bytes=0-{storage_s3.READ_AHEAD_FIRST - 1}"  # the object's first window is small
    assert _held(storage_s3.read_ahead) <= storage_s3.READ_AHEAD_MEMORY

    storage.close_inputs()  # this thread was the only reader: the windows go
    assert _held(storage_s3.read_ahead) == 0
    before = len(gets)
    assert storage.read_input(refs[250]) == datas[250] and len(gets) == before + 1  # and a read fetches again


@pytest.mark.django_db
def test_eight_threads_claiming_in_idx_order_read_the_right_bytes_and_share_the_windows(bucket, gets):  # noqa: F811
    datas = {}
    queues = []
    for seed in (2, 3):  # two batches at once, their items claimed alternately
        records = _records(400, seed=seed)
        refs = _batch(records)[1]
        datas.update(zip(refs, records, strict=True))
        queues.append(refs)
    queue = [ref for pair in zip(*queues, strict=True) for ref in pair]
    lock, got, failures = threading.Lock(), {}, []
    start = threading.Barrier(8)

    def slot():
        try:
            start.wait()
            while True:
                with lock:  # a claim: the next item in idx order
                    if not queue:
                        break
                    ref = queue.pop(0)
                data = storage.read_input(ref)
                with lock:
                    got[ref] = data
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
        finally:
            storage.close_inputs()

    threads = [threading.Thread(target=slot) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert failures == [] and got == datas
    print(f"800 inputs of two batches read by 8 threads: {len(gets)} GETs")
    assert len(gets) <= 12, gets  # per object: a window at a time, not one per thread (nor per item)
    assert _held(storage_s3.read_ahead) == 0  # every thread said its drain ended


@pytest.mark.django_db
def test_a_record_larger_than_the_largest_window_is_fetched_alone_and_not_kept(bucket, gets):  # noqa: F811
    big = b'{"big": "%s"}' % (b"z" * (storage_s3.READ_AHEAD_MOST + 10))
    datas = [b'{"a": 1}', big, b'{"c": 3}', b'{"d": 4}']
    _, refs = _batch(datas)
    assert storage.read_input(refs[1]) == big
    offset = len(datas[0]) + 1
    assert gets == [(gets[0][0], f"bytes={offset}-{offset + len(big) - 1}")]  # its own range, as without read-ahead
    assert _held(storage_s3.read_ahead) == 0
    assert [storage.read_input(ref) for ref in refs] == datas
    assert len(gets) == 4  # the first record's window ends inside the big one; after it, one window serves both


@pytest.mark.django_db
def test_the_last_record_reads_from_a_window_cut_at_the_objects_end_and_past_it_is_truncated(bucket, gets):  # noqa: F811
    datas = _records(40, seed=4)
    batch_id, refs = _batch(datas)
    assert storage.read_input(refs[-1]) == datas[-1]  # the window asked past the end: S3 answers what there is
    assert storage.read_input(refs[-1]) == datas[-1] and len(gets) == 1
    size = sum(len(d) + 1 for d in datas)
    with pytest.raises(storage.PayloadMissing, match="truncated"):
        storage.read_input(f"s3:{batch_id}/input.jsonl#{size - 5}:10")  # runs past the end
    with pytest.raises(storage.PayloadMissing, match="truncated"):
        storage.read_input(f"s3:{batch_id}/input.jsonl#{size + 100}:10")  # starts past it (InvalidRange)
    assert [storage.read_input(ref) for ref in refs] == datas


@pytest.mark.django_db
def test_a_deleted_batchs_next_miss_raises_payload_missing(bucket, gets):  # noqa: F811
    datas = _records(300, seed=5)
    batch_id, refs = _batch(datas)
    assert storage.read_input(refs[0]) == datas[0]
    storage.delete_batch(batch_id)  # by this process: its windows go too
    with pytest.raises(storage.PayloadMissing, match="not found"):
        storage.read_input(refs[1])

    batch_id, refs = _batch(datas)
    assert storage.read_input(refs[0]) == datas[0]
    held = len(storage_s3.read_ahead.windows)
    bucket.client.delete_object(Bucket=bucket.name, Key=f"relay/{batch_id}/input.jsonl")  # by another host
    assert storage.read_input(refs[1]) == datas[1]  # inside a window held: inputs never change, so still right
    far = next(
        i for i, ref in enumerate(refs) if int(ref.rpartition("#")[2].split(":")[0]) > storage_s3.READ_AHEAD_FIRST
    )
    with pytest.raises(storage.PayloadMissing, match="not found"):
        storage.read_input(refs[far])  # the next miss asks the store, as without read-ahead
    assert len(storage_s3.read_ahead.windows) == held and storage_s3.read_ahead.flights == {}


@pytest.mark.django_db
def test_the_windows_held_stay_within_the_memory_bound(bucket, gets, monkeypatch):  # noqa: F811
    small = ReadAhead(first=4 * KiB, most=16 * KiB, budget=48 * KiB)
    monkeypatch.setattr(storage_s3, "read_ahead", small)
    batches = []
    for i in range(6):  # ~160 KB each
        datas = _records(150, seed=10 + i)
        batches.append((_batch(datas)[1], datas))
    rng = random.Random(6)
    cursors = [0] * 6
    peak = 0
    while any(c < 150 for c in cursors):  # read through all six, hopping between them as fair claims do
        b = rng.choice([i for i, c in enumerate(cursors) if c < 150])
        refs, datas = batches[b]
        assert storage.read_input(refs[cursors[b]]) == datas[cursors[b]]
        cursors[b] += 1
        peak = max(peak, _held(small))
    assert 16 * KiB < peak <= 48 * KiB
    assert max(len(data) for data, _ in small.windows.values()) <= 16 * KiB
    print(f"6 batches, 900 inputs, budget 48 KiB: {len(gets)} GETs, peak {peak} bytes held")
    assert len(gets) < 900 // 3  # windows shrink back under pressure (evicted: the next is `first` again)

    monkeypatch.undo()  # the process's own: through a ~6 MB batch, never more than READ_AHEAD_MEMORY held
    datas = _records(4000, seed=7, low=1000, high=2000)
    _, refs = _batch(datas)
    for ref, data in zip(refs, datas, strict=True):
        assert storage.read_input(ref) == data
        assert _held(storage_s3.read_ahead) <= storage_s3.READ_AHEAD_MEMORY
    assert max(len(data) for data, _ in storage_s3.read_ahead.windows.values()) == storage_s3.READ_AHEAD_MOST
    assert len(storage_s3.read_ahead.windows) < storage_s3.READ_AHEAD_MEMORY // storage_s3.READ_AHEAD_MOST + 4
