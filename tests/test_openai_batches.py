"""The OpenAI-compatible Batch API end to end: the official `openai` SDK, unchanged, against the live
server; a real Celery worker process (validation, items, finalization, the sweeper); real PostgreSQL
and Redis; the fake upstream."""

import json
import threading

import openai
import pytest
import requests
from django.test import override_settings

from batches.models import Batch, File, Item
from core.services import create_relay_key
from devkit.upstream import Reply
from policies.models import Policy
from tests.workers import broker_idle, wait_for
from usage.models import UsageEvent

pytestmark = pytest.mark.django_db(transaction=True)
# Requests refused before anything is stored need no worker and no live server:
# Django's test client, inside the test's transaction, is enough (and much faster).
in_process = pytest.mark.django_db

TERMINAL = {"completed", "failed", "expired", "cancelled"}


@pytest.fixture
def client(live_server, catalog, worker):
    assert worker.alive(), worker.output()
    # Closed at the end: an idle keep-alive connection would hold a live-server thread and its DB session.
    with openai.OpenAI(base_url=live_server.url + "/v1", api_key=catalog.key) as sdk:
        yield sdk


def chat(custom_id, content="hello", **body):
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": content}], **body},
    }


def jsonl(records) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def wait_status(client, batch_id, statuses=TERMINAL, timeout=30.0):
    def reached():
        b = client.batches.retrieve(batch_id)
        return b if b.status in statuses else None

    return wait_for(reached, timeout, interval=0.2, what=f"batch {batch_id} to reach {statuses}")


def by_custom_id(client, file_id) -> dict:
    if file_id is None:
        return {}
    return {line["custom_id"]: line for line in map(json.loads, client.files.content(file_id).text.splitlines())}


def call(body, key=None, **headers):
    """POST /v1/batches through Django's test client."""
    from django.test import Client

    extra = {f"HTTP_{name.upper().replace('-', '_')}": value for name, value in headers.items()}
    if key:
        extra["HTTP_AUTHORIZATION"] = f"Bearer {key}"
    return Client().post("/v1/batches", data=json.dumps(body), content_type="application/json", **extra)


def post(live_server, body, key, **headers):
    return requests.post(
        live_server.url + "/v1/batches", json=body, headers={"Authorization": f"Bearer {key}", **headers}, timeout=30
    )


# --- the whole flow through the SDK --------------------------------------------------------------


def test_sdk_upload_create_poll_download_join_list_cancel(client, catalog, fake):
    records = [
        chat("q-1", "first question"),
        chat("q-2", "second question"),
        dict(chat("q-3"), body={"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
        chat("q-4", stream=True),
    ]
    uploaded = client.files.create(file=("questions.jsonl", jsonl(records)), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.bytes == len(jsonl(records)) and uploaded.purpose == "batch"

    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": "e2e"},
    )
    assert batch.id.startswith("batch_") and batch.object == "batch" and batch.status == "validating"
    assert batch.input_file_id == uploaded.id and batch.metadata == {"run": "e2e"}
    assert batch.expires_at == batch.created_at + 24 * 3600
    assert batch.request_counts.total == 0

    done = wait_status(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 4 and done.request_counts.completed == 2 and done.request_counts.failed == 2
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.model == "gpt-4o" and done.errors is None

    # Join results back to inputs by custom_id, across the two files: every record exactly once.
    output, errors = by_custom_id(client, done.output_file_id), by_custom_id(client, done.error_file_id)
    assert set(output) == {"q-1", "q-2"} and set(errors) == {"q-3", "q-4"}
    for rec in records[:2]:
        line = output[rec["custom_id"]]
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        content = line["response"]["body"]["choices"][0]["message"]["content"]
        assert rec["body"]["messages"][0]["content"] in content
    assert errors["q-3"]["response"] is None and errors["q-3"]["error"]["code"] == "model_not_found"
    assert errors["q-4"]["error"]["code"] == "streaming_unsupported"
    out_file = client.files.retrieve(done.output_file_id)
    assert out_file.purpose == "batch_output" and out_file.filename == f"{done.id}_output.jsonl"

    # Usage: rolled up from the items' usage events, at the batch discount (50 % by default).
    usage = done.to_dict()["usage"]
    events = UsageEvent.objects.filter(batch_id=str(Batch.objects.get().id))
    assert events.count() == 4
    priced = [e for e in events if e.cost_nano_usd]
    assert len(priced) == 2
    assert usage["cost_nano_usd"] == sum(e.cost_nano_usd * 50 // 100 for e in priced) > 0
    assert usage["input_tokens"] == sum(e.input_tokens for e in events) and usage["output_tokens"] > 0

    # Two more batches from the same file, then page through the list, newest first.
    more = [
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        for _ in range(2)
    ]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == [more[1].id, more[0].id] and page.has_more is True
    assert page.to_dict()["first_id"] == more[1].id and page.to_dict()["last_id"] == more[0].id
    nxt = page.get_next_page()
    assert [b.id for b in nxt.data] == [batch.id] and nxt.has_more is False
    assert [b.id for b in client.batches.list(limit=1)] == [more[1].id, more[0].id, batch.id]  # auto-paging
    for b in more:
        wait_status(client, b.id)

    # Cancel a batch whose records are held by the upstream: cancelling, then cancelled.
    gate = threading.Event()
    fake.script("upstream-openai-0", [Reply(gate=gate) for _ in range(3)])
    try:
        held = client.files.create(file=("held.jsonl", jsonl([chat(f"h-{i}") for i in range(3)])), purpose="batch")
        running = client.batches.create(input_file_id=held.id, endpoint="/v1/chat/completions", completion_window="24h")
        pk = Batch.objects.get(input_file_id=held.id[5:]).pk
        wait_for(lambda: Item.objects.filter(batch_id=pk, state="running").count() == 3, 20, what="3 running")
        cancelling = client.batches.cancel(running.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
        cancelled = wait_status(client, running.id, timeout=15)
    finally:
        gate.set()
    assert cancelled.status == "cancelled" and cancelled.cancelled_at >= cancelled.cancelling_at
    assert cancelled.output_file_id is None and cancelled.request_counts.failed == 3
    assert {line["error"]["code"] for line in by_custom_id(client, cancelled.error_file_id).values()} == {
        "batch_cancelled"
    }
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.cancel(batch.id)  # already completed
    assert exc.value.code == "batch_not_cancellable"


def test_embeddings_and_completions_endpoints(live_server, client, catalog, fake):
    emb = post(
        live_server,
        {
            "endpoint": "/v1/embeddings",
            "completion_window": "24h",
            "requests": [
                {
                    "custom_id": f"e{i}",
                    "method": "POST",
                    "url": "/v1/embeddings",
                    "body": {"model": "gpt-4o", "input": f"text {i}"},
                }
                for i in range(3)
            ],
        },
        catalog.key,
    )
    cmpl = post(
        live_server,
        {
            "endpoint": "/v1/completions",
            "completion_window": "24h",
            "model": "gpt-4o",
            "requests": [
                {
                    "custom_id": "c0",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"model": "gpt-4o", "prompt": "Say hi"},
                }
            ],
        },
        catalog.key,
    )
    assert emb.status_code == 200 and cmpl.status_code == 200, (emb.text, cmpl.text)
    assert cmpl.json()["model"] == "gpt-4o"  # the display hint, shown at once
    emb_done, cmpl_done = wait_status(client, emb.json()["id"]), wait_status(client, cmpl.json()["id"])
    assert emb_done.status == cmpl_done.status == "completed"
    assert emb_done.input_file_id and client.files.retrieve(emb_done.input_file_id).purpose == "batch"
    emb_out = by_custom_id(client, emb_done.output_file_id)
    assert set(emb_out) == {"e0", "e1", "e2"}
    assert emb_out["e1"]["response"]["body"]["object"] == "list"
    assert emb_out["e1"]["response"]["body"]["data"][0]["object"] == "embedding"
    cmpl_out = by_custom_id(client, cmpl_done.output_file_id)
    assert cmpl_out["c0"]["response"]["body"]["object"] == "text_completion"
    assert sorted(r["path"] for r in fake.received) == ["/v1/completions"] + ["/v1/embeddings"] * 3


def test_expiry_with_a_short_window(live_server, client, catalog, fake):
    gate = threading.Event()
    fake.script("upstream-openai-0", [Reply(), Reply(gate=gate), Reply(gate=gate)])
    try:
        with override_settings(RELAY_BATCH_COMPLETION_WINDOW_SECONDS=3):
            resp = post(
                live_server,
                {
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                    "requests": [chat(f"x{i}") for i in range(3)],
                },
                catalog.key,
            )
        created = resp.json()
        assert created["expires_at"] - created["created_at"] in (2, 3, 4)
        expired = wait_status(client, created["id"], timeout=20)
    finally:
        gate.set()
    assert expired.status == "expired" and expired.expired_at and expired.completed_at is None
    assert expired.request_counts.completed == 1 and expired.request_counts.failed == 2
    assert len(by_custom_id(client, expired.output_file_id)) == 1  # what finished is still delivered
    errors = by_custom_id(client, expired.error_file_id).values()
    assert [line["error"]["code"] for line in errors] == ["batch_expired", "batch_expired"]


def test_validation_failure_reports_line_numbers(client):
    lines = [chat("a"), chat("a"), {"custom_id": "b", "method": "GET", "url": "/v1/chat/completions", "body": {}}]
    uploaded = client.files.create(file=("bad.jsonl", jsonl(lines) + b"not json\n"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_status(client, batch.id)
    assert failed.status == "failed" and failed.failed_at and failed.errors.object == "list"
    assert [(e.line, e.code, e.param) for e in failed.errors.data] == [
        (2, "duplicate_custom_id", "custom_id"),
        (3, "invalid_method", "method"),
        (4, "invalid_json_line", None),
    ]
    assert failed.output_file_id is None and failed.error_file_id is None and failed.request_counts.total == 0


def test_every_record_failing_completes_with_only_an_error_file(client):
    uploaded = client.files.create(
        file=("s.jsonl", jsonl([chat("a", stream=True), chat("b", stream=True)])), purpose="batch"
    )
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_status(client, batch.id)
    assert done.status == "completed" and done.output_file_id is None and done.error_file_id
    assert set(by_custom_id(client, done.error_file_id)) == {"a", "b"}
    assert done.request_counts.failed == 2


# --- create: idempotency, errors, access -------------------------------------------------------


def test_idempotency_key_returns_the_first_batch(client, live_server, catalog):
    uploaded = client.files.create(file=("i.jsonl", jsonl([chat("a")])), purpose="batch")
    args = {"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    first = client.batches.create(**args, extra_headers={"Idempotency-Key": "job-42"})
    again = client.batches.create(**args, extra_headers={"Idempotency-Key": "job-42"})
    assert again.id == first.id and Batch.objects.count() == 1
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(**args, metadata={"changed": "yes"}, extra_headers={"Idempotency-Key": "job-42"})
    assert exc.value.code == "idempotency_key_reused" and Batch.objects.count() == 1
    # The key is the owner's: another credential may use the same key for its own batch.
    _, other = create_relay_key(service_account=catalog.sa)
    body = {"endpoint": "/v1/chat/completions", "completion_window": "24h", "requests": [chat("z")]}
    theirs = post(live_server, body, other, **{"Idempotency-Key": "job-42"})
    assert theirs.status_code == 200 and theirs.json()["id"] != first.id
    # Inline requests: the retried body is byte-identical, so nothing new is stored.
    assert post(live_server, body, other, **{"Idempotency-Key": "job-42"}).json()["id"] == theirs.json()["id"]
    assert Batch.objects.count() == 2 and File.objects.filter(purpose="batch").count() == 2
    wait_status(client, first.id)


@pytest.mark.parametrize(
    "body,param,code",
    [
        ({"completion_window": "24h", "requests": [{}]}, "endpoint", "missing_required_parameter"),
        ({"endpoint": "/v1/moderations", "completion_window": "24h", "requests": [{}]}, "endpoint", "invalid_value"),
        (
            {"endpoint": "/v1/embeddings", "completion_window": "1h", "requests": [{}]},
            "completion_window",
            "invalid_value",
        ),
        ({"endpoint": "/v1/embeddings", "requests": [{}]}, "completion_window", "missing_required_parameter"),
        ({"endpoint": "/v1/embeddings", "completion_window": "24h"}, "input_file_id", "missing_required_parameter"),
        (
            {"endpoint": "/v1/embeddings", "completion_window": "24h", "requests": [{}], "input_file_id": "file-x"},
            "input_file_id",
            "invalid_request",
        ),
        (
            {"endpoint": "/v1/embeddings", "completion_window": "24h", "input_file_id": "file-nope"},
            "input_file_id",
            "file_not_found",
        ),
        ({"endpoint": "/v1/embeddings", "completion_window": "24h", "requests": []}, "requests", "invalid_value"),
        (
            {
                "endpoint": "/v1/embeddings",
                "completion_window": "24h",
                "requests": [{}],
                "metadata": {f"k{i}": "v" for i in range(17)},
            },
            "metadata",
            "invalid_value",
        ),
        (
            {"endpoint": "/v1/embeddings", "completion_window": "24h", "requests": [{}], "metadata": {"k": "v" * 513}},
            "metadata.k",
            "invalid_value",
        ),
        (
            {"endpoint": "/v1/embeddings", "completion_window": "24h", "requests": [{}], "extra": 1},
            "extra",
            "unknown_parameter",
        ),
        ({"shape": "openai", "endpoint": "/v1/embeddings", "requests": [{}]}, "shape", "ambiguous_batch_body"),
    ],
)
@in_process
def test_bad_create_is_400_in_openai_shape_and_stores_nothing(catalog, body, param, code):
    resp = call(body, catalog.key)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert Batch.objects.count() == 0 and File.objects.count() == 0


@in_process
def test_too_many_inline_requests_is_400(catalog):
    with override_settings(RELAY_BATCH_MAX_ITEMS=2):
        resp = call({"endpoint": "/v1/embeddings", "completion_window": "24h", "requests": [{}] * 3}, catalog.key)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "too_many_requests"
    assert "3 records, at most 2" in resp.json()["error"]["message"]


@in_process
def test_broker_down_is_503_and_stores_nothing(catalog):
    body = {"endpoint": "/v1/embeddings", "completion_window": "24h", "requests": [chat("a")]}
    with override_settings(CELERY_BROKER_URL="redis://127.0.0.1:1/0"):
        resp = call(body, catalog.key)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "dispatch_unavailable"
    assert resp.headers["Retry-After"] == "2"
    assert Batch.objects.count() == 0 and File.objects.count() == 0


@in_process
def test_batch_access_off_is_404(catalog):
    from django.test import Client

    Policy.objects.filter(pk=catalog.policy.pk).update(batch_enabled=False)
    listing = Client().get("/v1/batches", HTTP_AUTHORIZATION=f"Bearer {catalog.key}")
    assert listing.status_code == 404 and listing.json()["error"]["code"] == "batch_access_disabled"
    body = {"endpoint": "/v1/embeddings", "completion_window": "24h", "requests": [chat("a")]}
    created = call(body, catalog.key)
    assert created.status_code == 404 and created.json()["error"]["code"] == "batch_access_disabled"
    assert Batch.objects.count() == 0 and File.objects.count() == 0
    # The native surface is not governed by this flag.
    assert call({"shape": "openai", "requests": [chat("n")["body"]]}, catalog.key).status_code == 202


@in_process
def test_without_credential_is_401_in_openai_shape(db):
    resp = call({"endpoint": "/v1/embeddings"})
    assert resp.status_code == 401
    assert resp.json()["error"] == {
        "message": "missing relay key",
        "type": "invalid_request_error",
        "param": None,
        "code": "unauthenticated",
    }


# --- ownership and the shared URL ---------------------------------------------------------------


def test_batches_and_their_files_are_private_to_their_owner(client, live_server, catalog):
    uploaded = client.files.create(file=("o.jsonl", jsonl([chat("a")])), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_status(client, batch.id)
    _, other_key = create_relay_key(service_account=catalog.sa)
    with openai.OpenAI(base_url=live_server.url + "/v1", api_key=other_key, max_retries=0) as other:
        for attempt in (
            lambda: other.batches.retrieve(batch.id),
            lambda: other.batches.cancel(batch.id),
            lambda: other.files.content(done.output_file_id),
            lambda: other.files.retrieve(uploaded.id),
        ):
            with pytest.raises(openai.NotFoundError):
                attempt()
        assert other.batches.list().data == [] and other.files.list().data == []
        with pytest.raises(openai.BadRequestError):  # someone else's file cannot be a batch input
            other.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    with openai.OpenAI(base_url=live_server.url + "/v1", api_key="sk-wr-nope", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.batches.list()


def test_native_and_openai_batches_share_the_url_but_not_their_ids(client, live_server, catalog):
    native = post(live_server, {"shape": "openai", "requests": [chat("n")["body"]]}, catalog.key)
    assert native.status_code == 202 and native.json()["status"] == "queued"
    native_id = native.json()["id"]
    oa = post(
        live_server,
        {"endpoint": "/v1/chat/completions", "completion_window": "24h", "requests": [chat("o")]},
        catalog.key,
    )
    oa_id = oa.json()["id"]
    h = {"Authorization": f"Bearer {catalog.key}"}
    # Each id is read in its own surface's shape; neither surface answers for the other's id.
    assert "InboundShape" in requests.get(f"{live_server.url}/v1/batches/{native_id}", headers=h, timeout=10).json()
    assert client.batches.retrieve(oa_id).object == "batch"
    uuid_of_oa = str(Batch.objects.get(surface="openai").id)
    assert requests.get(f"{live_server.url}/v1/batches/{uuid_of_oa}", headers=h, timeout=10).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_" + Batch.objects.get(surface="native").id.hex)
    assert [b.id for b in client.batches.list()] == [oa_id]  # the list is of OpenAI batch objects
    wait_status(client, oa_id)
    wait_for(lambda: Batch.objects.get(surface="native").completed_at, 20, what="the native batch")


def test_sdk_retry_after_a_lost_response_does_not_double_bill(client, live_server, catalog):
    """Two creates racing with one Idempotency-Key (an SDK retry after a timeout) make one batch."""
    body = {"endpoint": "/v1/chat/completions", "completion_window": "24h", "requests": [chat("r")]}
    results = []

    def create():
        results.append(post(live_server, body, catalog.key, **{"Idempotency-Key": "retry-1"}).json()["id"])

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and Batch.objects.count() == 1 and File.objects.count() == 1
    done = wait_status(client, results[0])
    wait_for(broker_idle, 10, interval=0.05, what="every task to end")  # a second run of the item would bill again
    assert done.request_counts.completed == 1 and UsageEvent.objects.count() == 1
