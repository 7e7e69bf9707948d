"""The fast paths of batch submit: jsonguard.encode answers exactly as check() does, the
UUIDv7s of new items are well formed, and the streamed COPY of new items keeps the caller's error."""

import math
import os
import time
import uuid

import pytest
from django.db import transaction
from django.test import override_settings

from batches import bulk, storage
from batches.models import Item
from core import jsonguard

DEEP_OK = {
    "a": [
        [
            [
                [
                    [
                        [
                            [
                                [
                                    [
                                        [
                                            [
                                                [
                                                    [
                                                        [
                                                            [
                                                                [
                                                                    [
                                                                        [
                                                                            [
                                                                                [
                                                                                    [
                                                                                        [
                                                                                            [
                                                                                                [
                                                                                                    [
                                                                                                        [
                                                                                                            [
                                                                                                                [
                                                                                                                    [
                                                                                                                        [
                                                                                                                            [
                                                                                                                                [
                                                                                                                                    [
                                                                                                                                        [
                                                                                                                                            [
                                                                                                                                                [
                                                                                                                                                    [
                                                                                                                                                        [
                                                                                                                                                            [
                                                                                                                                                                [
                                                                                                                                                                    [
                                                                                                                                                                        [
                                                                                                                                                                            [
                                                                                                                                                                                [
                                                                                                                                                                                    [
                                                                                                                                                                                        [
                                                                                                                                                                                            [
                                                                                                                                                                                                [
                                                                                                                                                                                                    [
                                                                                                                                                                                                        [
                                                                                                                                                                                                            [
                                                                                                                                                                                                                [
                                                                                                                                                                                                                    [
                                                                                                                                                                                                                        [
                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                                            1
                                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                ]
                                                                                                                                                                                                            ]
                                                                                                                                                                                                        ]
                                                                                                                                                                                                    ]
                                                                                                                                                                                                ]
                                                                                                                                                                                            ]
                                                                                                                                                                                        ]
                                                                                                                                                                                    ]
                                                                                                                                                                                ]
                                                                                                                                                                            ]
                                                                                                                                                                        ]
                                                                                                                                                                    ]
                                                                                                                                                                ]
                                                                                                                                                            ]
                                                                                                                                                        ]
                                                                                                                                                    ]
                                                                                                                                                ]
                                                                                                                                            ]
                                                                                                                                        ]
                                                                                                                                    ]
                                                                                                                                ]
                                                                                                                            ]
                                                                                                                        ]
                                                                                                                    ]
                                                                                                                ]
                                                                                                            ]
                                                                                                        ]
                                                                                                    ]
                                                                                                ]
                                                                                            ]
                                                                                        ]
                                                                                    ]
                                                                                ]
                                                                            ]
                                                                        ]
                                                                    ]
                                                                ]
                                                            ]
                                                        ]
                                                    ]
                                                ]
                                            ]
                                        ]
                                    ]
                                ]
                            ]
                        ]
                    ]
                ]
            ]
        ]
    ]
}


def _nested(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


VALUES = [
    {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.2},
    {"text": "a\x00b"},
    {"k\x00": 1},
    {"text": "the six characters \\u0000 are not a NUL"},
    {"text": "\ud800"},
    {"k\udfff": 1},
    {"x": float("inf")},
    {"x": [1, -math.inf]},
    {"x": float("nan")},
    {"text": "{[" * 200},  # many brackets inside a string: not nesting
    _nested(63),
    _nested(64),
    _nested(65),
    _nested(3000),  # deeper than json.dumps can recurse
    DEEP_OK,
    {"big": 10**40, "neg": -0.0, "unicode": "héllo ✓ \U0001f600", "ctl": "\t\n\x01"},
    # orjson, the fast path, writes a non-finite float as null: a real null beside one must not hide it.
    {"stop": None, "x": float("inf")},
    {"stop": None, "temperature": 0.2, "n": 2**63 - 1, "f": [1e16, 1e-7, -1.5e300]},
    {"text": "null", "x": -math.inf},
    {"k": 2**64},  # past orjson's integers: the careful path
]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_encode_answers_exactly_as_check(value):
    try:
        jsonguard.check(value, "requests[7]")
        expected = None
    except jsonguard.JSONGuardError as exc:
        expected = (exc.code, exc.path, exc.message)
    try:
        data = jsonguard.encode(value, "requests[7]")
    except jsonguard.JSONGuardError as exc:
        assert (exc.code, exc.path, exc.message) == expected
    else:
        assert expected is None
        assert b"\n" not in data
        assert jsonguard.loads(data) == value


def test_new_item_ids_are_uuid7_of_now_and_distinct():
    ids = bulk._uuid7_strs(5000)
    assert len(set(ids)) == 5000
    now_ms = time.time_ns() // 1_000_000
    for text in ids[:200]:
        value = uuid.UUID(text)
        assert str(value) == text
        assert value.version == 7
        assert value.variant == uuid.RFC_4122
        assert abs((value.int >> 80) - now_ms) < 5000


@pytest.mark.django_db
def test_copy_new_items_writes_rows_and_escapes_text():
    batch_id = uuid.uuid4()
    rows = [(0, "file:b/input.jsonl#0:10", ""), (1, "db:b/in/1", "tab\there"), (2, "file:x\\y", "new\nline")]
    with transaction.atomic():
        assert bulk.copy_new_items(batch_id, iter(rows), max_attempts=7) == 3
        got = list(
            Item.objects.filter(batch_id=batch_id)
            .order_by("idx")
            .values_list("idx", "state", "input_ref", "custom_id", "max_attempts", "attempt", "finished_at")
        )
        transaction.set_rollback(True)  # the batch row was never made
    assert got == [
        (0, "available", "file:b/input.jsonl#0:10", "", 7, 0, None),
        (1, "available", "db:b/in/1", "tab\there", 7, 0, None),
        (2, "available", "file:x\\y", "new\nline", 7, 0, None),
    ]


@pytest.mark.django_db
@pytest.mark.parametrize("stream", [True, False])
def test_an_error_raised_by_the_rows_comes_out_as_itself(stream):
    batch_id = uuid.uuid4()

    class Refused(Exception):
        pass

    def rows():
        yield 0, "file:a", ""
        yield 1, "file:b", ""
        raise Refused("requests.2.custom_id: Duplicate custom_id")

    with pytest.raises(Refused, match="Duplicate"), transaction.atomic():
        bulk.copy_new_items(batch_id, rows(), max_attempts=3, stream=stream)
    assert not Item.objects.filter(batch_id=batch_id).exists()


def test_jsonl_chunks_are_the_elements_as_lines():
    import io
    import json

    from batches import ingest

    body = {"shape": "openai", "requests": [{"n": i, "text": "line\nbreak " * (i % 50)} for i in range(3000)]}
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**8, 50_000) as sub:
        lines = b"".join(e + b"\n" for e in sub.elements())
        assert b"".join(sub.jsonl_chunks(size=4096)) == lines
        assert [json.loads(x) for x in lines.splitlines()] == body["requests"]


@pytest.mark.django_db
def test_read_many_answers_as_read_does_ref_by_ref(tmp_path):
    from django.test import override_settings

    from batches import storage
    from batches.models import Payload

    with override_settings(RELAY_BATCH_PAYLOAD_DIR=str(tmp_path)):
        ok = storage.write_result("b1", "i1", b'{"a": 1}')
        big = storage.write_result("b1", "i2", b"x" * (3 << 20))
        writer = storage.input_writer("b2")
        span = writer.add(0, b'{"in": 0}')
        writer.close()
        Payload.objects.create(key="b3/out/i1", data=b'{"db": true}')
        refs = [ok, "file:b1/results/missing.json", big, span, "db:b3/out/i1", "db:b3/out/nope", "weird:x", ok]
        got = storage.read_many(refs)
        for ref, value in zip(refs, got, strict=True):
            try:
                expected = storage.read(ref)
            except storage.PayloadMissing as exc:
                assert isinstance(value, storage.PayloadMissing), ref
                assert str(value) == str(exc)
            else:
                assert value == expected, ref


@pytest.mark.django_db
def test_results_are_byte_ranges_of_one_file_per_batch_and_process(tmp_path):
    """write_result appends (no file per result: its inode allocation was a quarter of an item's CPU);
    each ref reads back its own bytes, through read() and read_many(), after a deleted batch too."""
    from django.test import override_settings

    from batches import storage

    with override_settings(RELAY_BATCH_PAYLOAD_DIR=str(tmp_path)):
        a1 = storage.write_result("ba", "i1", b'{"n": 1}')
        b1 = storage.write_result("bb", "i1", b'{"other": "batch"}')
        a2 = storage.write_result("ba", "i2", b'{"n": 2, "text": "line\\nbreak"}')
        assert a1.partition("#")[0] == a2.partition("#")[0] != b1.partition("#")[0]
        assert [p.name for p in (tmp_path / "ba" / "results").iterdir()] == [a1.partition("#")[0].rsplit("/")[-1]]
        assert storage.read(a1) == b'{"n": 1}' and storage.read(a2) == b'{"n": 2, "text": "line\\nbreak"}'
        assert storage.read_many([a2, b1, a1, a2]) == [
            storage.read(a2),
            b'{"other": "batch"}',
            b'{"n": 1}',
            storage.read(a2),
        ]

        # The batch deleted while this process holds its file open: the next result goes to a new file.
        storage.delete_batch("ba")
        assert isinstance(storage.read_many([a1])[0], storage.PayloadMissing)
        a3 = storage.write_result("ba", "i3", b'{"n": 3}')
        assert storage.read(a3) == b'{"n": 3}' and a3.endswith("#0:8")

        # Another process (a forked child) never appends to this one's file.
        storage._segments.pid = -1
        b2 = storage.write_result("bb", "i2", b'{"n": "child"}')
        assert b2.partition("#")[0] != b1.partition("#")[0] and b2.endswith("#0:14")
        assert storage.read_many([b1, b2]) == [b'{"other": "batch"}', b'{"n": "child"}']

        # A truncated file: the range past its end is reported, the ranges before it still read.
        c = storage.write_result("bb", "i3", b"x" * 100)
        path = tmp_path / "bb" / "results" / c.partition("#")[0].rsplit("/")[-1]
        os.truncate(path, path.stat().st_size - 50)
        got = storage.read_many([b2, c])
        assert got[0] == b'{"n": "child"}' and isinstance(got[1], storage.PayloadMissing)
        assert "truncated" in str(got[1])


@pytest.mark.django_db
@override_settings(RELAY_BATCH_PAYLOAD_STORE="db")
def test_a_fenced_out_claim_never_replaces_the_result_stored_by_the_rescuer():
    """Found by the multi-host drill: a host cut off mid-call reaches write_result after another host
    rescued the item and stored its result; the late write must land beside it, not over it."""
    rescuer = storage.write_result("b9", "i9", b'{"by": "rescuer"}')
    late = storage.write_result("b9", "i9", b'{"by": "cut-off host"}')
    assert rescuer != late
    assert storage.read(rescuer) == b'{"by": "rescuer"}'
