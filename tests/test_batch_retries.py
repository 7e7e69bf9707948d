"""Waiting for capacity, retrying transient failures, the attempt history — and the native surface's
lease machinery — driven step by step (claim, run_item, sweep), without a worker process.

Each step is a real call against PostgreSQL, Redis and the fake provider; the
clock is moved by rewriting `not_before` / `lease_expires_at`, never by sleeping.
"""

import io
import json
from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from batches import ingest, retrying, sweeper
from batches.lifecycle import claim as claims
from batches.lifecycle import finish as finishing
from batches.lifecycle import states, stop
from batches.models import Attempt, Batch, Item
from batches.outcomes import Code
from batches.surfaces.native import submit
from batches.surfaces.openai import create as openai_create
from batches.surfaces.openai import validation
from batches.worker import execute
from core import auth
from core.errors import RelayError
from core.redis import get_redis
from devkit.upstream import Reply
from tests import factories
from usage.models import UsageEvent

# run_item's heartbeat thread uses its own connection: rows must be committed.
pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"


def chat(content="hello"):
    return {"model": "gpt-4o", "messages": [{"role": "user", "content": content}]}


def openai_batch(catalog, n=1, content="hello"):
    principal = auth.principal_for_key(catalog.key)
    records = [{"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": chat(f"{content} {i}")} for i in range(n)]
    body = {"endpoint": CHAT, "completion_window": "24h", "requests": records}
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**7, 1000) as submission:
        batch = openai_create.create(principal, submission)
    validation.validate(batch.id)
    return Batch.objects.get(pk=batch.pk)


def native_batch(catalog, n=1, retry=None, content="hello"):
    principal = auth.principal_for_key(catalog.key)
    body = {"shape": "openai", "requests": [chat(f"{content} {i}") for i in range(n)]}
    if retry is not None:
        body["retry"] = retry
    return submit.submit_native(principal, io.BytesIO(json.dumps(body).encode()))


def run_next(owner="step-runner"):
    item = claims.claim(owner)
    assert item is not None, "nothing claimable"
    execute.run_item(item)
    return Item.objects.get(pk=item.pk)


def make_due(item):
    """Move the clock past an item's backoff (and its batch's pause), and past the cooldowns the
    failed attempt opened on the keys' breakers (shared state in Redis)."""
    Item.objects.filter(pk=item.pk).update(not_before=timezone.now() - timedelta(seconds=1))
    Batch.objects.filter(pk=item.batch_id).update(not_before=None)
    get_redis().flushdb()


# --- the decision table ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code,status,retry_after,expected",
    [
        (Code.UPSTREAM_ERROR, 429, 2.0, ("capacity", 2.0)),
        (Code.UPSTREAM_ERROR, 500, None, ("transient", None)),
        (Code.UPSTREAM_ERROR, 503, None, ("transient", None)),
        (Code.UPSTREAM_ERROR, 408, None, ("transient", None)),
        (Code.UPSTREAM_ERROR, 409, None, ("transient", None)),
        (Code.UPSTREAM_ERROR, 400, None, ("final", None)),
        (Code.UPSTREAM_ERROR, 401, None, ("final", None)),
        (Code.RATE_LIMIT_EXCEEDED, None, 3.0, ("capacity", 3.0)),
        (Code.NO_KEYS, None, 0.5, ("capacity", 0.5)),
        (Code.NO_KEYS, None, None, ("final", None)),  # no key at all: waiting changes nothing
        (Code.UPSTREAM_UNREACHABLE, None, None, ("transient", None)),
        (Code.UPSTREAM_ERROR, None, None, ("transient", None)),  # the connection broke
        (Code.TIMEOUT, None, None, ("final", None)),  # the item's deadline ends it
        (Code.MODEL_NOT_FOUND, None, None, ("final", None)),
        (Code.CREDENTIAL_INVALID, None, None, ("final", None)),
    ],
)
def test_classify(code, status, retry_after, expected):
    assert retrying.classify(code, status, retry_after) == expected


@override_settings(RELAY_BATCH_RETRY_BASE_SECONDS=1.0, RELAY_BATCH_RETRY_MAX_SECONDS=8.0)
def test_backoff_is_full_jitter_under_a_doubling_cap():
    for n, cap in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)):
        samples = [retrying.backoff(n) for _ in range(200)]
        assert all(0 <= s <= cap for s in samples)
        assert max(samples) > cap / 2  # spread over the whole range, not pinned to the cap


# --- the OpenAI surface waits and retries by default ----------------------------------------------


def test_openai_batch_waits_and_retries_by_default(catalog):
    b = openai_batch(catalog)
    assert (b.retry_transient, b.wait_for_capacity, b.max_attempts) == (True, True, 5)
    assert Item.objects.get(batch=b).max_attempts == 5


def test_a_5xx_is_retried_with_backoff_and_every_attempt_is_recorded(catalog, fake):
    openai_batch(catalog)
    # A batch that retries does not fail over on a 5xx: the item backs off and tries again later.
    fake.script("*", [Reply(status=500, body={"error": {"message": "overloaded"}})])
    item = run_next()
    assert item.state == "available" and item.retries == 1 and item.not_before is not None
    make_due(item)
    item = run_next()
    assert item.state == "completed" and item.retries == 1
    attempts = list(Attempt.objects.filter(item=item).order_by("number"))
    assert [(a.decision, a.outcome, a.status_code) for a in attempts] == [
        ("retry", "upstream_error", 500),
        ("finish", "completed", 200),
    ]
    assert attempts[0].host_key_id is not None and "overloaded" in attempts[0].error_body
    assert len(fake.received) == 2  # one call per attempt: no failover over the pool on a 5xx
    # Billed once: exactly one usage event, the final attempt's.
    events = UsageEvent.objects.filter(request_id=str(item.pk))
    assert events.count() == 1 and events.get().status == 200


def test_an_item_that_always_fails_ends_after_max_attempts_with_its_history(catalog, fake):
    b = openai_batch(catalog, content="always-broken")
    fake.answer_when("always-broken", Reply(status=500, body={"error": {"message": "boom"}}))
    for _ in range(b.max_attempts):
        item = run_next()
        if item.state != "available":
            break
        make_due(item)
    assert item.state == "discarded" and item.error_code == Code.UPSTREAM_ERROR and item.status_code == 500
    assert item.retries == b.max_attempts - 1
    decisions = list(Attempt.objects.filter(item=item).order_by("number").values_list("decision", flat=True))
    assert decisions == ["retry"] * (b.max_attempts - 1) + ["finish"]
    assert json.loads(item.error_body) == {"error": {"message": "boom"}}
    assert UsageEvent.objects.filter(request_id=str(item.pk)).count() == 1


def test_an_upstream_429_waits_without_using_an_attempt_and_pauses_the_batch(catalog, fake):
    b = openai_batch(catalog, n=2)
    fake.script("*", [Reply(status=429, headers={"Retry-After": "7"})] * 3)  # every key of the failover
    item = run_next()
    assert item.state == "available" and item.retries == 0
    wait = (item.not_before - timezone.now()).total_seconds()
    assert 5 < wait <= 7
    paused = Batch.objects.get(pk=b.pk).not_before
    assert paused == item.not_before
    assert claims.claim("other") is None  # the whole batch waits: its capacity is shared
    attempt = Attempt.objects.get(item=item)
    assert (attempt.decision, attempt.status_code) == ("wait", 429)
    make_due(item)
    assert run_next().state == "completed"


def test_a_spent_policy_limit_waits_without_an_attempt(catalog, fake):
    catalog.policy.rate_limit = factories.rate_limit("one-a-minute", ("requests", 1, 60, "fixed-window"))
    catalog.policy.save()
    b = openai_batch(catalog, n=2)
    assert run_next().state == "completed"
    item = run_next()
    assert item.state == "available" and item.retries == 0
    assert 0 < (item.not_before - timezone.now()).total_seconds() <= 60
    assert Batch.objects.get(pk=b.pk).not_before is not None
    assert not Attempt.objects.filter(item=item).exists()  # no provider was called
    assert not UsageEvent.objects.filter(request_id=str(item.pk)).exists()  # nothing billed yet


def test_a_batch_waiting_for_its_policy_does_not_block_another(catalog, fake):
    waiting = openai_batch(catalog, n=1)
    Batch.objects.filter(pk=waiting.pk).update(not_before=timezone.now() + timedelta(minutes=5))
    other = native_batch(catalog, n=1)
    item = run_next()
    assert item.batch_id == other.id and item.state == "completed"


def test_provider_quota_headers_pace_the_keys(catalog, fake):
    fake.limit_rate(1, window=60)  # one request per key per minute, with x-ratelimit-* headers
    openai_batch(catalog, n=5)
    states = [run_next().state for _ in range(3)]  # 3 keys: each answers once and says it is spent
    assert states == ["completed"] * 3
    item = run_next()  # every key's window is spent: wait without asking the provider again
    assert item.state == "available" and not Attempt.objects.filter(item=item).exists()
    assert fake.rate_stats == {"ok": 3, "limited": 0}


# --- the native surface keeps its contract's default; opts in per batch --------------------------------


def test_native_default_fails_at_once(catalog, fake):
    b = native_batch(catalog)
    assert (b.retry_transient, b.wait_for_capacity) == (False, False)
    fake.script("*", [Reply(status=500)] * 3)
    item = run_next()
    assert item.state == "discarded" and item.error == "batch item: upstream status 500" and item.retries == 0


def test_native_default_does_not_wait_for_a_spent_limit(catalog, fake):
    catalog.policy.rate_limit = factories.rate_limit("one-a-minute", ("requests", 1, 60, "fixed-window"))
    catalog.policy.save()
    native_batch(catalog, n=2)
    assert run_next().state == "completed"
    item = run_next()
    assert item.state == "discarded" and item.error_code == Code.RATE_LIMIT_EXCEEDED


def test_native_opt_in_retries_and_waits(catalog, fake):
    b = native_batch(catalog, retry={"max_attempts": 2, "wait_for_capacity": True})
    assert (b.max_attempts, b.retry_transient, b.wait_for_capacity) == (2, True, True)
    fake.script("*", [Reply(status=503)] * 6)
    item = run_next()
    assert item.state == "available" and item.retries == 1
    make_due(item)
    item = run_next()
    assert item.state == "discarded" and item.status_code == 503  # 2 attempts used


@pytest.mark.parametrize(
    "retry,message",
    [
        ("yes", "retry must be an object"),
        ({"max_attempts": 0}, "retry.max_attempts must be an integer from 1 to 100"),
        ({"max_attempts": True}, "retry.max_attempts must be an integer from 1 to 100"),
        ({"wait_for_capacity": "yes"}, "retry.wait_for_capacity must be true or false"),
        ({"attempts": 3}, "retry: unknown field 'attempts'"),
    ],
)
def test_native_retry_option_is_checked(catalog, retry, message):
    with pytest.raises(RelayError) as exc:
        native_batch(catalog, retry=retry)
    assert exc.value.status == 400 and message in exc.value.message
    assert not Batch.objects.exists() and not Item.objects.exists()


def test_native_status_shows_the_retry_options(client, catalog):
    plain = native_batch(catalog)
    opted = native_batch(catalog, retry={"max_attempts": 4})
    h = {"Authorization": f"Bearer {catalog.key}"}
    got = [json.loads(b"".join(client.get(f"/v1/batches/{b.id}", headers=h).streaming_content)) for b in (plain, opted)]
    assert got[0]["retry"] is None
    assert got[1]["retry"] == {"max_attempts": 4, "wait_for_capacity": True}


# --- the native lease machinery, step by step --------------------------------------------


def expire_lease(item_id):
    Item.objects.filter(pk=item_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def test_sweeper_rescues_an_expired_lease_and_a_zombie_finish_is_refused(catalog, fake):
    native_batch(catalog)
    zombie = claims.claim("zombie")
    expire_lease(zombie.pk)
    assert sweeper.sweep()["rescued"] == 1
    rescued = Item.objects.get(pk=zombie.pk)
    assert rescued.state == "available" and rescued.retries == 1 and rescued.lease_owner == ""
    lost = Attempt.objects.get(item=rescued)
    assert (lost.outcome, lost.decision, lost.number) == (Code.WORKER_LOST, "retry", 1)
    rescuer = claims.claim("rescuer")
    assert rescuer.pk == zombie.pk and rescuer.attempt == 2
    execute.run_item(zombie)  # the zombie wakes up and finishes: fenced out, nothing written
    assert Item.objects.get(pk=zombie.pk).state == "running"
    assert not UsageEvent.objects.filter(request_id=str(zombie.pk)).exists()
    execute.run_item(rescuer)
    done = Item.objects.get(pk=zombie.pk)
    assert done.state == "completed" and UsageEvent.objects.filter(request_id=str(done.pk)).count() == 1
    assert list(Attempt.objects.filter(item=done).order_by("number").values_list("number", "decision")) == [
        (1, "retry"),
        (2, "finish"),
    ]


def test_the_last_attempt_lost_is_discarded_with_its_event(catalog, fake):
    b = native_batch(catalog)
    for n in range(3):  # max_attempts 3: two rescues, then the third loss discards it
        item = claims.claim(f"lost-{n}")
        expire_lease(item.pk)
        sweeper.sweep()
    item = Item.objects.get(pk=item.pk)
    assert item.state == "discarded" and item.error_code == Code.WORKER_LOST
    assert item.error == "batch: worker lost the item on every attempt"
    event = UsageEvent.objects.get(request_id=str(item.pk))
    assert event.error_kind == Code.WORKER_LOST and event.status == 0
    assert Attempt.objects.filter(item=item).count() == 3
    b = Batch.objects.get(pk=b.pk)
    assert b.status == "completed" and b.completed_at is not None  # finished at once, not at the next sweep


def test_cancel_of_a_native_batch_cancels_pending_items_at_once(catalog, fake):
    b = native_batch(catalog, n=3)
    running = claims.claim("r")
    stop.cancel(Batch.objects.get(pk=b.pk))
    b.refresh_from_db()
    assert b.status == "cancelled" and b.completed_at is None  # one item still running
    assert sorted(Item.objects.filter(batch=b).values_list("state", flat=True)) == ["cancelled", "cancelled", "running"]
    execute.run_item(running)  # it stops at its heartbeat or finishes; either way the batch is then done
    b.refresh_from_db()
    assert b.completed_at is not None


def test_transitions_outside_the_table_are_refused(catalog):
    b = native_batch(catalog)
    with pytest.raises(states.IllegalTransition):
        states.move(b.pk, "native", "finalizing")
    with pytest.raises(states.IllegalTransition):
        states.move(b.pk, "openai", "in_progress", frm=["completed"])


def test_discarding_lost_items_never_takes_one_with_attempts_left(catalog, fake):
    """Even when the rescue step passed a row over (held by a frozen process, or past its page)."""
    native_batch(catalog)
    item = claims.claim("lost-once")
    expire_lease(item.pk)
    assert finishing.discard_lost_items(timezone.now(), lambda *row: None) == 0
    assert Item.objects.get(pk=item.pk).state == "running"  # the next rescue gives it back
    assert sweeper.sweep()["rescued"] == 1


def test_a_batch_cancelled_while_validating_is_finalized_even_if_the_message_is_lost(catalog):
    principal = auth.principal_for_key(catalog.key)
    records = [{"custom_id": "a", "method": "POST", "url": CHAT, "body": chat()}]
    body = {"endpoint": CHAT, "completion_window": "24h", "requests": records}
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**7, 10) as submission:
        batch = openai_create.create(principal, submission)
    assert stop.cancel(batch)
    get_redis().delete("control")  # the finalize message is lost
    Batch.objects.filter(pk=batch.pk).update(cancelling_at=timezone.now() - timedelta(minutes=5))
    sweeper.sweep()
    queued = [json.loads(m)["headers"]["task"] for m in get_redis().lrange("control", 0, -1)]
    assert "batches.tasks.finalize_openai_batch" in queued


def test_an_item_released_after_its_batch_was_cancelled_is_cancelled_at_once(catalog, fake):
    b = openai_batch(catalog)
    fake.script("*", [Reply(status=500)])
    item = claims.claim("r")
    Batch.objects.filter(pk=b.pk).update(cancel_requested_at=timezone.now())  # a cancel lands mid-attempt
    execute.run_item(item)  # the attempt fails transiently; instead of a retry, the item is cancelled
    assert Item.objects.get(pk=item.pk).state == "cancelled"
