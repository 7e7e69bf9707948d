"""Nothing is lost: a worker SIGKILLed mid-batch, or Redis flushed mid-batch.

Each test runs its own real Celery worker processes (the item worker: 8 thread slots, with the
sweeper embedded), so crashes are real process deaths, not simulations.
"""

from collections import Counter

import pytest
import requests

from batches.models import Batch, Item
from core.redis import get_redis
from devkit.upstream import Reply
from tests.workers import wait_for
from usage.models import UsageEvent

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "durable"}]}


def submit(live_server, key, n):
    resp = requests.post(
        live_server.url + "/v1/batches",
        json={"shape": "openai", "requests": [CHAT] * n},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def assert_every_item_done_once(batch_id, n, fake):
    batch = Batch.objects.get(pk=batch_id)
    assert batch.status == "completed" and batch.completed_at is not None
    assert Counter(Item.objects.filter(batch_id=batch_id).values_list("state", flat=True)) == {"completed": n}
    # One usage event per item, never two, whatever was retried.
    assert UsageEvent.objects.filter(batch_id=batch_id).count() == n
    assert set(UsageEvent.objects.filter(batch_id=batch_id).values_list("request_id", flat=True)) == {
        str(i) for i in Item.objects.filter(batch_id=batch_id).values_list("id", flat=True)
    }


def test_worker_killed_mid_batch_loses_nothing_and_never_reruns_completed_items(live_server, catalog, fake, workers):
    n = 40
    fake.script("*", [Reply(delay=0.4) for _ in range(200)])
    first = workers("doomed")
    batch_id = submit(live_server, catalog.key, n)
    wait_for(lambda: Item.objects.filter(batch_id=batch_id, state="completed").count() >= 8, 30, what="progress")
    wait_for(lambda: Item.objects.filter(batch_id=batch_id, state="running").count() >= 4, 10, what="items in flight")
    completed_before = set(Item.objects.filter(batch_id=batch_id, state="completed").values_list("id", flat=True))
    first.kill()
    orphaned = Item.objects.filter(batch_id=batch_id, state="running").count()
    assert orphaned >= 1  # the kill really interrupted work
    workers("rescuer")
    wait_for(lambda: Batch.objects.get(pk=batch_id).completed_at, 60, what="the batch to finish after the kill")
    assert_every_item_done_once(batch_id, n, fake)
    # Items completed before the kill were never run again.
    reran = Item.objects.filter(id__in=completed_before).exclude(attempt=1)
    assert not reran.exists()
    # Rescued items carry a second attempt.
    assert Item.objects.filter(batch_id=batch_id, attempt=2).count() >= 1


def test_redis_flushed_mid_batch_loses_nothing(live_server, catalog, fake, workers):
    n = 40
    fake.script("*", [Reply(delay=0.3) for _ in range(200)])
    # Submitted while no worker runs: its wake-ups sit in Redis …
    batch_id = submit(live_server, catalog.key, n)
    assert get_redis().llen("batch") > 0
    # … and are wiped before anyone reads them. Only the sweeper can bring them back.
    get_redis().flushdb()
    workers("survivor")
    wait_for(lambda: Item.objects.filter(batch_id=batch_id, state="completed").count() >= 8, 30, what="progress")
    # Mid-batch: every queued wake-up, every unacked message, every limit and breaker gone again.
    get_redis().flushdb()
    wait_for(lambda: Batch.objects.get(pk=batch_id).completed_at, 60, what="the batch to finish after the flush")
    assert_every_item_done_once(batch_id, n, fake)
