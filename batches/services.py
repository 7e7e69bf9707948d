"""Batch writes: submit, claim, run, finish, heartbeat, cancel, sweep, wake-ups.

Execution model (design.md §4): an item is a row; a worker *claims* it with a
conditional UPDATE (FOR UPDATE SKIP LOCKED on PostgreSQL), runs it through the
same pipeline as a live request, and finishes it with a write fenced on
(state, lease owner, attempt), in the same transaction as its usage event.
Celery messages carry no state: a wake-up only says "claim and run work".
"""

import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import uuid6
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, connections, transaction
from django.utils import timezone

from batches import anthropic_batches, bulk, ingest, lifecycle, openai_batches, outcomes, retrying, storage
from batches.models import Attempt, Batch, BatchStatus, Item, ItemState, Shape, Surface
from batches.outcomes import Code
from batches.tools import config as tools_config
from batches.tools.loop import run_tool_loop
from policies import lua
from relay import auth, catalog, jsonguard, pipeline, processes, routing, upstream
from relay.errors import RelayError
from usage.pricing import with_batch_price
from usage.services import event_row, record_event

log = logging.getLogger(__name__)

DATABASE_ERRORS = (OperationalError, InterfaceError)

SHAPE_PATH = {
    Shape.OPENAI: "/v1/chat/completions",
    Shape.OPENAI_RESPONSES: "/v1/responses",
    Shape.ANTHROPIC: "/v1/messages",
}


# --- submit -------------------------------------------------------------------


def submit_native(principal: auth.Principal, raw_stream) -> Batch:
    """Parse a native body from a stream and store it (POST /v1/batches parses in batches.intake instead)."""
    with ingest.read_submission(raw_stream, ingest.body_limit(), settings.RELAY_BATCH_MAX_ITEMS) as submission:
        return store_native(principal, submission)


def store_native(principal: auth.Principal, submission: ingest.Submission) -> Batch:
    """Store every item and its batch in one transaction; wake workers after commit.

    The body was parsed once, as a stream (ingest.read_submission); its items
    come back from the spool. Bad input → RelayError(400) and nothing is stored.
    """
    retry = _native_checks(submission.top, submission.count)
    batch_id = uuid6.uuid7()
    writer = storage.input_writer(str(batch_id))
    try:
        with transaction.atomic():
            # Each element is appended to the input file as its row is formatted (batches/bulk.py).
            rows = ((idx, writer.add(idx, data), "") for idx, data in enumerate(submission.elements()))
            bulk.copy_new_items(batch_id, rows, max_attempts=retry["max_attempts"], stream=not writer.uses_db)
            writer.close()
            batch = _create_native(principal, batch_id, submission.top["shape"], submission.count, retry)
    except BaseException:
        writer.discard()
        raise
    return batch


def can_stream_native(head: dict) -> bool:
    """Whether a native body can be stored as it is read (store_native_streaming), judged by the
    top-level keys before `requests` (batches.intake has checked that none is the OpenAI surface's):
    a known shape, a valid `retry` or none, input files on disk (the COPY reads rows while the parse
    writes them; a payload store in the database would need the connection meanwhile), and
    PostgreSQL: the transaction stays open while the body arrives, and SQLite (embedded mode) would
    hold its one write lock that long, stalling every worker's finish behind a slow upload."""
    if head.get("shape") not in Shape.values or storage.backend() != "dir" or connection.vendor != "postgresql":
        return False
    try:
        _retry_options(head.get("retry"))
    except RelayError:
        return False  # the spooled path answers it, after the whole body is read, as before
    return True


class _Replay(Exception):
    """The body's keys after `requests` changed what the streamed store assumed: undo it, replay."""


def store_native_streaming(
    principal: auth.Principal, reader: ingest.SubmissionReader, head: dict, on_parsed: Callable[[], None]
) -> Batch | ingest.Submission:
    """Store a native batch while its body is parsed: each element goes to the input file and the
    items' COPY as soon as it is read, so PostgreSQL inserts rows while the web worker parses the
    next ones (store_native, after the spool, runs the two one after the other).

    Judged from `head`, the keys before `requests` (can_stream_native). Everything happens in one
    transaction that commits only after the whole body is parsed and checked, so a bad element, an
    oversized body or a failed check stores nothing, as in store_native. If keys after `requests`
    differ from `head` (a `retry` or `shape` sent last, an OpenAI key making the body ambiguous),
    nothing is kept and the parsed body comes back as a Submission for the usual path, read from
    the input file the elements were written to. `on_parsed` runs once the body is parsed, before the
    batch's own checks (the view answers those in the native error shape).
    """
    retry = _retry_options(head.get("retry"))
    batch_id = uuid6.uuid7()
    writer = storage.input_writer(str(batch_id))
    try:
        with transaction.atomic():
            _allow_the_upload()
            rows = ((idx, writer.add(idx, data), "") for idx, data in enumerate(reader.elements()))
            bulk.copy_new_items(batch_id, rows, max_attempts=retry["max_attempts"], stream=True)
            top = reader.top
            if _without_requests(top) != _without_requests(head):
                raise _Replay
            on_parsed()
            _native_checks(top, reader.count)
            writer.close()
            batch = _create_native(principal, batch_id, top["shape"], reader.count, retry)
    except _Replay:
        try:
            spool = writer.read_back()
        finally:
            writer.discard()
        return ingest.Submission(reader.top, reader.count, spool, reader.sha256)
    except BaseException:
        writer.discard()
        raise
    return batch


def _allow_the_upload() -> None:
    """The COPY lasts as long as the body takes to arrive, which the edge bounds (relay.edge: a 408
    past RELAY_BODY_READ_SECONDS + size / RELAY_BODY_MIN_RATE). This transaction's statements get that
    bound for the largest body on top of RELAY_DB_STATEMENT_TIMEOUT_MS, so a slow but legal upload is
    cut by the edge's 408, never by the database's timeout halfway through."""
    upload_ms = 1000 * (settings.RELAY_BODY_READ_SECONDS + ingest.body_limit() / settings.RELAY_BODY_MIN_RATE)
    with connection.cursor() as cursor:
        cursor.execute(f"SET LOCAL statement_timeout = {int(upload_ms) + settings.RELAY_DB_STATEMENT_TIMEOUT_MS}")


def _without_requests(top: dict) -> dict:
    return {k: v for k, v in top.items() if k != "requests"}


def _native_checks(top: dict, seen: int) -> dict:
    """spec 000's checks of a parsed native body (`seen` elements); answers its retry options."""
    max_items = settings.RELAY_BATCH_MAX_ITEMS
    shape = top.get("shape")
    if shape in (None, ""):
        raise RelayError(400, "invalid_request", "shape is required")
    if shape not in Shape.values:
        raise RelayError(400, "invalid_request", f"unknown shape {shape!r}: use one of {', '.join(Shape.values)}")
    if "requests" not in top:
        raise RelayError(400, "invalid_request", "requests is required")
    if not seen:
        raise RelayError(400, "invalid_request", "requests must be non-empty")
    if seen > max_items:
        raise RelayError(
            400,
            "too_many_items",
            f"batch: too many items: {seen} items, at most {max_items} per batch (RELAY_BATCH_MAX_ITEMS)",
        )
    return _retry_options(top.get("retry"))


def _create_native(principal: auth.Principal, batch_id, shape: str, total: int, retry: dict) -> Batch:
    """The batch row of items just copied, in the caller's transaction; workers are woken after commit."""
    batch = Batch.objects.create(
        id=batch_id, inbound_shape=shape, total_items=total, **retry, **Batch.attribution(principal)
    )
    transaction.on_commit(lifecycle.wake_workers)
    return batch


RETRY_KEYS = {"max_attempts", "wait_for_capacity"}
RETRY_MAX_ATTEMPTS = 100


def _retry_options(value) -> dict:
    """The native batch's opt-in to waiting and retrying (`"retry": {"max_attempts", "wait_for_capacity"}`).

    Without it a native batch keeps spec 000's behaviour: an item fails at once
    (no wait for capacity, no retry of a transient failure); only a worker lost
    mid-item is rescued, up to 3 attempts, as before.
    """
    if value is None:
        return {"max_attempts": 3, "retry_transient": False, "wait_for_capacity": False}
    if not isinstance(value, dict):
        raise RelayError(
            400, "invalid_request", 'retry must be an object: {"max_attempts": 5, "wait_for_capacity": true}'
        )
    unknown = sorted(set(value) - RETRY_KEYS)
    if unknown:
        raise RelayError(
            400, "invalid_request", f"retry: unknown field {unknown[0]!r}; use max_attempts, wait_for_capacity"
        )
    attempts = value.get("max_attempts", settings.RELAY_BATCH_MAX_ATTEMPTS)
    if isinstance(attempts, bool) or not isinstance(attempts, int) or not 1 <= attempts <= RETRY_MAX_ATTEMPTS:
        raise RelayError(
            400, "invalid_request", f"retry.max_attempts must be an integer from 1 to {RETRY_MAX_ATTEMPTS}"
        )
    wait = value.get("wait_for_capacity", True)
    if not isinstance(wait, bool):
        raise RelayError(400, "invalid_request", "retry.wait_for_capacity must be true or false")
    return {"max_attempts": attempts, "retry_transient": attempts > 1, "wait_for_capacity": wait}


# --- claim -------------------------------------------------------------------------


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


def warm_up(*, own_connection: bool = True) -> None:
    """What a worker process's first item would otherwise pay (called once per process before it takes
    work: relay/celery.py): its database connection with the claim statements prepared,
    its Redis and broker connections, the catalog of the policies that batches may run under. Measured:
    a fresh process's first item took 73 ms against 12 ms for its second on a quiet machine, and
    300-650 ms when the 16-24 pool processes of a scale-out start together on 2 cores. Best effort:
    whatever fails here is done again by the first item. `own_connection=False`: the calling thread
    runs no item (the `threads` pool's main thread), so its own connection is not prepared."""
    from relay.redis import get_redis

    steps = (
        *((("database", lifecycle.warm_up),) if own_connection else ()),
        ("redis", lambda: get_redis().ping()),
        ("broker", _warm_broker),
        # Inherited from the worker's parent (relay/celery.py): loaded again only if the catalog changed
        # since the fork (one Redis read otherwise).
        ("catalog", routing.warm),
        ("upstream", upstream.warm),
        ("bookkeeper", _warm_bookkeeper),
    )
    processes.run_warm_up(steps, log, what="worker process", first="item")


def _warm_bookkeeper() -> None:
    """The bookkeeper thread's connection, with the claim statements prepared (it claims ahead)."""
    if connection.vendor == "postgresql":
        _bookkeeper().submit(lifecycle.warm_up).result(timeout=30)


def _warm_broker() -> None:
    """The first wake-up a process sends (`pass_on`) cost 12 ms of CPU, 0.5 ms after: the result backend
    is resolved (an entry-points scan, even with results ignored) and the producer's connection made."""
    from relay.celery import app

    app.backend  # noqa: B018 - resolved on first access
    with app.producer_or_acquire() as producer:
        producer.channel  # noqa: B018 - connects
    lifecycle.queue_length(lifecycle.ITEM_QUEUE)


def claim(owner: str, floor: tuple | None = None, check=None) -> Item | None:
    """Claim the next item, fairly: the active batch with the fewest running items first (lifecycle.claim);
    `check`: a batch whose completion the caller left to this claim (see `drain`)."""
    return lifecycle.claim(owner, floor, check)


# --- run ----------------------------------------------------------------------------


class Heartbeat:
    """Renews the item's lease and reads the batch's cancel flag every few seconds.

    Cancel goes through the database, so a cancel received by any replica
    reaches the item wherever it runs. Losing the lease (the sweeper gave the
    item to someone else) stops the call too. The beats come from one thread
    per worker process (`_Bookkeeper`) with one long-lived database connection,
    not a thread and a fresh connection per item.
    """

    def __init__(self, item: Item):
        self.item = item
        self.stop_reason: str | None = None

    def __enter__(self):
        _bookkeeper().register(self)
        return self

    def __exit__(self, *exc):
        _bookkeeper().unregister(self)

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


class _Bookkeeper:
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
    """An item's finish and a claim, in one round trip (lifecycle.HeldFinish): the finish is built and
    held, then goes in front of the claim's statement. If the pair's statement did not commit (the
    claim failed, or never reached its statement), the finish is made on its own, through `durably`.
    The finish's future is settled before the claim's: a claim's waiter also waits on the writes
    handed over before it."""
    (f_future, f_fn), (c_future, c_fn) = finish_job, claim_job
    if not f_future.set_running_or_notify_cancel():
        _run_job(c_future, c_fn)
        return
    with lifecycle.holding_finish() as held:
        made = _outcome(f_fn)
    if not made[0] or held.execute is None:  # it failed, or nothing was held (it ran in f_fn)
        _settle_future(f_future, made)
        _run_job(c_future, c_fn)
        return
    claim_ran = c_future.set_running_or_notify_cancel()
    if claim_ran:
        with lifecycle.in_front_of_claim(held):
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


def _inline(fn: Callable[[], object]) -> Future:
    """`submit` for SQLite (embedded mode), which serialises writers: the write runs at once, here."""
    future: Future = Future()
    _run_job(future, fn)
    return future


_bookkeeper_instance: _Bookkeeper | None = None
_bookkeeper_lock = threading.Lock()


def _bookkeeper() -> _Bookkeeper:
    """One per process; a prefork child gets its own (threads do not survive fork)."""
    global _bookkeeper_instance
    with _bookkeeper_lock:
        old = _bookkeeper_instance
        if old is None or old.pid != os.getpid():
            _bookkeeper_instance = _Bookkeeper()
        elif not old.alive():  # cannot happen (`_run` ends on nothing); if it did, a new thread takes its work
            log.error("batch bookkeeper thread ended; starting another")
            _bookkeeper_instance = _Bookkeeper()
            _bookkeeper_instance.beats, _bookkeeper_instance.jobs = old.beats, old.jobs
        return _bookkeeper_instance


def close_bookkeeper() -> None:
    """Close the bookkeeper thread's database connection, if this process has one (its end)."""
    keeper = _bookkeeper_instance
    if keeper is not None and keeper.pid == os.getpid():
        keeper.submit(lambda: connection.close()).result(timeout=lifecycle.DURABLE_SECONDS)


def _hand_over() -> Callable[[Callable[[], object]], Future]:
    """Where the drain's final writes run: the bookkeeper's thread on PostgreSQL, in line on SQLite."""
    return _bookkeeper().submit if connection.vendor == "postgresql" else _inline


_batch_cache: dict = {}


def _batch(batch_id) -> Batch:
    """The batch of an item. Only fields fixed at submit are read through this
    cache (attribution, shape, endpoint, policy id, discount); state and the
    cancel flag are always read from the database."""
    batch = _batch_cache.get(batch_id)
    if batch is None:
        if len(_batch_cache) >= 256:
            _batch_cache.clear()
        batch = _batch_cache[batch_id] = Batch.objects.get(pk=batch_id)
    return batch


def run_item(item: Item, *, check_done: bool = True, hand_over=None) -> Future | None:
    """Run one claimed item: to a final state, or back to `available` to wait or retry (batches/retrying.py).
    Never raises for item-level failures. `check_done=False`: a final state does not check the batch's
    completion; the caller does (the drain, with a later claim). `hand_over`: where the final write runs
    (the drain's `_hand_over()`); its future is returned. Without it the write is made here, before
    returning."""
    started_at, started = timezone.now(), time.monotonic()
    batch = _batch(item.batch_id)
    principal = auth.Principal.from_dict(batch.principal)
    deadline = started + settings.RELAY_BATCH_ITEM_DEADLINE_SECONDS
    with Heartbeat(item) as hb:
        run = _execute(batch, item, principal, deadline, hb)
    run.started_at = started_at
    outcome = run.outcome

    def finish(state: str, **fields) -> Future | None:
        def write() -> bool:
            if state == ItemState.COMPLETED:
                fields["result_ref"] = storage.write_result(str(batch.id), str(item.pk), outcome.body)
            return _finish(item, state, run=run, check_done=check_done, **fields)

        if hand_over is not None:
            write.pairs_with_claim = True  # the bookkeeper may send it with the next claim (_run_pair)
            return hand_over(write)
        write()
        return None

    if hb.stop_reason == "lease_lost":
        log.warning("item %s lost its lease; dropping this attempt's result", item.pk)
        return None
    if hb.stop_reason == "cancelled" and (run.failure or (outcome and not outcome.ok)):
        return finish(ItemState.CANCELLED, code=Code.BATCH_CANCELLED, error=lifecycle.CANCELLED_ERROR)
    if run.failure is not None:
        code, error, error_body = run.code, run.failure, ""
    elif outcome.ok:
        return finish(ItemState.COMPLETED)
    elif outcome.origin == "upstream":
        code, error = Code.UPSTREAM_ERROR, f"batch item: upstream status {outcome.status}"
        error_body = outcome.body[: pipeline.ERROR_BODY_LIMIT].decode("utf-8", errors="replace")
    else:
        code = outcomes.normalize(outcome.error_kind)
        error = f"batch item: {outcome.error.message}" if outcome.error else "batch item: failed"
        error_body = ""
    status = outcome.status if outcome is not None and outcome.origin == "upstream" else None
    decision = retrying.decide(batch, item, code, status, outcome.retry_after if outcome is not None else None)
    if decision.action == retrying.FINISH:
        return finish(ItemState.DISCARDED, code=code, error=error, error_body=error_body)
    not_before = timezone.now() + timezone.timedelta(seconds=decision.delay)
    # A wait decided before any provider was called (the policy's own limit, every key benched) is no attempt.
    # (Made here, not handed over: a release is rare, and it schedules a wake-up through the broker.)
    attempt = _attempt(item, run, decision.action, code=code, error=error, error_body=error_body)
    lifecycle.release_item(
        item,
        not_before,
        attempt.save if attempt is not None else _nothing,
        counts=decision.action == retrying.RETRY,
        pause_batch=decision.action == retrying.WAIT,
    )
    return None


def _nothing() -> None:
    pass


@dataclass
class _Run:
    """What executing an item came to.

    `failure`/`code`: the item failed (a message and its code from batches.outcomes).
    `events`: the usage events of every model invocation when there were
    several (tool calling); None means "the outcome's own event, if any".
    """

    outcome: pipeline.Outcome | None = None
    failure: str | None = None
    code: str = ""
    events: list[dict] | None = None
    started_at: object = None  # when the attempt began (set by run_item)


class _CredentialGone(RelayError):
    """The item's credential stopped working (found when the key pick had the catalog reloaded)."""

    def __init__(self, exc: RelayError):
        super().__init__(exc.status, Code.CREDENTIAL_INVALID, exc.message)


def _recheck(principal, snapshot):
    """The pipeline's re-check of the credential with a newer catalog (`Call.reauthenticate`)."""
    try:
        auth.recheck(principal, snapshot)
    except RelayError as exc:
        raise _CredentialGone(exc) from exc
    return principal


def _credential_gone(message: str) -> _Run:
    return _Run(failure=f"batch: credential no longer valid: {message}", code=Code.CREDENTIAL_INVALID)


def _policy_gone() -> _Run:
    return _Run(failure="batch: policy_unavailable", code=Code.POLICY_UNAVAILABLE)


def _execute(batch: Batch, item: Item, principal, deadline: float, hb: Heartbeat) -> _Run:
    # The credential and the policy are checked against the catalog this process holds, without a round
    # trip: the key pick confirms its generation, and when it is stale the pipeline routes again with the
    # current catalog and re-checks the credential (`_recheck`); what that finds fails the item as these
    # checks would have (`_unless_gone`). Measured: the per-item read of the generation was ~0.5 ms of a
    # slot's time between two upstream calls.
    snapshot = catalog.held()
    try:
        auth.recheck(principal, snapshot)
    except RelayError as exc:  # AuthError, or the token's project is gone
        return _credential_gone(exc.message)
    policy = catalog.policy(batch.policy_id, snapshot) if batch.policy_id else None
    if policy is None or not policy.enabled:
        return _policy_gone()
    try:
        body = jsonguard.loads(storage.read_input(item.input_ref))  # a ValueError: NUL, surrogates, depth (issue 12)
    except storage.PayloadMissing as exc:
        return _Run(failure=f"batch: load input: {exc}", code=Code.INVALID_ITEM)
    except ValueError as exc:
        return _Run(failure=f"batch: load input: stored item is not JSON: {exc}", code=Code.INVALID_ITEM)
    if not isinstance(body, dict):
        return _Run(failure="batch: parse model: item is not a JSON object", code=Code.INVALID_ITEM)
    if body.get("stream") is True:
        return _Run(
            failure="batch: stream is not supported in batch items; the response is stored whole (unset stream)",
            code=Code.STREAMING_UNSUPPORTED,
        )
    path = batch.endpoint or SHAPE_PATH[batch.inbound_shape]  # an OpenAI batch calls its endpoint

    def invoke(model_body: dict, round_no: int) -> pipeline.Outcome:
        return pipeline.dispatch(
            pipeline.Call(
                path=path,
                body=model_body,
                principal=principal,
                source="batch",
                # One usage event per model invocation: the item's id, then id:1, id:2 … per tool round.
                request_id=str(item.pk) if round_no == 0 else f"{item.pk}:{round_no}",
                deadline=deadline,
                cancel=hb.should_stop,
                batch_id=str(batch.id),
                # Native items must match their shape's adapter (spec 000); an OpenAI or Anthropic record
                # routes as the live call to its endpoint would (relay.adapters.PATH_ADAPTER).
                required_adapter=batch.inbound_shape if batch.surface == Surface.NATIVE else None,
                policy=policy,
                failover_on_server_error=not batch.retry_transient,
                server_error_benches_key=item.retries == 0,
                credential_snapshot=snapshot,
                reauthenticate=lambda snap: _recheck(principal, snap),
            )
        )

    if batch.surface == Surface.OPENAI:
        return _unless_gone(_execute_openai_record(body, item, path, invoke, deadline, hb))
    return _unless_gone(_checked(invoke(body, 0)))


def _unless_gone(run: _Run) -> _Run:
    """The credential or the policy found gone by the pipeline's re-route (see `_execute`): failed as
    the checks before the call fail it. The call was never made (the pick consumed nothing)."""
    error = run.outcome.error if run.outcome is not None else None
    if isinstance(error, _CredentialGone):
        return _credential_gone(error.message)
    if error is not None and error.code in ("no_policy", "policy_disabled"):
        return _policy_gone()
    return run


def _execute_openai_record(body: dict, item: Item, path: str, invoke, deadline: float, hb: Heartbeat) -> _Run:
    """An OpenAI record: the relay-owned `openrelay` key never reaches the model;
    a chat record with `openrelay.tool_config` runs the tool loop (issue 6)."""
    try:
        model_body, tool_config = tools_config.extract(body)
    except tools_config.ToolError as exc:  # validation catches these first; re-checked for safety
        return _Run(failure=f"batch: {exc.code}: {exc.message}", code=outcomes.normalize(exc.code))
    if tool_config is None or path != "/v1/chat/completions":
        return _checked(invoke(model_body, 0))
    result = run_tool_loop(body, tool_config, item.custom_id, invoke, deadline=deadline, cancel=hb.should_stop)
    events = [o.event for o in result.invocations]
    if result.error is not None:
        return _Run(
            outcome=None,
            failure=f"batch: {result.error.code}: {result.error.message}",
            code=outcomes.normalize(result.error.code),
            events=events,
        )
    run = _checked(result.outcome)
    run.events = events
    return run


def _checked(outcome: pipeline.Outcome) -> _Run:
    if outcome.error is not None and outcome.error.code == "timeout":
        limit = settings.RELAY_BATCH_ITEM_DEADLINE_SECONDS
        return _Run(outcome=outcome, failure=f"batch: item ran longer than {limit:g} seconds", code=Code.TIMEOUT)
    return _Run(outcome=outcome)


def _finish(
    item: Item, state: str, *, run: _Run, code: str = "", error: str = "", check_done: bool = True, **fields
) -> bool:
    """The item's final write and its usage event(s), in one transaction, fenced on the claim."""
    outcome = run.outcome
    batch = _batch(item.batch_id)

    attempt = _attempt_fields(
        item, run, "finish", code=code, error=error, error_body=fields.get("error_body", ""), always=True
    )

    events = run.events if run.events is not None else ([outcome.event] if outcome is not None else [])
    if not events:
        events = [_event_without_dispatch(batch, item.pk, code, error)]
    else:
        events = [with_batch_price(dict(event), batch.discount_percent) for event in events]
        last = events[-1]
        if code and not last.get("error_kind"):
            # The item failed after its last invocation answered (a tool failure, say).
            last["error_kind"] = code
            last["error_message"] = error[:500]
    # One statement: the fenced finish, the attempt row and the usage event(s), committed together.
    rows = [lifecycle.fields_row(Attempt, attempt), *(event_row(connection, **event) for event in events)]
    return lifecycle.finish_item_at_once(
        item,
        state,
        rows,
        status_code=outcome.status if outcome is not None and outcome.origin == "upstream" else None,
        error=error[:1000],
        error_code=code,
        check_done=check_done,
        **fields,
    )


def _attempt(item: Item, run: _Run, decision: str, *, code: str, error: str, error_body: str = "", always=False):
    """The Attempt row of this claim; None for one that never reached a provider, unless `always`."""
    fields = _attempt_fields(item, run, decision, code=code, error=error, error_body=error_body, always=always)
    return Attempt(**fields) if fields is not None else None


def _attempt_fields(item: Item, run: _Run, decision: str, *, code: str, error: str, error_body: str, always=False):
    """`_attempt`'s field values (no model instance: the finish writes them as a row of its statement)."""
    event = run.outcome.event if run.outcome is not None else None
    if event is None and run.events:
        event = run.events[-1]
    reached = event is not None and (event.get("host_key_id") is not None or event.get("status"))
    if not reached and not always:
        return None
    now = timezone.now()
    started = run.started_at or now
    status = run.outcome.status if run.outcome is not None and run.outcome.origin == "upstream" else None
    return {
        "item_id": item.pk,
        "number": item.attempt,
        "started_at": started,
        "finished_at": now,
        "duration_ms": max(0, int((now - started).total_seconds() * 1000)),
        "outcome": code or "completed",
        "decision": decision,
        "status_code": status,
        "host_key_id": event.get("host_key_id") if event else None,
        "error": error[:1000],
        "error_body": error_body,
    }


def _event_without_dispatch(batch: Batch, item_id, code: str, error: str) -> dict:
    """The usage event of an item that failed before reaching the pipeline."""
    return {
        **batch.event_attribution(),
        "request_id": str(item_id),
        "status": 0,
        "error_kind": code,
        "error_message": error[:500],
    }


# --- cancel -----------------------------------------------------------------------


def cancel(batch: Batch) -> bool:
    """Cancel a batch of any surface. Native: pending items now, running ones at their next
    heartbeat on every replica. OpenAI: cancelling → cancelled once its partial results are written;
    Anthropic: cancelling → cancelled once no request is running; False when it had already finished."""
    if batch.surface == Surface.OPENAI:
        moved = lifecycle.cancel_openai(batch.pk)
        batch.refresh_from_db()
        return moved or batch.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED)
    if batch.surface == Surface.ANTHROPIC:
        moved = lifecycle.cancel_anthropic(batch.pk)
        batch.refresh_from_db()
        return moved or batch.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED)
    lifecycle.cancel_native(batch.pk)
    return True


# --- sweeper -----------------------------------------------------------------------


def sweep() -> dict:
    """Rescue expired leases, finish what nothing else will, expire OpenAI batches past their window,
    re-send lost control messages, then top up wake-ups. Idempotent; any replica may run it."""
    now = timezone.now()
    stale = now - timezone.timedelta(seconds=settings.RELAY_BATCH_LEASE_SECONDS)
    # Each step on its own: one that fails (a row held by a frozen process, a lock timeout) must
    # not skip the others, least of all the wake-ups at the end.
    rescued = _step("rescue", lambda: lifecycle.rescue_expired_leases(now, _record_rescued))
    discarded = _step("discard", lambda: lifecycle.discard_lost_items(now, _record_lost))
    _step("cancel orphans", lifecycle.cancel_orphans)  # cancelled batches whose running items died
    expired = _step("expire", lambda: openai_batches.expire_due(now) + anthropic_batches.expire_due(now))
    _step("lost validations", lambda: _redispatch_lost_validations(stale))
    _step("unfinished batches", lambda: _finish_unfinished(stale))
    woken = _step("wake", lifecycle.wake_workers)
    return {"rescued": rescued, "discarded": discarded, "expired": expired, "woken": woken}


def _step(name: str, fn):
    try:
        return fn()
    except Exception:
        log.exception("sweep step %r failed; the next sweep retries it", name)
        connection.close_if_unusable_or_obsolete()
        return 0


def _redispatch_lost_validations(stale) -> int:
    lost = openai_batches.lost_validations(stale)
    for batch_id in lost:
        lifecycle.redispatch("validate_openai_batch", batch_id)
    return len(lost)


def _finish_unfinished(stale) -> int:
    batches = lifecycle.unfinished_batches()
    for batch_id, surface, status, finalizing_at, cancelling_at in batches:
        if surface == Surface.OPENAI and status in (BatchStatus.FINALIZING, BatchStatus.CANCELLING):
            if (finalizing_at or cancelling_at) < stale:
                lifecycle.redispatch("finalize_openai_batch", batch_id)  # finalize's message was lost
        else:
            lifecycle.complete_if_done(batch_id)
    return len(batches)


_LOST = "batch: the worker running this attempt was lost (its lease ran out)"


def _lost_attempt(item_id, attempt: int, started_at, now, decision: str) -> Attempt:
    started = started_at or now
    return Attempt(
        item_id=item_id,
        number=attempt,
        started_at=started,
        finished_at=now,
        duration_ms=max(0, int((now - started).total_seconds() * 1000)),
        outcome=Code.WORKER_LOST,
        decision=decision,
        error=_LOST,
    )


def _record_rescued(rows: list) -> None:
    now = timezone.now()
    Attempt.objects.bulk_create(
        [_lost_attempt(item_id, attempt, started_at, now, retrying.RETRY) for item_id, _, attempt, started_at in rows],
        ignore_conflicts=True,  # the zombie may still write its own after rescue: first one wins
    )


def _record_lost(item_id, batch_id, attempt: int, started_at) -> None:
    error = "batch: worker lost the item on every attempt"
    record_event(**_event_without_dispatch(_batch(batch_id), item_id, Code.WORKER_LOST, error), fetch=False)
    Attempt.objects.bulk_create(
        [_lost_attempt(item_id, attempt, started_at, timezone.now(), retrying.FINISH)], ignore_conflicts=True
    )


# --- the worker loop ------------------------------------------------------------------


def drain(max_items: int = 500, max_seconds: float = 120.0) -> int:
    """Claim and run items until none is claimable or the budget is used; then hand over.

    One Celery task runs this loop in one of the worker's 8 slots. When the
    budget ends with work left, it queues a wake-up so the slot is reused
    without waiting for the sweeper.

    The database work around an item's call runs beside it, on the process's bookkeeper thread
    (`_hand_over`): the item's final write, and the claim of the next item (`_Ahead`) while its batch
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
    hand_over = _hand_over()
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
                lifecycle.pass_on()  # there is work: wake more slots, on whichever worker is idle
            floor = (item.batch_id, item.idx)
            if hand_over is not _inline and budget_left(2) and _claim_ahead_worth_it(item, last_item_s):
                ahead = _Ahead(hand_over, owner, floor, writes)
            item_started = time.monotonic()
            try:
                write = run_item(item, check_done=False, hand_over=hand_over)
            except DATABASE_ERRORS:
                # Mid-item (not while finishing: that retries by itself). Hand the item back rather than
                # leave it running until its lease runs out; this claim never called out or was not recorded.
                log.warning("item %s: the database went away mid-item; releasing it", item.pk, exc_info=True)
                connection.close()
                lifecycle.release_item(item, timezone.now(), _nothing, counts=False, pause_batch=False)
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
    lifecycle.wake_workers(known_work=True)  # the budget ended with work left: hand the slot over
    return done


def _claim_after(owner: str, floor, writes: deque) -> Item | None:
    """The slot's own claim. It checks the completion of the batches whose handed-over writes have
    committed: all but the newest (made during the item just run: usually long done, waited for if not)."""
    return _claim_checking(owner, floor, _committed(writes, keep=1))


def _claim_checking(owner: str, floor, batches: list) -> Item | None:
    """Claim, checking the completion of `batches` (their writes have committed): the last one by the
    claim itself, any others first (the drain moved between batches: a claim checks only one)."""
    for batch_id in batches[:-1]:
        lifecycle.complete_if_done(batch_id)
    return claim(owner, floor, batches[-1] if batches else None)


# Claiming ahead saves the slot a claim's round trip (~2.5 ms measured at 100 ms upstream latency) per
# item; after a call of this long or longer that is not worth an item held back from another slot.
CLAIM_AHEAD_MAX_ITEM_S = 0.5


def _claim_ahead_worth_it(item: Item, last_item_s: float | None) -> bool:
    """Claim ahead after a short item (the drain's previous one: none for its first), far from the
    batch's end (RELAY_BATCH_CLAIM_AHEAD_MIN_LEFT items after this one, by index: an upper bound on
    those still unclaimed)."""
    if last_item_s is None or last_item_s >= CLAIM_AHEAD_MAX_ITEM_S:
        return False
    left = _batch(item.batch_id).total_items - item.idx - 1
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
            _bookkeeper().register(self.hb)
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
            _bookkeeper().unregister(self.hb)  # run_item beats it from here on
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
            _bookkeeper().unregister(self.hb)
        if not future.cancelled() and future.exception() is None:
            self.give_back(future.result())

    @staticmethod
    def give_back(item) -> None:
        """Back to available, using no attempt (best effort: else its lease runs out and the sweeper
        rescues it)."""
        if item is None:
            return
        try:
            lifecycle.release_item(item, timezone.now(), _nothing, counts=False, pause_batch=False)
        except Exception:
            log.warning("could not hand item %s back; its lease will run out", item.pk, exc_info=True)


# How long a drain waits for a write it handed over: `lifecycle.durably` retries for DURABLE_SECONDS, and
# a statement may take RELAY_DB_STATEMENT_TIMEOUT_MS; beyond that the drain fails (its task is retried)
# rather than hold its slot.
WRITE_WAIT_S = 4 * lifecycle.DURABLE_SECONDS


def _committed(writes: deque, keep: int) -> list:
    """Wait for the handed-over writes but the newest `keep`; the batches they finished items of (a
    write that raised re-raises here: a finish that could not be made even by `lifecycle.durably`)."""
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
            lifecycle.complete_if_done(batch_id)
        except DATABASE_ERRORS:  # the sweeper's `unfinished_batches` makes it later
            log.warning("completion check of batch %s failed: the database is unavailable", batch_id, exc_info=True)
            connection.close()
