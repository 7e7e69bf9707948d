"""Nothing is lost: a worker SIGKILLed mid-batch, or Redis flushed mid-batch.

Its test runs real Celery worker processes of its own (the item worker: 8 thread slots, with the
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


def test_a_worker_killed_and_redis_flushed_mid_batch_lose_nothing_and_never_rerun_completed_items(
    live_server, catalog, fake, workers
):
    """One run, two fleets (not three): a batch whose wake-ups were wiped before any worker read them is
    brought back by the sweeper; a worker SIGKILLed with both batches' records in flight loses nothing
    and reruns nothing it had completed; Redis flushed again while the rescuer drains loses nothing."""
    fake.answer_when("durable", Reply(delay=0.4))
    # Submitted while no worker runs: its wake-ups sit in Redis …
    swept = submit(live_server, catalog.key, 40)
    assert get_redis().llen("batch") > 0
    # … and are wiped before anyone reads them. Only the sweeper can bring them back.
    get_redis().flushdb()
    first = workers("doomed")

    def completed(batch_id) -> int:
        return Item.objects.filter(batch_id=batch_id, state="completed").count()

    wait_for(lambda: completed(swept) >= 8, 30, what="the swept batch's progress")
    killed = submit(live_server, catalog.key, 60)
    wait_for(lambda: completed(killed) >= 8, 30, what="progress")
    wait_for(lambda: Item.objects.filter(batch_id=killed, state="running").count() >= 4, 10, what="items in flight")
    both = Item.objects.filter(batch_id__in=[swept, killed])
    completed_before = set(both.filter(state="completed").values_list("id", flat=True))
    first.kill()
    assert Item.objects.filter(batch_id=killed, state="running").exists()  # the kill really interrupted work
    workers("rescuer")
    at_kill = completed(killed)
    wait_for(lambda: completed(killed) >= at_kill + 4, 60, what="the rescuer's progress")
    # Mid-batch: every queued wake-up, every unacked message, every limit and breaker gone again.
    get_redis().flushdb()
    for batch_id in (swept, killed):
        wait_for(lambda b=batch_id: Batch.objects.get(pk=b).completed_at, 60, what="the batches to finish")
    assert_every_item_done_once(swept, 40, fake)
    assert_every_item_done_once(killed, 60, fake)
    # Items completed before the kill were never run again.
    reran = Item.objects.filter(id__in=completed_before).exclude(attempt=1)
    assert not reran.exists()
    # Rescued items carry a second attempt.
    assert Item.objects.filter(batch_id=killed, attempt=2).count() >= 1
