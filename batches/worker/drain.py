"""The worker loop: one Celery task drains items in one of the worker's slots, claiming the next
item ahead on the bookkeeper thread while the current one calls out."""

import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection
from django.utils import timezone

from batches import dispatch, storage
from batches.lifecycle import claim, finish, stop
from batches.models import Item
from batches.worker.bookkeeper import Heartbeat, bookkeeper, hand_over, inline
from batches.worker.execute import batch_of, nothing, run_item
from policies import lua

log = logging.getLogger(__name__)

DATABASE_ERRORS = (OperationalError, InterfaceError)


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


def drain(max_items: int = 500, max_seconds: float = 120.0) -> int:
    """Claim and run items until none is claimable or the budget is used; then hand over.

    One Celery task runs this loop in one of the worker's 8 slots. When the
    budget ends with work left, it queues a wake-up so the slot is reused
    without waiting for the sweeper.

    The database work around an item's call runs beside it, on the process's bookkeeper thread
    (`bookkeeper.hand_over`): the item's final write, and the claim of the next item (`_Ahead`) while its batch
    has more than RELAY_BATCH_CLAIM_AHEAD_MIN_LEFT items after this one. So a slot goes from one
    upstream call to the next without a database round trip in between. A batch's completion is
    checked by the first claim made after its item's write committed (`claim(check=…)`: no statement
    of its own), and for what is left, when the drain ends. The bookkeeper sends an item's finish in
    front of the claim handed over right behind it, as one round trip (`_run_pair`); such a claim,
    sharing the finish's transaction, checks again after the commit when it claims elsewhere.

    An item's success settle goes to Redis with the next item's key pick (`lua.deferring`), and the
    batch's input file stays open for the drain (`storage.read_input`).
    """
    with lua.deferring():
        try:
            return _drain(max_items, max_seconds)
        finally:
            storage.close_inputs()


def _drain(max_items: int, max_seconds: float) -> int:
    owner = f"{worker_id()}:{uuid.uuid4().hex[:8]}"
    handed = hand_over()
    started, done, floor = time.monotonic(), 0, None
    writes: deque = deque()  # (future, batch id) of the final writes handed over, oldest first
    ahead: _Ahead | None = None
    last_item_s = None  # how long the drain's previous item ran

    def budget_left(items: int) -> bool:
        return done + items <= max_items and time.monotonic() - started < max_seconds

    try:
        while ahead is not None or budget_left(1):
            try:
                if ahead is not None:
                    taken, ahead = ahead, None
                    item = taken.take()
                else:
                    item = _claim_after(owner, floor, writes)
            except DATABASE_ERRORS:
                # The database went away (a restart): give the slot back; the next sweep or wake-up
                # resumes. (A completion check left unmade is the sweeper's: `unfinished_batches`.)
                log.warning("claim failed: the database is unavailable", exc_info=True)
                connection.close()
                _settle(writes)
                return done
            if item is None:
                _settle(writes)
                return done
            if item is _Ahead.RELEASED:
                continue
            if done == 0:
                dispatch.pass_on()  # there is work: wake more slots, on whichever worker is idle
            floor = (item.batch_id, item.idx)
            if handed is not inline and budget_left(2) and _claim_ahead_worth_it(item, last_item_s):
                ahead = _Ahead(handed, owner, floor, writes)
            item_started = time.monotonic()
            try:
                write = run_item(item, check_done=False, hand_over=handed)
            except DATABASE_ERRORS:
                # Mid-item (not while finishing: that retries by itself). Hand the item back rather than
                # leave it running until its lease runs out; this claim never called out or was not recorded.
                log.warning("item %s: the database went away mid-item; releasing it", item.pk, exc_info=True)
                connection.close()
                finish.release_item(item, timezone.now(), nothing, counts=False, pause_batch=False)
            else:
                if write is not None:
                    writes.append((write, item.batch_id))
            done += 1
            last_item_s = time.monotonic() - item_started
    except BaseException:
        if ahead is not None:  # claimed for this slot, which will not run it
            ahead.abandon()
        raise
    _settle(writes)
    dispatch.wake_workers(known_work=True)  # the budget ended with work left: hand the slot over
    return done


def _claim_after(owner: str, floor, writes: deque) -> Item | None:
    """The slot's own claim. It checks the completion of the batches whose handed-over writes have
    committed: all but the newest (made during the item just run: usually long done, waited for if not)."""
    return _claim_checking(owner, floor, _committed(writes, keep=1))


def _claim_checking(owner: str, floor, batches: list) -> Item | None:
    """Claim, checking the completion of `batches` (their writes have committed): the last one by the
    claim itself, any others first (the drain moved between batches: a claim checks only one)."""
    for batch_id in batches[:-1]:
        stop.complete_if_done(batch_id)
    return claim.claim(owner, floor, batches[-1] if batches else None)


# Claiming ahead saves the slot a claim's round trip (~2.5 ms measured at 100 ms upstream latency) per
# item; after a call of this long or longer that is not worth an item held back from another slot.
CLAIM_AHEAD_MAX_ITEM_S = 0.5


def _claim_ahead_worth_it(item: Item, last_item_s: float | None) -> bool:
    """Claim ahead after a short item (the drain's previous one: none for its first), far from the
    batch's end (RELAY_BATCH_CLAIM_AHEAD_MIN_LEFT items after this one, by index: an upper bound on
    those still unclaimed)."""
    if last_item_s is None or last_item_s >= CLAIM_AHEAD_MAX_ITEM_S:
        return False
    left = batch_of(item.batch_id).total_items - item.idx - 1
    return 0 < settings.RELAY_BATCH_CLAIM_AHEAD_MIN_LEFT < left


class _Ahead:
    """The slot's next claim, made on the bookkeeper thread while its current item calls out.

    The writes handed over before it run first (one thread, in order), so it checks their batches'
    completion as the slot's own claim would, and takes them out of the drain's `writes`. The item it
    claims has its lease renewed while it waits; if its batch was cancelled meanwhile it is handed back
    (`RELEASED`) without calling out, and the release ends it as the cancel requires.
    """

    RELEASED = object()

    def __init__(self, hand_over, owner: str, floor, writes: deque):
        self.follows = [future for future, _ in writes]
        batches = list(dict.fromkeys(batch_id for _, batch_id in writes))
        writes.clear()
        self.hb: Heartbeat | None = None

        def claim():
            return self._claim(owner, floor, batches)

        # A finish may go in front of it (_run_pair) when the claim's first statement is the claim
        # itself: with one batch to check, the claim checks it; with more, the others are checked first.
        claim.takes_a_finish = len(batches) <= 1
        self.future = hand_over(claim)

    def _claim(self, owner: str, floor, batches: list):
        try:
            item = _claim_checking(owner, floor, batches)
        except DATABASE_ERRORS:
            connection.close()  # this thread's own; the drain gives its slot back
            raise
        if item is not None:
            self.hb = Heartbeat(item)
            bookkeeper().register(self.hb)
        return item

    def take(self):
        """The claimed item (None: nothing was claimable), once claimed; raises the claim's database
        error, or what a write it followed raised (the item, if any, is handed back first)."""
        try:
            item = self.future.result(timeout=WRITE_WAIT_S)
        except TimeoutError:
            self.abandon()
            raise
        if self.hb is not None:
            bookkeeper().unregister(self.hb)  # run_item beats it from here on
        try:
            for future in self.follows:
                future.result()  # done: they ran before the claim
        except BaseException:
            self.give_back(item)
            raise
        if item is None:
            return None
        if self.hb.stop_reason == "lease_lost":  # waited past its lease, and the sweeper gave it away
            log.warning("item %s claimed ahead lost its lease while waiting; not running it", item.pk)
            return self.RELEASED
        if self.hb.stop_reason == "cancelled":
            self.give_back(item)
            return self.RELEASED
        return item

    def abandon(self) -> None:
        """The drain ends without running it (an error): hand the item back, now or once claimed, and
        let no heartbeat keep its lease alive."""
        self.future.add_done_callback(self._abandoned)  # at once if the claim is done

    def _abandoned(self, future: Future) -> None:
        if self.hb is not None:
            bookkeeper().unregister(self.hb)
        if not future.cancelled() and future.exception() is None:
            self.give_back(future.result())

    @staticmethod
    def give_back(item) -> None:
        """Back to available, using no attempt (best effort: else its lease runs out and the sweeper
        rescues it)."""
        if item is None:
            return
        try:
            finish.release_item(item, timezone.now(), nothing, counts=False, pause_batch=False)
        except Exception:
            log.warning("could not hand item %s back; its lease will run out", item.pk, exc_info=True)


# How long a drain waits for a write it handed over: `finish.durably` retries for DURABLE_SECONDS, and
# a statement may take RELAY_DB_STATEMENT_TIMEOUT_MS; beyond that the drain fails (its task is retried)
# rather than hold its slot.
WRITE_WAIT_S = 4 * finish.DURABLE_SECONDS


def _committed(writes: deque, keep: int) -> list:
    """Wait for the handed-over writes but the newest `keep`; the batches they finished items of (a
    write that raised re-raises here: a finish that could not be made even by `finish.durably`)."""
    batches: list = []
    while len(writes) > keep:
        future, batch_id = writes.popleft()
        future.result(timeout=WRITE_WAIT_S)
        if batch_id not in batches:
            batches.append(batch_id)
    return batches


def _settle(writes: deque) -> None:
    """The drain ends: wait for its last writes, then check the completion of their batches."""
    for batch_id in _committed(writes, keep=0):
        try:
            stop.complete_if_done(batch_id)
        except DATABASE_ERRORS:  # the sweeper's `unfinished_batches` makes it later
            log.warning("completion check of batch %s failed: the database is unavailable", batch_id, exc_info=True)
            connection.close()
