"""The OpenAI-surface lifecycle step by step, in process: create → validate → run → finalize.

Each step is the real service a Celery task would call (validation.validate,
lifecycle.claim, worker.execute.run_item, finalize.finalize, sweeper.sweep), called
directly so every intermediate status can be observed. Items run through the
real pipeline against the fake upstream; PostgreSQL and Redis are real.
"""

import io
import json
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.test import override_settings
from django.utils import timezone

from batches import ingest, storage, sweeper
from batches.lifecycle import claim as claims
from batches.lifecycle import stop
from batches.models import Batch, File, Item
from batches.surfaces.native import submit
from batches.surfaces.openai import create as openai_create
from batches.surfaces.openai import finalize, validation
from batches.surfaces.openai import read as openai_read
from batches.worker import bookkeeper as keeper
from batches.worker import execute
from core import auth
from core.models import Pricing
from devkit.upstream import Reply
from usage import pricing
from usage.models import UsageEvent
from usage.pricing import cost_nano_usd
from usage.tokens import Tokens

pytestmark = pytest.mark.django_db
# Tests that run items: run_item's heartbeat thread reads the item with its own
# connection, so the rows must be committed, not inside the test's transaction.
runs_items = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"


def record(custom_id, content="hello", url=CHAT, **body):
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": content}], **body},
    }


def create(catalog, records=None, *, raw_lines=None, endpoint=CHAT, key=None, **extra):
    """Create through the service the POST view calls: inline `requests`, or an uploaded file of raw lines."""
    principal = auth.principal_for_key(key or catalog.key)
    body = {"endpoint": endpoint, "completion_window": "24h", **extra}
    if raw_lines is not None:
        file = storage_file(principal, b"".join(line + b"\n" for line in raw_lines))
        body["input_file_id"] = file.public_id
    else:
        body["requests"] = records
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**8, 50_000) as submission:
        return openai_create.create(principal, submission)


def storage_file(principal, data: bytes) -> File:
    from batches.surfaces.openai.files import write_file

    return write_file(principal, purpose="batch", filename="in.jsonl", chunks=[data])


def run_all():
    while (item := claims.claim("test-runner")) is not None:
        execute.run_item(item)


def status(batch) -> str:
    return Batch.objects.get(pk=batch.pk).status


def lines(file_id) -> list[dict]:
    if file_id is None:
        return []
    f = File.objects.get(pk=file_id)
    return [json.loads(line) for _, line in storage.iter_lines(f.ref, 10**8)]


@runs_items
def test_every_step_of_a_completed_batch(catalog, fake):
    batch = create(catalog, [record("a"), record("b", "second"), record("c")], metadata={"job": "nightly"})
    assert status(batch) == "validating" and batch.public_id.startswith("batch_")
    assert batch.expires_at - batch.created_at == timedelta(hours=24)
    assert Item.objects.filter(batch=batch).count() == 0  # nothing runs before validation

    validation.validate(batch.id)
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "in_progress" and b.in_progress_at and b.total_items == 3 and b.model == "gpt-4o"
    assert openai_read.request_counts(b) == {"total": 3, "completed": 0, "failed": 0}
    assert openai_read.usage(b) is None

    first = claims.claim("test-runner")
    execute.run_item(first)
    assert status(batch) == "in_progress"
    assert openai_read.request_counts(b) == {"total": 3, "completed": 1, "failed": 0}
    run_all()
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "finalizing" and b.finalizing_at and b.output_file_id is None

    finalize.finalize(batch.id)
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "completed" and b.in_progress_at <= b.finalizing_at <= b.completed_at
    assert b.error_file_id is None and b.failed_at is None and b.cancelled_at is None
    out = {line["custom_id"]: line for line in lines(b.output_file_id)}
    assert set(out) == {"a", "b", "c"}
    line = out["b"]
    item = Item.objects.get(batch=batch, custom_id="b")
    assert line["id"] == f"batch_req_{item.id.hex}" and line["error"] is None
    assert line["response"]["status_code"] == 200 and line["response"]["request_id"] == str(item.id)
    assert "second" in line["response"]["body"]["choices"][0]["message"]["content"]
    output = File.objects.get(pk=b.output_file_id)
    assert output.purpose == "batch_output" and output.owner_hash == b.owner_hash and output.batch_id == b.id
    assert output.filename == f"{b.public_id}_output.jsonl"

    finalize.finalize(batch.id)  # a duplicate message changes nothing
    assert File.objects.filter(batch_id=b.id, purpose="batch_output").count() == 1


@runs_items
def test_discount_is_applied_per_event_and_rolled_up(catalog, fake):
    with override_settings(RELAY_BATCH_DISCOUNT_PERCENT=33):
        batch = create(catalog, [record(f"r{i}", "word " * (i * 7 + 3)) for i in range(4)])
    validation.validate(batch.id)
    run_all()
    pricing = Pricing.objects.get(name="p-gpt")
    events = list(UsageEvent.objects.filter(batch_id=str(batch.id)))
    assert len(events) == 4
    for e in events:
        cost = cost_nano_usd(pricing, Tokens(input=e.input_tokens, output=e.output_tokens))
        assert e.cost_nano_usd == cost  # the undiscounted cost is kept
        assert e.billed_cost_nano_usd == cost * 67 // 100  # floored per event
    usage = openai_read.usage(Batch.objects.get(pk=batch.pk))
    assert usage["cost_nano_usd"] == sum(e.billed_cost_nano_usd for e in events)
    assert usage["cost_nano_usd"] < sum(e.cost_nano_usd for e in events)
    assert usage["input_tokens"] == sum(e.input_tokens for e in events)
    assert usage["output_tokens"] == sum(e.output_tokens for e in events)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    # The native surface gets no discount: its events carry no billed price.
    principal = auth.principal_for_key(catalog.key)
    native = submit.submit_native(
        principal, io.BytesIO(json.dumps({"shape": "openai", "requests": [record("x")["body"]]}).encode())
    )
    run_all()
    e = UsageEvent.objects.get(batch_id=str(native.id))
    assert e.cost_nano_usd > 0 and e.billed_cost_nano_usd is None


def test_default_discount_is_half_price():
    assert settings.RELAY_BATCH_DISCOUNT_PERCENT == 50
    assert pricing.discounted(1001, 50) == 500  # floored: the caller never pays the odd nano-USD
    assert pricing.discounted(0, 50) == 0 and pricing.discounted(7, 0) == 7


def test_validation_errors_carry_line_numbers_and_store_nothing(catalog):
    raw = [
        json.dumps(record("ok-1")).encode(),
        b"{not json",
        json.dumps({"method": "POST", "url": CHAT, "body": {}}).encode(),
        b"",  # a blank line is skipped, but still counted
        json.dumps(record("ok-1")).encode(),
        json.dumps(dict(record("m"), method="GET")).encode(),
        json.dumps(record("u", url="/v1/embeddings")).encode(),
        json.dumps(dict(record("b"), body=["x"])).encode(),
        b"[1, 2]",
    ]
    batch = create(catalog, raw_lines=raw)
    validation.validate(batch.id)
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "failed" and b.failed_at and b.total_items == 0
    got = [(e["line"], e["code"], e["param"]) for e in b.errors]
    assert got == [
        (2, "invalid_json_line", None),
        (3, "missing_required_parameter", "custom_id"),
        (5, "duplicate_custom_id", "custom_id"),
        (6, "invalid_method", "method"),
        (7, "mismatched_url", "url"),
        (8, "invalid_body", "body"),
        (9, "invalid_request", None),
    ]
    assert "already used on line 1" in b.errors[2]["message"]
    assert Item.objects.filter(batch=batch).count() == 0
    assert not (Path(settings.RELAY_BATCH_PAYLOAD_DIR) / str(batch.id)).exists()
    assert openai_read.request_counts(b) == {"total": 0, "completed": 0, "failed": 0}


@pytest.mark.parametrize(
    "raw,code",
    [([], "empty_file"), ([b"", b"  "], "empty_file")],
)
def test_an_empty_input_file_fails(catalog, raw, code):
    batch = create(catalog, raw_lines=raw)
    validation.validate(batch.id)
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "failed" and [e["code"] for e in b.errors] == [code]


def test_more_records_than_the_limit_fail_the_batch_at_that_line(catalog):
    raw = [json.dumps(record(f"r{i}")).encode() for i in range(4)]
    batch = create(catalog, raw_lines=raw)
    with override_settings(RELAY_BATCH_MAX_ITEMS=3):
        validation.validate(batch.id)
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "failed" and [(e["code"], e["line"]) for e in b.errors] == [("too_many_requests", 4)]


@runs_items
def test_record_level_failures_fail_only_their_record(catalog, fake):
    batch = create(
        catalog,
        [
            record("streamed", stream=True),
            record("old-spelling", tool_config={"url": "https://tools.example/run"}),
            record("extension", openrelay={"tool_config": {"url": "https://tools.example/run"}}),
            record("plain"),
        ],
    )
    validation.validate(batch.id)
    assert status(batch) == "in_progress"
    run_all()
    finalize.finalize(batch.id)
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "completed"
    assert openai_read.request_counts(b) == {"total": 4, "completed": 2, "failed": 2}
    errors = {line["custom_id"]: line for line in lines(b.error_file_id)}
    assert errors["streamed"]["response"] is None and errors["streamed"]["error"]["code"] == "streaming_unsupported"
    assert errors["old-spelling"]["error"]["code"] == "tool_config_moved"
    assert set(line["custom_id"] for line in lines(b.output_file_id)) == {"extension", "plain"}
    # The openrelay extension never reaches the upstream, but the stored record keeps it.
    assert all("openrelay" not in r["body"] for r in fake.received) and len(fake.received) == 2
    stored = Item.objects.get(batch=batch, custom_id="extension")
    assert "openrelay" in json.loads(storage.read(stored.input_ref))
    # One usage event per item, including the two that never ran.
    kinds = dict(UsageEvent.objects.filter(batch_id=str(batch.id)).values_list("request_id", "error_kind"))
    assert (
        len(kinds) == 4
        and kinds[str(Item.objects.get(batch=batch, custom_id="streamed").id)] == "streaming_unsupported"
    )


def test_when_every_record_fails_there_is_no_output_file(catalog):
    batch = create(catalog, [record("a", stream=True), record("b", stream=True)])
    validation.validate(batch.id)
    assert status(batch) == "finalizing"  # nothing to run
    finalize.finalize(batch.id)
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "completed" and b.output_file_id is None
    assert sorted(line["custom_id"] for line in lines(b.error_file_id)) == ["a", "b"]


@runs_items
def test_upstream_and_relay_side_failures_have_their_own_line_shapes(catalog, fake):
    fake.script("upstream-openai-0", [Reply(status=400, body={"error": {"message": "context too long"}})])
    batch = create(catalog, [record("upstream"), dict(record("relay"), body={"model": "nope", "messages": []})])
    validation.validate(batch.id)
    run_all()
    finalize.finalize(batch.id)
    b = Batch.objects.get(pk=batch.pk)
    assert b.output_file_id is None
    errors = {line["custom_id"]: line for line in lines(b.error_file_id)}
    upstream = errors["upstream"]
    assert upstream["error"] is None and upstream["response"]["status_code"] == 400
    assert upstream["response"]["body"] == {"error": {"message": "context too long"}}
    relay = errors["relay"]
    assert relay["response"] is None
    assert relay["error"] == {"code": "model_not_found", "message": "model nope does not exist"}


@runs_items
def _next_beat_far_off(settings) -> None:
    """This process's bookkeeper beats its registered items every RELAY_BATCH_HEARTBEAT_SECONDS, at a
    moment the test does not choose; a beat during the item would see the cancel and stop it. With the
    interval made an hour, the bookkeeper's next beat is an hour after its last: the change wakes the thread
    (batches.worker.bookkeeper.rescheduled), and a job queued behind that wake has run once it answers."""
    settings.RELAY_BATCH_HEARTBEAT_SECONDS = 3600
    keeper.bookkeeper().submit(lambda: None).result(timeout=30)


def test_cancel_while_running_ends_cancelled_with_partial_results(catalog, fake, settings):
    batch = create(catalog, [record(f"r{i}") for i in range(4)])
    validation.validate(batch.id)
    running = claims.claim("test-runner")
    assert stop.cancel(Batch.objects.get(pk=batch.pk))
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "cancelling" and b.cancelling_at and b.cancel_requested_at
    assert openai_read.request_counts(b) == {"total": 4, "completed": 0, "failed": 3}
    finalize.finalize(batch.id)  # a running item is still out there: not yet
    assert status(batch) == "cancelling"
    _next_beat_far_off(settings)
    execute.run_item(running)  # it finishes (its heartbeat had not come round yet)
    finalize.finalize(batch.id)
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "cancelled" and b.cancelled_at >= b.cancelling_at and b.completed_at is None
    assert [line["custom_id"] for line in lines(b.output_file_id)] == [running.custom_id]
    errors = lines(b.error_file_id)
    assert len(errors) == 3 and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert stop.cancel(b)  # cancelling a cancelled batch is a no-op, not an error


def test_cancel_before_validation(catalog):
    batch = create(catalog, [record("a")])
    assert stop.cancel(batch)
    assert status(batch) == "cancelling"
    validation.validate(batch.id)  # the message arrives late: nothing happens
    finalize.finalize(batch.id)
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "cancelled" and b.total_items == 0 and b.output_file_id is None and b.error_file_id is None


@runs_items
def test_a_finished_batch_cannot_be_cancelled(catalog, fake):
    batch = create(catalog, [record("a")])
    validation.validate(batch.id)
    run_all()
    finalize.finalize(batch.id)
    b = Batch.objects.get(pk=batch.pk)
    assert not stop.cancel(b) and b.status == "completed"


@runs_items
def test_expiry_delivers_finished_records_and_expires_the_rest(catalog, fake):
    batch = create(catalog, [record(f"r{i}") for i in range(3)])
    validation.validate(batch.id)
    execute.run_item(claims.claim("test-runner"))
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert sweeper.sweep()["expired"] == 1
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "finalizing" and b.expired_at and b.cancel_requested_at
    finalize.finalize(batch.id)
    b = Batch.objects.get(pk=batch.pk)
    assert b.status == "expired" and b.completed_at is None
    assert len(lines(b.output_file_id)) == 1
    expired = lines(b.error_file_id)
    assert len(expired) == 2
    assert {json.dumps(e["error"]) for e in expired} == {
        json.dumps(
            {
                "code": "batch_expired",
                "message": "This request could not be executed before the completion window expired.",
            }
        )
    }
    assert openai_read.request_counts(b) == {"total": 3, "completed": 1, "failed": 2}


def test_a_batch_still_validating_when_its_window_closes_expires(catalog):
    with override_settings(RELAY_BATCH_COMPLETION_WINDOW_SECONDS=0):
        batch = create(catalog, [record("a")])
    sweeper.sweep()
    finalize.finalize(batch.id)
    assert status(batch) == "expired"


@runs_items
def test_sweeper_resends_lost_messages_and_finishes_a_racing_batch(catalog, fake):
    from core.redis import get_redis

    batch = create(catalog, [record("a")])
    get_redis().delete("control")  # the validate message is lost
    Batch.objects.filter(pk=batch.pk).update(created_at=timezone.now() - timedelta(minutes=5))
    sweeper.sweep()
    queued = [json.loads(m)["headers"]["task"] for m in get_redis().lrange("control", 0, -1)]
    assert queued == ["batches.tasks.validate_openai_batch"]
    sweeper.sweep()  # debounced: not sent twice in one lease period
    assert get_redis().llen("control") == 1
    validation.validate(batch.id)
    run_all()
    # As if the last item's completion check had raced another item's: all final, still in_progress.
    Batch.objects.filter(pk=batch.pk).update(status="in_progress", finalizing_at=None)
    sweeper.sweep()
    assert status(batch) == "finalizing"


@runs_items
@override_settings(RELAY_BATCH_PAYLOAD_STORE="db")
def test_database_payload_store_serves_the_whole_lifecycle(catalog, fake):
    big = "x" * 200_000  # several records per 1 MiB chunk, lines straddling chunk boundaries
    batch = create(catalog, [record(f"r{i}", big) for i in range(12)])
    inline = File.objects.get(pk=batch.input_file_id)
    assert inline.ref.startswith("dbfile:") and inline.bytes > 2 * storage.FILE_CHUNK
    validation.validate(batch.id)
    run_all()
    finalize.finalize(batch.id)
    b = Batch.objects.get(pk=batch.pk)
    out = lines(b.output_file_id)
    assert len(out) == 12 and File.objects.get(pk=b.output_file_id).ref.startswith("dbfile:")
    assert all(big[:100] in line["response"]["body"]["choices"][0]["message"]["content"] for line in out)
