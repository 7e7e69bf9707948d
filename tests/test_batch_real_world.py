"""Batches that finish against a real-world provider, with real worker processes.

A fake provider that enforces a per-key rate and answers some requests 500;
a worker frozen (SIGSTOP) inside its finishing transaction; control work while
every item slot is busy; PostgreSQL restarted mid-batch. Each test runs the
relay's background processes as production does (relay.processes): a fleet of
its own where it kills, freezes, configures or inspects one, else the shared
fleet (`worker`, tests/conftest.py). Each checks what must hold: nothing lost,
nothing billed twice, every item finished.
Throughput is printed for the record, never asserted (benchmarks measure it).
"""

import io
import json
import signal
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection, transaction
from django.utils import timezone

from batches import ingest
from batches.lifecycle import stop
from batches.models import Attempt, Batch, Item
from batches.surfaces.native import submit
from batches.surfaces.openai import create as openai_create
from core import auth
from devkit.upstream import Reply
from policies.models import PolicyHostKey
from tests.workers import broker_idle, pg_cluster, restart_postgresql, wait_for
from usage.models import UsageEvent

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"
FAST_RETRIES = {"RELAY_BATCH_RETRY_BASE_SECONDS": "0.2", "RELAY_BATCH_RETRY_MAX_SECONDS": "2"}


def openai_batch(catalog, contents) -> Batch:
    principal = auth.principal_for_key(catalog.key)
    records = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": CHAT,
            "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": c}]},
        }
        for i, c in enumerate(contents)
    ]
    body = {"endpoint": CHAT, "completion_window": "24h", "requests": records}
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**8, 50_000) as submission:
        return openai_create.create(principal, submission)


def native_batch(catalog, n, content="hello") -> Batch:
    principal = auth.principal_for_key(catalog.key)
    body = {
        "shape": "openai",
        "requests": [{"model": "gpt-4o", "messages": [{"role": "user", "content": content}]}] * n,
    }
    return submit.submit_native(principal, io.BytesIO(json.dumps(body).encode()))


def status(batch) -> str:
    return Batch.objects.get(pk=batch.pk).status


def states(batch) -> Counter:
    return Counter(Item.objects.filter(batch_id=batch.pk).values_list("state", flat=True))


def assert_billed_once(batch):
    items = Item.objects.filter(batch_id=batch.pk).count()
    events = UsageEvent.objects.filter(batch_id=str(batch.pk))
    assert events.count() == items
    assert events.values("request_id").distinct().count() == items


def two_keys(catalog):
    """The policy's pool: two OpenAI keys (the catalog makes three)."""
    PolicyHostKey.objects.filter(policy=catalog.policy, host_key=catalog.keys[2]).delete()


def test_a_rate_limited_provider_is_paced_not_failed(worker, catalog, fake):
    """Two keys, 5 requests/s each, 429 beyond that: every record succeeds, almost no 429s.

    100 records are 10 windows of the provider's limit: the pacing is held for 10 s, long past the first
    window's burst. Its few 429s, while the limit is learnt, are bounded in number (5-7 measured, 8 slots
    at most), not as a share of the records: a relay that let one more 429 through per window after that
    would exceed the bound, and one that did not pace would exceed it many times over.
    The long form (any number of records, drain rate against the limit) is the benchmark's rate-limited
    provider: `BENCH_ONLY=batch BENCH_RL_ITEMS=1000 make bench` (bench/batch_capacity.py)."""
    two_keys(catalog)
    fake.limit_rate(5)
    w = worker
    n = 100
    batch = openai_batch(catalog, [f"paced {i}" for i in range(n)])
    started = time.monotonic()
    wait_for(lambda: status(batch) in ("completed", "failed", "expired"), 400, what="the batch")
    elapsed = time.monotonic() - started
    assert w.alive(), w.output()
    assert status(batch) == "completed" and states(batch) == {"completed": n}
    stats = fake.rate_stats
    print(f"\ndrain {n / elapsed:.2f} items/s against a 10 items/s limit; 429s: {stats['limited']} of {n}")
    assert stats["limited"] <= 10, stats
    assert_billed_once(batch)


def test_a_native_batch_without_the_opt_in_keeps_the_spec(worker, catalog, fake):
    fake.answer_when("<fails>", Reply(status=500))
    batch = native_batch(catalog, 3, content="<fails>")
    wait_for(lambda: Batch.objects.get(pk=batch.pk).completed_at, 30, what="the batch")
    assert states(batch) == {"discarded": 3}
    assert set(Item.objects.filter(batch_id=batch.pk).values_list("retries", flat=True)) == {0}
    assert_billed_once(batch)


def test_control_work_is_prompt_while_every_item_slot_is_busy(worker, catalog, fake):
    """Validation, expiry and finalization ride their own queue: 8 slow items don't hold them up."""
    w = worker
    gate = threading.Event()
    fake.answer_when("<slow>", Reply(gate=gate))
    slow = native_batch(catalog, 8, content="<slow>")
    try:
        wait_for(lambda: states(slow).get("running") == 8, 30, what="8 busy slots")
        batch = openai_batch(catalog, ["<quick>"])
        wait_for(lambda: status(batch) == "in_progress", 10, what="validation")
        Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
        wait_for(lambda: status(batch) == "expired", 10, what="expiry and finalization")
        b = Batch.objects.get(pk=batch.pk)
        assert b.error_file_id is not None and states(slow).get("running") == 8
    finally:
        gate.set()
    wait_for(lambda: Batch.objects.get(pk=slow.pk).completed_at, 30, what="the slow batch")
    assert w.alive(), w.output()


def _blocked_sessions() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")  # activity is snapshotted once per transaction
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0]


def _busy_sessions() -> int:
    """Other clients' sessions in the test database that run a statement or hold a transaction open."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend' AND state <> 'idle'"
        )
        return cursor.fetchone()[0]


def test_a_worker_frozen_inside_its_finishing_transaction_stalls_nothing(workers, catalog, fake, monkeypatch):
    """A worker frozen holding its item's row lock stalls neither new batches nor its own item. The healthy
    fleet that works beside it also shows, while the frozen session waits out its timeout (one fleet, not
    three, each booted and stopped): transient failures are retried and hopeless items end with their
    history; its 8 slots are threads of one process (relay/processes.py: the `threads` pool, not forked pool
    processes) that warmed itself up once, before its first item (relay/celery.py)."""
    frozen = workers("frozen", extra_env={"RELAY_DB_IDLE_IN_TRANSACTION_TIMEOUT_MS": "8000"})
    first = native_batch(catalog, 1, content="<first>")
    item = Item.objects.get(batch_id=first.pk)
    # Hold the item's usage-event key: its finishing transaction waits on us, inside the transaction.
    with transaction.atomic():
        UsageEvent.objects.create(request_id=str(item.pk), source="batch", status=0)
        wait_for(lambda: _blocked_sessions() >= 1, 30, what="the worker to block inside its finish")
        frozen.signal(signal.SIGSTOP)  # frozen holding the item's row lock, idle in transaction
        transaction.set_rollback(True)
    try:
        monkeypatch.setenv("TEST_WORKER_LOGLEVEL", "INFO")  # its "warmed up" line
        second = workers("healthy", extra_env=FAST_RETRIES)
        started = time.monotonic()
        batch = native_batch(catalog, 20, content="<after>")
        wait_for(lambda: Batch.objects.get(pk=batch.pk).completed_at, 30, what="a new batch past the frozen worker")
        print(f"\nnew 20-item batch completed in {time.monotonic() - started:.1f} s beside a frozen worker")
        assert states(batch) == {"completed": 20}

        # 10% of items answered 500 on their first try; a few always answer 500.
        contents = [f"<item-{i}>" for i in range(100)] + [f"<always-{i}>" for i in range(5)]
        for i in range(0, 100, 10):
            fake.answer_when(f"<item-{i}>", Reply(status=500, body={"error": {"message": "server error"}}), times=1)
        fake.answer_when("<always-", Reply(status=500, body={"error": {"message": "still broken"}}))
        flaky = openai_batch(catalog, contents)

        # The frozen item is rescued once the database ends the frozen session, and finished by the healthy one.
        wait_for(lambda: Batch.objects.get(pk=first.pk).completed_at, 60, what="the frozen item")
        wait_for(lambda: status(flaky) == "completed", 120, what="the flaky batch")
        by_id = {i.custom_id: i for i in Item.objects.filter(batch_id=flaky.pk)}
        assert {by_id[f"r{i}"].state for i in range(100)} == {"completed"}
        retried = [by_id[f"r{i}"] for i in range(0, 100, 10)]
        assert all(Attempt.objects.filter(item=i, decision="retry").exists() for i in retried)
        for hopeless in [by_id[f"r{100 + i}"] for i in range(5)]:
            assert hopeless.state == "discarded" and hopeless.status_code == 500
            assert hopeless.retries == hopeless.max_attempts - 1
            decisions = list(
                Attempt.objects.filter(item=hopeless).order_by("number").values_list("decision", flat=True)
            )
            assert decisions.count("retry") == hopeless.max_attempts - 1 and decisions[-1] == "finish"
        assert_billed_once(flaky)

        # Every slot held: a lease owner is `host:pid:thread:drain`, the pid the item worker's own.
        fake.answer_when("<held>", Reply(hang=True))
        held = native_batch(catalog, 10, content="<held>")
        wait_for(lambda: fake.in_flight == 8, 30, what="8 held calls")
        owners = list(Item.objects.filter(batch=held, state="running").values_list("lease_owner", flat=True))
        assert len(owners) == 8
        assert {owner.split(":")[1] for owner in owners} == {str(second.proc.pid)}
        assert len({owner.split(":")[2] for owner in owners}) == 8
        log = Path(second.logs["worker"].name).read_text(errors="replace")
        assert log.count("worker process warmed up in") == 1, log[-3000:]
        assert "(failed:" not in log and log.index("warmed up") < log.index("ready."), log[-3000:]
        stop.cancel(Batch.objects.get(pk=held.pk))
        wait_for(lambda: Batch.objects.get(pk=held.pk).completed_at, 10, what="the cancelled batch")
    finally:
        frozen.signal(signal.SIGCONT)
    # The thawed worker retries its dead transaction: fenced out, it writes nothing. Its task has ended when
    # it leaves the broker (tasks are acknowledged late) and no session is busy any more.
    wait_for(lambda: broker_idle() and _busy_sessions() == 0, 30, what="the thawed worker's task to end")
    assert second.alive(), second.output()
    assert Item.objects.get(pk=item.pk).state == "completed"
    assert UsageEvent.objects.filter(request_id=str(item.pk)).count() == 1
    assert_billed_once(batch)


@pytest.mark.skipif(pg_cluster() is None, reason="needs root and the machine's own PostgreSQL cluster to restart")
@pytest.mark.alone  # every xdist worker's database goes down with the server
def test_work_resumes_promptly_after_a_postgresql_restart(workers, catalog, fake):
    # A production-length lease: stalling until it runs out would show as a timeout below.
    w = workers("pg-restart", extra_env={"RELAY_BATCH_LEASE_SECONDS": "60"})
    fake.answer_when("<steady>", Reply(delay=0.1))
    batch = native_batch(catalog, 400, content="<steady>")
    wait_for(lambda: states(batch).get("completed", 0) >= 80, 60, what="the batch to get going")
    restart_postgresql()
    back = time.monotonic()
    done_before = states(batch).get("completed", 0)
    wait_for(lambda: Batch.objects.get(pk=batch.pk).completed_at, 45, interval=0.5, what="the batch after the restart")
    resumed = time.monotonic() - back
    print(f"\n{400 - done_before} items left at the restart; the batch completed {resumed:.1f} s after it")
    assert w.alive(), w.output()
    assert states(batch) == {"completed": 400}
    assert_billed_once(batch)


def test_cancel_closes_the_running_calls_and_never_exceeds_8_per_worker(worker, catalog, fake):
    """The provider sees every running request's connection closed soon after a cancel (it stops
    generating billable tokens), and the freed slots start new work only after that."""
    w = worker
    fake.answer_when("<held>", Reply(hang=True))
    first = native_batch(catalog, 12, content="<held>")
    wait_for(lambda: fake.in_flight == 8, 30, what="8 held calls")
    stop.cancel(Batch.objects.get(pk=first.pk))
    cancelled = time.monotonic()
    wait_for(lambda: fake.in_flight == 0, 10, interval=0.05, what="the provider to see every call closed")
    print(f"\n8 running calls closed {time.monotonic() - cancelled:.1f} s after the cancel")
    assert fake.closed_by_client >= 8
    wait_for(lambda: Batch.objects.get(pk=first.pk).completed_at, 10, what="the cancelled batch")
    assert states(first) == {"cancelled": 12}
    second = native_batch(catalog, 10, content="<held>")
    wait_for(lambda: fake.in_flight == 8, 30, what="the next batch's calls")
    assert fake.max_in_flight <= 8
    stop.cancel(Batch.objects.get(pk=second.pk))
    wait_for(lambda: fake.in_flight == 0, 10, interval=0.05, what="the second batch's calls closed")
    assert w.alive(), w.output()
    assert not UsageEvent.objects.filter(batch_id=str(first.pk), status=200).exists()
