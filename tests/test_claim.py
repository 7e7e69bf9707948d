"""The claim (batches.lifecycle.claim) step by step: fairness, the drain's floor, the batch's first claim,
the pending probe and the wake-up that a drain passes on. No worker process; nothing is timed."""

import io
import json

import pytest
from django.utils import timezone

from batches import dispatch
from batches.lifecycle import claim as claims
from batches.lifecycle import finish as finishing
from batches.lifecycle import sql as lsql
from batches.lifecycle import stop
from batches.models import Batch, Item
from batches.surfaces.native import submit
from batches.worker import bookkeeper as keeper
from batches.worker import drain as draining
from batches.worker import warmup
from core import auth

pytestmark = pytest.mark.django_db(transaction=True)


def native_batch(catalog, n):
    principal = auth.principal_for_key(catalog.key)
    body = {"shape": "openai", "requests": [{"model": "gpt-4o", "messages": []}] * n}
    return submit.submit_native(principal, io.BytesIO(json.dumps(body).encode()))


def _nothing():
    pass


def test_the_first_claim_starts_a_native_batch_and_takes_items_in_order(catalog):
    batch = native_batch(catalog, 3)
    assert Batch.objects.get(pk=batch.pk).status == "queued"
    first = claims.claim("a")
    assert (first.batch_id, first.idx, first.state, first.attempt) == (batch.pk, 0, "running", 1)
    assert Batch.objects.get(pk=batch.pk).status == "running"
    assert claims.claim("b").idx == 1


def test_the_batch_with_fewest_running_items_goes_first(catalog):
    large = native_batch(catalog, 10)
    held = [claims.claim("large") for _ in range(3)]
    assert {i.batch_id for i in held} == {large.pk}
    small = native_batch(catalog, 2)
    assert claims.claim("x").batch_id == small.pk  # 0 running against 3
    assert claims.claim("y").batch_id == small.pk  # 1 against 3
    assert claims.claim("z").batch_id == large.pk  # 2 against 3, but the small one has none left


def test_a_paused_batch_is_skipped(catalog):
    paused = native_batch(catalog, 2)
    Batch.objects.filter(pk=paused.pk).update(not_before=timezone.now() + timezone.timedelta(hours=1))
    other = native_batch(catalog, 1)
    assert claims.claim("a").batch_id == other.pk
    assert claims.claim("b") is None


def test_an_item_released_behind_the_drains_floor_is_still_claimed(catalog):
    batch = native_batch(catalog, 3)
    first = claims.claim("a")
    second = claims.claim("a", (first.batch_id, first.idx))
    assert second.idx == 1
    # The first item goes back to available (a retry due now), below the floor of the next claim.
    assert finishing.release_item(first, timezone.now(), _nothing, counts=True, pause_batch=False)
    third = claims.claim("a", (second.batch_id, second.idx))
    assert third.idx == 2
    again = claims.claim("a", (third.batch_id, third.idx))  # nothing at or past idx 2: the floorless pass
    assert (again.pk, again.attempt) == (first.pk, 2)
    assert claims.claim("a", (batch.pk, 2)) is None


def test_an_item_waiting_out_its_backoff_is_not_claimed(catalog):
    native_batch(catalog, 1)
    item = claims.claim("a")
    later = timezone.now() + timezone.timedelta(hours=1)
    assert finishing.release_item(item, later, _nothing, counts=True, pause_batch=False)
    assert claims.claim("b") is None
    Item.objects.filter(pk=item.pk).update(not_before=timezone.now())
    assert claims.claim("b").pk == item.pk


def test_pending_items_are_seen_running_or_available(catalog):
    batch = native_batch(catalog, 2)
    assert stop.has_pending_items(batch.pk)
    a, b = claims.claim("a"), claims.claim("b")
    assert stop.has_pending_items(batch.pk)  # running only
    finishing.finish_item(a, "completed", _nothing)
    assert stop.has_pending_items(batch.pk)
    finishing.finish_item(b, "completed", _nothing)
    assert not stop.has_pending_items(batch.pk)
    assert Batch.objects.get(pk=batch.pk).status == "completed"


def test_claimable_work_follows_pauses_and_backoffs(catalog):
    assert not dispatch.has_claimable_work()
    batch = native_batch(catalog, 1)
    assert dispatch.has_claimable_work()
    Batch.objects.filter(pk=batch.pk).update(not_before=timezone.now() + timezone.timedelta(hours=1))
    assert not dispatch.has_claimable_work()


def test_a_drain_that_finds_work_passes_wake_ups_on(catalog):
    from relay.celery import app

    with app.connection_or_acquire() as conn:
        conn.default_channel.queue_purge(dispatch.ITEM_QUEUE)
    try:
        assert dispatch.pass_on() is True
        assert dispatch.queue_length(dispatch.ITEM_QUEUE) == dispatch.PASS_ON == 2  # idle slots fill doubling
        assert dispatch.pass_on() is False  # some are waiting: no more
        assert dispatch.queue_length(dispatch.ITEM_QUEUE) == 2
    finally:
        with app.connection_or_acquire() as conn:
            conn.default_channel.queue_purge(dispatch.ITEM_QUEUE)


def test_queue_length_reads_what_the_broker_holds_at_every_priority(catalog):
    """queue_length reads a Redis broker's keys directly: it must count what kombu's own passive
    queue_declare counts, a message sent with a priority (another key) included."""
    from relay.celery import app

    queue = "test-queue-length"
    with app.connection_or_acquire() as conn:
        conn.default_channel.queue_purge(queue)
    try:
        assert dispatch.queue_length(queue) == 0
        app.send_task("batches.tasks.run_items", queue=queue)
        app.send_task("batches.tasks.run_items", queue=queue, priority=5)
        with app.connection_or_acquire() as conn:
            kombu_count = conn.default_channel.queue_declare(queue=queue, passive=True).message_count
        assert dispatch.queue_length(queue) == kombu_count == 2
    finally:
        with app.connection_or_acquire() as conn:
            conn.default_channel.queue_purge(queue)


def test_a_worker_process_warms_up_before_its_first_item(catalog, monkeypatch):
    """warmup.warm_up (each Celery pool process, at start): the claim statements are prepared on the
    process's connection; a step that fails is logged and left to the first item, never raised."""
    from django.db import connection

    native_batch(catalog, 1)
    warmup.warm_up()
    assert {"relay_claim_fairest", "relay_claim_in_batch"} <= lsql.prepared_on[connection.connection]
    assert claims.claim("warm").idx == 0

    def down():
        raise OSError("database down")

    monkeypatch.setattr(claims, "warm_up", down)
    warmup.warm_up()


def test_a_heartbeat_renews_the_lease_and_reads_cancel_in_one_statement(catalog):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    batch = native_batch(catalog, 2)
    item = claims.claim("beater")
    before = Item.objects.get(pk=item.pk).lease_expires_at
    hb = keeper.Heartbeat(item)
    with CaptureQueriesContext(connection) as ctx:
        hb.beat()
    assert len(ctx.captured_queries) == 1 and hb.stop_reason is None
    assert Item.objects.get(pk=item.pk).lease_expires_at >= before

    Batch.objects.filter(pk=batch.pk).update(cancel_requested_at=timezone.now())
    hb.beat()
    assert hb.stop_reason == "cancelled"

    other = claims.claim("beater")
    Item.objects.filter(pk=other.pk).update(lease_owner="someone-else")  # the sweeper gave it away
    lost = keeper.Heartbeat(other)
    lost.beat()
    assert lost.stop_reason == "lease_lost"


def test_the_claim_walks_item_available_in_idx_order_whatever_the_statistics(catalog):
    """The prepared claim is planned without a sort of the batch's items: on stale statistics (no ANALYZE
    since the items were written, autovacuum off) a planner left to itself reads every available item
    of the batch through item_batch_state and sorts them at every claim."""
    from django.db import connection

    batch = native_batch(catalog, 300)
    claims.warm_up()
    _, _, execute, _, _ = claims._CLAIM_STATEMENTS[claims._CLAIM_FAIREST_SQL]
    now = timezone.now()
    params = {"owner": "x", "now": now, "lease": now, "floor_batch": batch.pk, "floor": 10, "check": batch.pk}
    params["async_commit"] = True
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + execute, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "Index Scan using item_available" in plan, plan
    # The pick never reads the batch's available items through item_batch_state (then sorts them). The
    # completion check may probe it for a delegated item (one index entry at most): that is not the pick.
    lines = plan.splitlines()
    for i, line in enumerate(lines):
        if "item_batch_state" in line:
            cond = lines[i + 1] if i + 1 < len(lines) else ""
            assert "'available'" not in cond and "available" not in line, plan


# --- claiming ahead (batches.draining._Ahead): the next item, claimed while the current one calls out ---


def test_a_drain_that_claims_ahead_runs_every_item_once_and_completes_the_batch(catalog, fake, settings, monkeypatch):
    from usage.models import UsageEvent

    monkeypatch.setattr(dispatch, "pass_on", lambda: False)
    monkeypatch.setattr(dispatch, "wake_workers", lambda known_work=False: 0)
    settings.RELAY_BATCH_CLAIM_AHEAD_MIN_LEFT = 1  # claim ahead up to the batch's second-to-last item
    monkeypatch.setattr(draining, "CLAIM_AHEAD_MAX_ITEM_S", 3600)  # however slow this machine is
    taken = []
    real = draining._Ahead.take
    monkeypatch.setattr(draining._Ahead, "take", lambda self: taken.append(1) or real(self))
    batch = native_batch(catalog, 12)
    assert draining.drain(max_items=5) == 5
    assert draining.drain() == 7
    # Claimed ahead: after each drain's first item (how long an item runs is not known before), while
    # the budget has room for one more (items 2-4 of the first drain) and more than one item follows.
    assert len(taken) == 3 + 4
    batch.refresh_from_db()
    assert batch.status == "completed"
    items = Item.objects.filter(batch=batch)
    assert {i.state for i in items} == {"completed"} and {i.attempt for i in items} == {1}
    assert len(fake.received) == 12
    assert UsageEvent.objects.filter(batch_id=str(batch.pk)).count() == 12


def ahead_claim(owner="ahead"):
    from collections import deque

    ahead = draining._Ahead(keeper.bookkeeper().submit, owner, None, deque())
    ahead.future.result(timeout=30)
    return ahead


def test_an_item_claimed_ahead_keeps_its_lease_while_it_waits(catalog):
    native_batch(catalog, 2)
    ahead = ahead_claim()
    item = ahead.future.result()
    assert ahead.hb in keeper.bookkeeper().beats  # the bookkeeper renews it with the running items
    assert ahead.take() == item
    assert ahead.hb not in keeper.bookkeeper().beats  # run_item beats it from here on


def test_an_item_claimed_ahead_whose_batch_is_cancelled_meanwhile_is_never_sent(catalog, fake):
    batch = native_batch(catalog, 2)
    ahead = ahead_claim()
    stop.cancel(Batch.objects.get(pk=batch.pk))
    ahead.hb.beat()  # what the bookkeeper does every RELAY_BATCH_HEARTBEAT_SECONDS
    assert ahead.take() is draining._Ahead.RELEASED
    assert {i.state for i in Item.objects.filter(batch=batch)} == {"cancelled"}
    assert fake.received == []


def test_an_item_claimed_ahead_that_lost_its_lease_is_left_to_its_new_owner(catalog):
    native_batch(catalog, 2)
    ahead = ahead_claim()
    item = ahead.future.result()
    Item.objects.filter(pk=item.pk).update(lease_owner="someone-else")  # the sweeper gave it away
    ahead.hb.beat()
    assert ahead.take() is draining._Ahead.RELEASED
    assert Item.objects.get(pk=item.pk).lease_owner == "someone-else"


def test_a_drain_that_stops_on_an_error_hands_back_what_it_claimed_ahead(catalog):
    native_batch(catalog, 2)
    ahead = ahead_claim()
    item = ahead.future.result()
    ahead.abandon()
    assert ahead.hb not in keeper.bookkeeper().beats  # no heartbeat keeps its lease alive
    row = Item.objects.get(pk=item.pk)
    assert (row.state, row.lease_owner, row.retries) == ("available", "", 0)  # no attempt used up


def test_the_bookkeeper_thread_outlives_errors(catalog, django_db_blocker):
    thread = keeper.bookkeeper()
    failed = thread.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=30)  # handed to whoever waits for it (a drain re-raises it)
    thread.submit(lambda: Item.objects.count()).result(timeout=30)  # its connection is open
    with django_db_blocker.block():  # as between two tests: connecting raises
        # Idle (no item to beat): it may close its connection, and must not connect to decide.
        thread.submit(thread._beat).result(timeout=30)
    assert thread.submit(lambda: "still here").result(timeout=30) == "still here"
    assert thread.alive() and keeper.bookkeeper() is thread


def test_the_bookkeeper_beats_on_the_interval_set_after_an_hour_long_one(catalog, settings):
    """A test that wants no beat sets the interval to an hour; the thread, asleep until then, must beat on
    the interval set after it (restored, or made short) rather than an hour later: each change wakes it."""
    import threading

    beaten = threading.Event()

    class Witness:  # a registrant of the bookkeeper's, as a Heartbeat is
        def should_stop(self) -> bool:
            return False

        def beat(self) -> None:
            beaten.set()

    thread, witness = keeper.bookkeeper(), Witness()
    settings.RELAY_BATCH_HEARTBEAT_SECONDS = 3600
    thread.register(witness)
    try:
        # A thread that does not see the change beats once more at the old interval (2 s) and schedules
        # the next an hour away; one that does waits the hour from its last beat. Either way, then:
        beaten.wait(2.5)
        beaten.clear()
        settings.RELAY_BATCH_HEARTBEAT_SECONDS = 0.1
        assert beaten.wait(30), "the bookkeeper waited out the hour-long interval"
    finally:
        thread.unregister(witness)


def test_a_claim_commits_without_waiting_for_the_disk_and_the_finish_waits(catalog):
    """The claim's own transaction runs with synchronous_commit off; nothing else does. Seen from inside
    one transaction (a claim and SHOW in the same one), and from the session after it."""
    from django.db import connection, transaction

    batch = native_batch(catalog, 2)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on"
        assert claims.claim("a").batch_id == batch.pk
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "off"
    item = claims.claim("b")  # autocommit, as a drain claims
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on"  # set for the claim's transaction only: the finish waits
    assert finishing.finish_item(item, "completed", _nothing, check_done=False)
    assert Item.objects.get(pk=item.pk).state == "completed"


# --- an item's finish sent in front of the next claim (keeper._run_pair, finishing.HeldFinish) ---


def held_finish(item, state="completed"):
    with finishing.holding_finish() as held:
        assert finishing.finish_item_at_once(item, state, [], check_done=False) is None  # built, not run
    assert held.execute is not None and not held.sent
    return held


def test_a_finish_and_the_next_claim_go_as_one_statement_that_waits_for_the_disk(catalog):
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    batch = native_batch(catalog, 3)
    first = claims.claim("a")
    held = held_finish(first)
    assert Item.objects.get(pk=first.pk).state == "running"
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        with finishing.in_front_of_claim(held):
            second = claims.claim("a", (first.batch_id, first.idx), check=batch.pk)
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            assert cursor.fetchone()[0] == "on"  # the pair's commit waits for the disk, for the finish
    statements = [q["sql"] for q in queries.captured_queries if "EXECUTE relay_" in q["sql"]]
    assert len(statements) == 1 and "relay_finish_" in statements[0] and "relay_claim_fairest" in statements[0]
    assert held.sent and second.idx == 1
    assert Item.objects.get(pk=first.pk).state == "completed"
    assert Item.objects.get(pk=second.pk).state == "running"


def _pair(finish_fn, claim_fn):
    from concurrent.futures import Future

    f, c = Future(), Future()
    keeper._run_pair((f, finish_fn), (c, claim_fn))
    return f, c


def test_a_pair_whose_statement_fails_makes_the_finish_on_its_own(catalog):
    """The pair is one transaction: when the claim part fails (here a lease owner longer than its
    column), nothing of it is written, and the finish is then made alone."""
    from django.db import DataError

    native_batch(catalog, 3)
    first = claims.claim("a")
    f, c = _pair(
        lambda: finishing.finish_item_at_once(first, "completed", [], check_done=False),
        lambda: claims.claim("x" * 200),
    )
    assert f.result() is True  # made alone: its fence's answer is known again
    with pytest.raises(DataError):
        c.result()
    assert Item.objects.get(pk=first.pk).state == "completed"
    assert Item.objects.filter(state="running").count() == 0  # the failed claim took nothing


def test_a_pair_whose_claim_fails_before_its_statement_makes_the_finish_on_its_own(catalog):
    native_batch(catalog, 2)
    first = claims.claim("a")
    f, c = _pair(lambda: finishing.finish_item_at_once(first, "completed", [], check_done=False), lambda: 1 / 0)
    assert f.result() is True
    with pytest.raises(ZeroDivisionError):
        c.result()
    assert Item.objects.get(pk=first.pk).state == "completed"


def test_a_pair_that_claims_in_another_batch_checks_the_finished_one_after_its_commit(catalog, monkeypatch):
    """The claim shares the pair's snapshot, taken before the finish (and any other process's finish
    beside it) committed, so what it says of the finished item's batch may be stale: when it claims
    elsewhere, the batch is checked again once the pair committed (here: its other item is running)."""
    done = native_batch(catalog, 2)
    mine, theirs = claims.claim("a"), claims.claim("b")
    other = native_batch(catalog, 2)
    checked = []
    real = stop.complete_if_done
    monkeypatch.setattr(stop, "complete_if_done", lambda batch_id: checked.append(batch_id) or real(batch_id))
    f, c = _pair(
        lambda: finishing.finish_item_at_once(mine, "completed", [], check_done=False),
        lambda: claims.claim("a", (mine.batch_id, mine.idx), check=done.pk),
    )
    assert f.result() is None and c.result().batch_id == other.pk  # sent together
    assert checked == [done.pk]
    assert finishing.finish_item(theirs, "completed", _nothing, check_done=False)
    assert stop.complete_if_done(done.pk)
