"""The worker process's database thread: heartbeats of every running item, and the final writes and
claims a drain hands over while its slot's item calls out (an item's finish and the next claim go
to PostgreSQL as one round trip: lifecycle.finish.HeldFinish)."""

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from django.conf import settings
from django.db import connection, connections
from django.utils import timezone

from batches.lifecycle import finish
from batches.models import Batch, Item, ItemState
from relay import upstream

log = logging.getLogger(__name__)


class Heartbeat:
    """Renews the item's lease and reads the batch's cancel flag every few seconds.

    Cancel goes through the database, so a cancel received by any replica
    reaches the item wherever it runs. Losing the lease (the sweeper gave the
    item to someone else) stops the call too. The beats come from one thread
    per worker process (`Bookkeeper`) with one long-lived database connection,
    not a thread and a fresh connection per item.
    """

    def __init__(self, item: Item):
        self.item = item
        self.stop_reason: str | None = None

    def __enter__(self):
        bookkeeper().register(self)
        return self

    def __exit__(self, *exc):
        bookkeeper().unregister(self)

    def should_stop(self) -> bool:
        return self.stop_reason is not None

    def beat(self) -> None:
        lease = timezone.now() + timezone.timedelta(seconds=settings.RELAY_BATCH_LEASE_SECONDS)
        reason = self._renew(lease)
        if reason is not None:
            self.stop_reason = reason
            upstream.poke()  # the call in flight stops now, not at the watchdog's next poll

    def _renew(self, lease) -> str | None:
        """Renew the lease, fenced on the claim: why the item must stop ("lease_lost", "cancelled"), or None."""
        item = self.item
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(_BEAT_SQL, [lease, item.pk, item.lease_owner, item.attempt])
                row = cursor.fetchone()
            if row is None:
                return "lease_lost"
            return "cancelled" if row[0] else None
        renewed = Item.objects.filter(
            pk=item.pk, state=ItemState.RUNNING, lease_owner=item.lease_owner, attempt=item.attempt
        ).update(lease_expires_at=lease)
        if not renewed:
            return "lease_lost"
        if Batch.objects.filter(pk=item.batch_id, cancel_requested_at__isnull=False).exists():
            return "cancelled"
        return None


# One statement per beat: renew the lease, fenced on the claim, and read the batch's cancel flag (no row:
# the lease was lost). Was an ORM UPDATE and an ORM EXISTS, compiled at every beat: 3% of the worker's
# samples at 100 ms upstream latency.
_BEAT_SQL = """
UPDATE batches_item i SET lease_expires_at = %s
WHERE i.id = %s AND i.state = 'running' AND i.lease_owner = %s AND i.attempt = %s
RETURNING (SELECT b.cancel_requested_at IS NOT NULL FROM batches_batch b WHERE b.id = i.batch_id)
"""


class Bookkeeper:
    """The worker process's database thread: it beats every registered item each interval, and runs
    what the drain hands it (`submit`), in order, while the slot's item calls out: each item's final
    write (the result file, the fenced finish and its usage event) and the claim of the slot's next item
    (`_Ahead`). One thread and one database connection per process, beside the slot's own.

    Measured (py-spy, wall time of the 8 slots draining at 100 ms upstream latency): the finish was
    2.6 ms of each slot's 8.4 ms between two upstream calls, time in which its next call could have
    been in flight; handed over, the slot goes straight to its next claim.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.beats: set[Heartbeat] = set()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self._run, name="batch-bookkeeper", daemon=True)
        self.thread.start()

    def register(self, hb: Heartbeat) -> None:
        with self.lock:
            self.beats.add(hb)

    def unregister(self, hb: Heartbeat) -> None:
        with self.lock:
            self.beats.discard(hb)

    def submit(self, fn: Callable[[], object]) -> Future:
        future: Future = Future()
        self.jobs.put((future, fn))
        return future

    def _run(self) -> None:
        next_beat = time.monotonic() + settings.RELAY_BATCH_HEARTBEAT_SECONDS
        following = None  # a job taken while looking for a claim to pair a finish with
        while True:
            # Nothing may end this thread: a drain waits on the writes it was handed.
            try:
                if following is not None:
                    job, following = following, None
                else:
                    try:
                        job = self.jobs.get(timeout=max(0.0, next_beat - time.monotonic()))
                    except queue.Empty:
                        job = None
                if job is not None and getattr(job[1], "pairs_with_claim", False):
                    # A slot hands over its item's finish and, a moment later, the claim of its next
                    # item but one (`_Ahead`): sent as one query string they cost one round trip.
                    try:
                        following = self.jobs.get(timeout=PAIR_WAIT_S)
                    except queue.Empty:
                        pass
                    if following is not None and getattr(following[1], "takes_a_finish", False):
                        _run_pair(job, following)
                        job = following = None
                if job is not None:
                    _run_job(*job)
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + settings.RELAY_BATCH_HEARTBEAT_SECONDS
                    self._beat()
            except Exception:
                log.exception("batch bookkeeper: unexpected error; going on")
                time.sleep(0.1)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def _beat(self) -> None:
        with self.lock:
            current = [hb for hb in self.beats if not hb.should_stop()]
        if not current:
            # Idle: the connection is given back once it is CONN_MAX_AGE old (as a request's is), or
            # after an error. Read from the wrapper, not `close_if_unusable_or_obsolete`, which connects
            # first (and under the test suite's database blocker raises between tests).
            conn = connections["default"]
            if self.jobs.empty() and conn.connection is not None:
                if conn.errors_occurred or (conn.close_at is not None and time.monotonic() >= conn.close_at):
                    conn.close()
            return
        for hb in current:
            try:
                hb.beat()
            except Exception:  # a failed beat is retried next interval, on a new connection; the lease has slack
                log.warning("heartbeat failed for item %s", hb.item.pk, exc_info=True)
                connection.close()


def _run_job(future: Future, fn: Callable[[], object]) -> None:
    if future.set_running_or_notify_cancel():
        _settle_future(future, _outcome(fn))


# How long the bookkeeper waits, after taking an item's finish, for a claim to send with it. The slot
# hands the claim over within ~0.1 ms of CPU after the finish; the wait only delays a finish that no
# claim follows (the drain's last items), never a slot.
PAIR_WAIT_S = 0.005


def _run_pair(finish_job: tuple, claim_job: tuple) -> None:
    """An item's finish and a claim, in one round trip (finish.HeldFinish): the finish is built and
    held, then goes in front of the claim's statement. If the pair's statement did not commit (the
    claim failed, or never reached its statement), the finish is made on its own, through `durably`.
    The finish's future is settled before the claim's: a claim's waiter also waits on the writes
    handed over before it."""
    (f_future, f_fn), (c_future, c_fn) = finish_job, claim_job
    if not f_future.set_running_or_notify_cancel():
        _run_job(c_future, c_fn)
        return
    with finish.holding_finish() as held:
        made = _outcome(f_fn)
    if not made[0] or held.execute is None:  # it failed, or nothing was held (it ran in f_fn)
        _settle_future(f_future, made)
        _run_job(c_future, c_fn)
        return
    claim_ran = c_future.set_running_or_notify_cancel()
    if claim_ran:
        with finish.in_front_of_claim(held):
            claim_outcome = _outcome(c_fn)
    _settle_future(f_future, made if held.sent else _outcome(held.write))
    if claim_ran:
        _settle_future(c_future, claim_outcome)


def _outcome(fn: Callable[[], object]) -> tuple[bool, object]:
    """(True, what `fn` returned) or (False, what it raised)."""
    try:
        return True, fn()
    except BaseException as exc:  # handed to whoever waits on the future (the drain re-raises it)
        return False, exc


def _settle_future(future: Future, outcome: tuple[bool, object]) -> None:
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def inline(fn: Callable[[], object]) -> Future:
    """`submit` for SQLite (embedded mode), which serialises writers: the write runs at once, here."""
    future: Future = Future()
    _run_job(future, fn)
    return future


_instance: Bookkeeper | None = None
_instance_lock = threading.Lock()


def bookkeeper() -> Bookkeeper:
    """One per process; a prefork child gets its own (threads do not survive fork)."""
    global _instance
    with _instance_lock:
        old = _instance
        if old is None or old.pid != os.getpid():
            _instance = Bookkeeper()
        elif not old.alive():  # cannot happen (`_run` ends on nothing); if it did, a new thread takes its work
            log.error("batch bookkeeper thread ended; starting another")
            _instance = Bookkeeper()
            _instance.beats, _instance.jobs = old.beats, old.jobs
        return _instance


def close_bookkeeper() -> None:
    """Close the bookkeeper thread's database connection, if this process has one (its end)."""
    keeper = _instance
    if keeper is not None and keeper.pid == os.getpid():
        keeper.submit(lambda: connection.close()).result(timeout=finish.DURABLE_SECONDS)


def hand_over() -> Callable[[Callable[[], object]], Future]:
    """Where the drain's final writes run: the bookkeeper's thread on PostgreSQL, in line on SQLite."""
    return bookkeeper().submit if connection.vendor == "postgresql" else inline
