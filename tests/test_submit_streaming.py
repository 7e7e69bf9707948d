"""A native batch whose `shape` comes before `requests` is stored while its body is read:
the items' COPY runs while the parse goes on, in one transaction that commits only after the whole
body is parsed and checked. Keys after `requests` that change the picture replay the usual path.

Real PostgreSQL: the COPY is seen from a second connection while the body is still being read."""

import io
import json
from pathlib import Path

import psycopg2
import pytest
from django.conf import settings
from django.db import connection
from django.test import Client, override_settings

from batches import intake
from batches.models import Batch, Item
from batches.surfaces.native import submit
from core import auth
from tests.workers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}


def _payload_dirs() -> set:
    root = Path(settings.RELAY_BATCH_PAYLOAD_DIR)
    return set(root.iterdir()) if root.exists() else set()


def _post(catalog, body: bytes):
    client = Client(raise_request_exception=False)
    return client.post(
        "/v1/batches", data=body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {catalog.key}"
    )


class _Watched(io.RawIOBase):
    """The body as a stream that, when its last chunk is read, asks a second connection whether a
    COPY into the items table is under way (its RowExclusiveLock)."""

    def __init__(self, data: bytes, dsn: str):
        self.data, self.pos, self.dsn = data, 0, dsn
        self.seen_at_end: dict | None = None

    def read(self, n=-1):
        if n is None or n < 0:
            n = len(self.data)
        chunk = self.data[self.pos : self.pos + n]
        self.pos += len(chunk)
        if self.pos >= len(self.data) and chunk and self.seen_at_end is None:
            with psycopg2.connect(self.dsn) as other, other.cursor() as cur:
                cur.execute(
                    "SELECT count(*) FROM pg_locks WHERE relation = 'batches_item'::regclass"
                    " AND mode = 'RowExclusiveLock' AND pid <> pg_backend_pid()"
                )
                copying = cur.fetchone()[0]
            other.close()
            self.seen_at_end = {"copying": copying}
        return chunk


def _dsn() -> str:
    params = connection.get_connection_params()
    return " ".join(f"{k}={params[k]}" for k in ("host", "port", "user", "password", "dbname") if params.get(k))


def test_items_are_copied_while_the_body_is_still_being_read(catalog):
    principal = auth.principal_for_key(catalog.key)
    body = json.dumps({"shape": "openai", "requests": [CHAT] * 3000}).encode()
    stream = _Watched(body, _dsn())
    got = intake.receive(stream, principal, on_native=lambda: None)
    assert isinstance(got, Batch) and got.total_items == 3000
    # Before the last byte was read, the COPY of the elements parsed so far held its lock.
    assert stream.seen_at_end == {"copying": 1}
    assert Item.objects.filter(batch=got).count() == 3000
    assert sorted(Item.objects.filter(batch=got).values_list("idx", flat=True)) == list(range(3000))


class _Pausing(io.RawIOBase):
    """The body in 64 KiB reads, with one pause halfway: a client that uploads slowly. It goes on once
    the statement under way (the COPY), seen from a second connection, has run `pause` seconds."""

    def __init__(self, data: bytes, pause: float, dsn: str):
        self.data, self.pos, self.pause, self.dsn = data, 0, pause, dsn

    def _statement_ran(self, other, seconds: float) -> bool:
        with other.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND state = 'active' AND clock_timestamp() - query_start > make_interval(secs => %s)",
                [seconds],
            )
            return cur.fetchone()[0] > 0

    def read(self, n=-1):
        if n == 0:  # ijson's probe for bytes or text
            return b""
        if self.pause and self.pos >= len(self.data) // 2:
            other = psycopg2.connect(self.dsn)
            other.autocommit = True
            try:
                wait_for(lambda: self._statement_ran(other, self.pause), 30, interval=0.05, what="the pause")
            finally:
                other.close()
            self.pause = 0
        chunk = self.data[self.pos : self.pos + min(n if n > 0 else 65536, 65536)]
        self.pos += len(chunk)
        return chunk


def test_a_slow_upload_is_not_cut_by_the_database_statement_timeout(catalog):
    # The COPY runs while the body arrives; the edge bounds that, not RELAY_DB_STATEMENT_TIMEOUT_MS.
    principal = auth.principal_for_key(catalog.key)
    body = json.dumps({"shape": "openai", "requests": [CHAT] * 3000}).encode()
    with connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = 200")
    try:
        got = intake.receive(_Pausing(body, pause=0.6, dsn=_dsn()), principal, on_native=lambda: None)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET statement_timeout")
    assert isinstance(got, Batch) and Item.objects.filter(batch=got).count() == 3000


def test_without_shape_first_the_body_is_spooled_as_before(catalog):
    principal = auth.principal_for_key(catalog.key)
    body = json.dumps({"requests": [CHAT] * 3000, "shape": "openai"}).encode()
    stream = _Watched(body, _dsn())
    got = intake.receive(stream, principal, on_native=lambda: None)
    assert not isinstance(got, Batch)
    with got as submission:
        assert stream.seen_at_end == {"copying": 0}
        batch = submit.store_native(principal, submission)
    assert batch.total_items == 3000 and Item.objects.filter(batch=batch).count() == 3000


def test_a_retry_sent_after_requests_replays_the_usual_path(catalog):
    before = _payload_dirs()
    body = {"shape": "openai", "requests": [CHAT] * 4, "retry": {"max_attempts": 7}}
    resp = _post(catalog, json.dumps(body).encode())
    assert resp.status_code == 202, resp.content
    batch = Batch.objects.get()
    assert batch.total_items == 4 and batch.max_attempts == 7
    assert set(Item.objects.values_list("max_attempts", flat=True)) == {7}
    # The streamed attempt's input directory is gone; the stored batch has its own.
    assert _payload_dirs() - before == {Path(settings.RELAY_BATCH_PAYLOAD_DIR) / str(batch.id)}
    lines = (Path(settings.RELAY_BATCH_PAYLOAD_DIR) / str(batch.id) / "input.jsonl").read_bytes().splitlines()
    assert [json.loads(line) for line in lines] == [CHAT] * 4


def test_an_openai_key_after_requests_is_still_ambiguous_and_stores_nothing(catalog):
    before = _payload_dirs()
    body = {"shape": "openai", "requests": [CHAT] * 4, "endpoint": "/v1/chat/completions"}
    resp = _post(catalog, json.dumps(body).encode())
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "ambiguous_batch_body"
    assert Batch.objects.count() == 0 and Item.objects.count() == 0
    assert _payload_dirs() == before


@pytest.mark.parametrize(
    "tail,status,code_or_text",
    [
        # A bad last element: the elements before it were already copied, and are undone.
        (b',{"model":"gpt-4o","messages":[{"role":"user","content":"a\\u0000b"}]}]}', 400, "invalid_characters"),
        (b",1]}", 400, "must be a JSON object"),
        (b"]", 400, "invalid request body"),  # truncated: the object never closes
        (b'], "note": "x\\u0000"}', 400, "invalid_characters"),  # a bad key after requests
    ],
)
def test_a_bad_end_of_a_streamed_body_stores_nothing(catalog, tail, status, code_or_text):
    before = _payload_dirs()
    head = json.dumps({"shape": "openai", "requests": [CHAT] * 2000})[:-2].encode()  # without "]}"
    resp = _post(catalog, head + tail)
    assert resp.status_code == status, resp.content
    error = resp.json()["error"]
    assert code_or_text in (error.get("code") or "") or code_or_text in error["message"]
    assert Batch.objects.count() == 0 and Item.objects.count() == 0
    assert _payload_dirs() == before


@pytest.mark.parametrize(
    "requests_",
    [[CHAT] * 5, []],  # too many (with RELAY_BATCH_MAX_ITEMS=3), none
)
def test_a_streamed_body_answers_its_own_checks_as_the_spooled_path_does(catalog, requests_):
    before = _payload_dirs()
    with override_settings(RELAY_BATCH_MAX_ITEMS=3):
        streamed = _post(catalog, json.dumps({"shape": "openai", "requests": requests_}).encode())
        spooled = _post(catalog, json.dumps({"requests": requests_, "shape": "openai"}).encode())
    assert streamed.status_code == spooled.status_code == 400
    assert streamed.json() == spooled.json()
    assert "too many items" in streamed.json()["error"]["message"] or "non-empty" in streamed.json()["error"]["message"]
    assert Batch.objects.count() == 0 and Item.objects.count() == 0
    assert _payload_dirs() == before


def test_the_streamed_path_stores_what_the_spooled_path_stores(catalog):
    principal = auth.principal_for_key(catalog.key)
    elements = [CHAT, {"model": "gpt-4o", "messages": [], "temperature": 0.5, "stop": None}, {"x": "é✓\n"}]
    streamed = intake.receive(
        io.BytesIO(json.dumps({"shape": "openai", "requests": elements}).encode()), principal, lambda: None
    )
    spooled = intake.receive(
        io.BytesIO(json.dumps({"requests": elements, "shape": "openai"}).encode()), principal, lambda: None
    )
    with spooled as submission:
        spooled = submit.store_native(principal, submission)

    def stored(batch):
        root = Path(settings.RELAY_BATCH_PAYLOAD_DIR) / str(batch.id)
        refs = list(Item.objects.filter(batch=batch).order_by("idx").values_list("idx", "input_ref", "max_attempts"))
        return (root / "input.jsonl").read_bytes(), [(i, ref.split("#")[1], m) for i, ref, m in refs]

    assert stored(streamed) == stored(spooled)
