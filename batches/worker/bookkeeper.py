"""The worker process's database thread: heartbeats of every running item, and the final writes and
claims a drain hands over while its slot's item calls out (an item's finish and the next claim go
to PostgreSQL as one round trip: lifecycle.finish.HeldFinish; the results of the finishes it has in
hand are stored as one group, one object on s3: `FinalWrite`, `Bookkeeper._store_results`)."""

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from django.conf import settings
from django.db import connection, connections
from django.utils import timezone

from batches import storage
from batches.lifecycle import finish
from batches.models import Batch, Item, ItemState
from gateway import upstream

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


class FinalWrite:
    """An item's final write, as handed over: its result (batch id, item id, body; None for an item that
    ends without one) stored, then the fenced finish pointing at it. The bookkeeper stores the results of
    the writes it has in hand as one group (`write_results`) before running them; a write run alone stores
    its own (a group of one). A group that could not be stored fails each of its writes: no finish
    commits pointing at nothing, and the drain that waits on it raises (the item's lease runs out and the
    sweeper rescues it, as when a single write failed)."""

    __slots__ = ("finish", "result", "ref", "failed", "pairs_with_claim")

    def __init__(self, finish, result: tuple[str, str, bytes] | None):
        self.finish, self.result = finish, result
        self.ref: str | None = None
        self.failed: BaseException | None = None
        self.pairs_with_claim = False

    @property
    def unstored(self) -> bool:
        return self.result is not None and self.ref is None and self.failed is None

    def __call__(self) -> bool:
        if self.failed is not None:
            raise self.failed
        if self.unstored:
            batch_id, item_id, body = self.result
            self.ref = storage.write_result(batch_id, item_id, body)
        return self.finish(self.ref)


def write_results(writes: list[FinalWrite]) -> None:
    """Store the results of `writes` as one group per batch (one object on s3), before their finishes run;
    each write keeps its ref, or the error its group's store raised (it raises it when run)."""
    by_batch: dict[str, list[FinalWrite]] = {}
    for write in writes:
        if write.unstored:
            by_batch.setdefault(write.result[0], []).append(write)
    for batch_id, members in by_batch.items():
        try:
            with storage.result_group(batch_id) as group:
                refs = [group.add(item_id, body) for _, item_id, body in (w.result for w in members)]
        except Exception as exc:  # handed to each write's waiter: the drain re-raises it
            log.warning("batch %s: %d results could not be stored", batch_id, len(members), exc_info=True)
            for write in members:
                write.failed = exc
            continue
        for write, ref in zip(members, refs, strict=True):
            write.ref = ref


def groups_pay() -> bool:
    """Whether storing the results in hand as one group saves anything: a statement per result on `db`, a
    PUT on `s3`. On `dir` a result is one append either way, so each write stores its own when it runs
    and the bookkeeper does not gather the jobs queued behind it (nor sort them by batch) first."""
    return storage.backend() != "dir"


# At most this many results in one group of the bookkeeper's (a round's object: ~GROUP_MAX × the result size).
GROUP_MAX = 256


class Bookkeeper:
    """The worker process's database thread: it beats every registered item each interval, and runs
    what the drain hands it (`submit`), in order, while the slot's item calls out: each item's final
    write (the result file, the fenced finish and its usage event) and the claim of the slot's next item
    (`_Ahead`). One thread and one database connection per process, beside the slot's own.

    Measured (py-spy, wall time of the 8 slots draining at 100 ms upstream latency): the finish was
    2.6 ms of each slot's 8.4 ms between two upstream calls, time in which its next call could have
    been in flight; handed over, the slot goes straight to its next claim.

    The results of the final writes in hand are stored together before the first of them runs
    (`_store_results`): on s3 one object per batch and round, not a PUT per result.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.beats: set[Heartbeat] = set()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.backlog: deque = deque()  # jobs taken from `jobs` ahead of their turn (_store_results), in order
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

    def _take(self, timeout: float):
        """The next job in order: from the backlog (jobs taken early to group their results), else the queue."""
        if self.backlog:
            return self.backlog.popleft()
        try:
            return self.jobs.get(timeout=timeout)
        except queue.Empty:
            return None

    def _store_results(self, job: tuple) -> None:
        """`job` is a final write whose result is not stored yet: gather the jobs queued behind it into the
        backlog (on s3, also those handed over within storage.result_group_wait(), up to GROUP_MAX
        results), and store the results of all of them as one group per batch before any runs. Jobs still
        run one by one, in order; only their results' writes are made together."""
        wait = storage.result_group_wait()
        deadline = time.monotonic() + wait
        count = 1 + sum(1 for _, fn in self.backlog if getattr(fn, "unstored", False))
        while count < GROUP_MAX:
            left = deadline - time.monotonic()
            try:
                taken = self.jobs.get(timeout=left) if left > 0 else self.jobs.get_nowait()
            except queue.Empty:
                break
            self.backlog.append(taken)
            count += getattr(taken[1], "unstored", False)
        write_results([job[1], *(fn for _, fn in self.backlog if getattr(fn, "unstored", False))])

    def _run(self) -> None:
        interval = settings.RELAY_BATCH_HEARTBEAT_SECONDS
        last_beat = time.monotonic()
        next_beat = last_beat + interval
        following = None  # a job taken while looking for a claim to pair a finish with
        while True:
            # Nothing may end this thread: a drain waits on the writes it was handed.
            try:
                if following is not None:
                    job, following = following, None
                else:
                    job = self._take(max(0.0, next_beat - time.monotonic()))
                if job is not None and getattr(job[1], "unstored", False) and groups_pay():
                    try:
                        self._store_results(job)
                    except Exception:  # each write stores its own result when it runs
                        log.exception("batch bookkeeper: results not stored as a group")
                if job is not None and getattr(job[1], "pairs_with_claim", False):
                    # A slot hands over its item's finish and, a moment later, the claim of its next
                    # item but one (`_Ahead`): sent as one query string they cost one round trip.
                    following = self._take(PAIR_WAIT_S)
                    if following is not None and getattr(following[1], "takes_a_finish", False):
                        _run_pair(job, following)
                        job = following = None
                if job is not None:
                    _run_job(*job)
                if settings.RELAY_BATCH_HEARTBEAT_SECONDS != interval:  # changed in this process: `rescheduled`
                    interval = settings.RELAY_BATCH_HEARTBEAT_SECONDS
                    next_beat = last_beat + interval
                if time.monotonic() >= next_beat:
                    last_beat = time.monotonic()
                    next_beat = last_beat + interval
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
            _instance.beats, _instance.jobs, _instance.backlog = old.beats, old.jobs, old.backlog
        return _instance


def rescheduled(setting=None, **kwargs) -> None:
    """RELAY_BATCH_HEARTBEAT_SECONDS changed in this process (override_settings; Django's setting_changed,
    connected by the batches app): the thread, which may be waiting out the old interval (an hour, set by a
    test that wanted no beat), is woken to count from its last beat with the new one."""
    keeper = _instance
    if setting == "RELAY_BATCH_HEARTBEAT_SECONDS" and keeper is not None and keeper.pid == os.getpid():
        keeper.submit(lambda: None)


def close_bookkeeper() -> None:
    """Close the bookkeeper thread's database connection, if this process has one (its end)."""
    keeper = _instance
    if keeper is not None and keeper.pid == os.getpid():
        keeper.submit(lambda: connection.close()).result(timeout=finish.DURABLE_SECONDS)


def hand_over() -> Callable[[Callable[[], object]], Future]:
    """Where the drain's final writes run: the bookkeeper's thread on PostgreSQL, in line on SQLite."""
    return bookkeeper().submit if connection.vendor == "postgresql" else inline
