"""The webhook lane: a process of its own (`python -m relay.processes webhooks`) that delivers webhooks, many
at once, never on the control queue — so what one tenant's receivers do costs only that tenant.

PostgreSQL is the queue: a pending delivery whose `next_attempt_at` has come and that no live lease holds is
due. The lane's main thread picks due deliveries, leases them (delivery.claim) and hands each to a pool of
RELAY_WEBHOOK_CONCURRENCY threads that resolve and POST without touching the database (the POSTs run on one
event loop; a thread only waits for its own); two recorder threads write the answers, many per transaction
(delivery.finish_many).

A pick is fair and capped:

- in flight per endpoint: RELAY_WEBHOOK_ENDPOINT_IN_FLIGHT, and one for an endpoint whose last attempt
  failed (it is probed, not flooded);
- in flight per owner: RELAY_WEBHOOK_OWNER_IN_FLIGHT, across its endpoints;
- both counted from live leases, so they hold across every lane process of the deployment (two lanes
  picking at the same moment may overshoot by a pick each);
- owners take turns: one delivery per owner per round, starting at a different owner each pick, so an owner
  with ten thousand due deliveries does not go before another's one.

So a tenant's endpoints that accept and never answer hold at most its owner cap of the lane's threads, each
for at most one attempt's timeouts, while every other tenant's deliveries go on.

The lane wakes when an event commits (outbox.wake, a Redis list), when an attempt finishes, and at least
every RELAY_WEBHOOK_POLL_SECONDS. It also runs the housekeeping: probes of failing endpoints and the retention
of settled deliveries (housekeeping.probe, housekeeping.prune).
"""

import logging
import queue
import signal
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import redis
from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

from batches.webhooks import delivery, housekeeping, outbox
from batches.webhooks.models import Delivery, WebhookEndpoint
from core.redis import get_redis

log = logging.getLogger(__name__)

RECORDERS = 2
# Answers one recorder writes in one transaction at most.
RECORD_BATCH = 200
# Probes of failing endpoints at least this often (and at most every RELAY_WEBHOOK_PROBE_SECONDS apart per
# endpoint, which housekeeping.probe decides).
HOUSEKEEPING_SECONDS = 5.0
# Between two picks at least this long, so a stream of finished attempts does not become a stream of queries.
MIN_PICK_GAP_SECONDS = 0.05

_D = Delivery._meta.db_table
_E = WebhookEndpoint._meta.db_table

# Each unpaused endpoint with a due delivery: its owner, whether it is failing, its live leases, and its oldest
# due deliveries (as many as an endpoint may have in flight). The lease counts include every lane's.
_PICK_SQL = f"""
WITH due AS (
    -- Driven from the unpaused endpoints (a few per owner): a paused endpoint's waiting deliveries, however many
    -- its owner's batches raise, are never scanned by a pick.
    SELECT e.id AS endpoint_id FROM {_E} e
    WHERE e.paused_at IS NULL AND EXISTS (
        SELECT 1 FROM {_D} d
        WHERE d.endpoint_id = e.id AND d.outcome = 'pending' AND d.next_attempt_at <= %(now)s
          AND (d.lease_expires_at IS NULL OR d.lease_expires_at < %(now)s)
    )
), leased AS (
    SELECT d.endpoint_id, count(*) AS n FROM {_D} d
    WHERE d.lease_expires_at >= %(now)s AND d.outcome = 'pending'
    GROUP BY d.endpoint_id
)
SELECT e.owner_hash, e.id, e.failing_since IS NOT NULL, coalesce(l.n, 0), c.id
FROM {_E} e
JOIN due ON due.endpoint_id = e.id
LEFT JOIN leased l ON l.endpoint_id = e.id
CROSS JOIN LATERAL (
    SELECT d.id FROM {_D} d
    WHERE d.endpoint_id = e.id AND d.outcome = 'pending' AND d.next_attempt_at <= %(now)s
      AND (d.lease_expires_at IS NULL OR d.lease_expires_at < %(now)s)
    ORDER BY d.next_attempt_at
    LIMIT %(per_endpoint)s
) c
WHERE e.paused_at IS NULL
"""
# Live leases per owner, over all its endpoints (those with nothing due too).
_OWNER_LEASES_SQL = f"""
SELECT e.owner_hash, count(*) FROM {_D} d JOIN {_E} e ON e.id = d.endpoint_id
WHERE d.lease_expires_at >= %(now)s AND d.outcome = 'pending'
GROUP BY e.owner_hash
"""


def _candidates(now, per_endpoint: int) -> tuple[list, dict]:
    """(owner, endpoint, failing, its live leases, delivery) rows of the due deliveries, at most `per_endpoint`
    per endpoint, and live leases per owner."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            cur.execute(_PICK_SQL, {"now": now, "per_endpoint": per_endpoint})
            rows = cur.fetchall()
            if not rows:
                return [], {}
            cur.execute(_OWNER_LEASES_SQL, {"now": now})
            return rows, dict(cur.fetchall())
    # Embedded mode's SQLite has no LATERAL: the oldest due deliveries, in a window (fair enough for one machine).
    leases = list(
        Delivery.objects.filter(outcome="pending", lease_expires_at__gte=now).values_list(
            "endpoint_id", "endpoint__owner_hash"
        )
    )
    by_endpoint, by_owner = defaultdict(int), defaultdict(int)
    for endpoint_id, owner in leases:
        by_endpoint[endpoint_id] += 1
        by_owner[owner] += 1
    due = (
        Delivery.objects.filter(delivery.claimable(now), endpoint__paused_at__isnull=True)
        .order_by("next_attempt_at")
        .values_list("endpoint__owner_hash", "endpoint_id", "endpoint__failing_since", "id")[:5000]
    )
    rows = [(o, e, failing is not None, by_endpoint[e], d) for o, e, failing, d in due]
    return rows, dict(by_owner)


@dataclass
class _Endpoint:
    failing: bool
    leased: int
    due: list = field(default_factory=list)


def pick(limit: int, turn: int, now=None) -> list:
    """Up to `limit` due delivery ids, fair across owners and within the caps. `turn` rotates which owner goes
    first. Reads only; `delivery.claim` leases what it picked."""
    now = now or timezone.now()
    if limit <= 0:
        return []
    endpoint_cap = settings.RELAY_WEBHOOK_ENDPOINT_IN_FLIGHT
    owner_cap = settings.RELAY_WEBHOOK_OWNER_IN_FLIGHT
    owners: dict[str, dict] = defaultdict(dict)
    candidates, owner_leased = _candidates(now, endpoint_cap)
    for owner, endpoint_id, failing, leased, delivery_id in candidates:
        ep = owners[owner].setdefault(endpoint_id, _Endpoint(failing=failing, leased=leased))
        if len(ep.due) < endpoint_cap:
            ep.due.append(delivery_id)
    # Per owner, what it may still start: endpoint by endpoint within the endpoint cap (one for a failing one),
    # interleaved across its endpoints so one endpoint's backlog does not go before its siblings'.
    queues = {}
    for owner, endpoints in owners.items():
        room = owner_cap - owner_leased.get(owner, 0)
        lanes = []
        for ep in endpoints.values():
            cap = 1 if ep.failing else endpoint_cap
            lanes.append(ep.due[: max(0, cap - ep.leased)])
        interleaved = [d for rank in range(endpoint_cap) for lane in lanes if rank < len(lane) for d in [lane[rank]]]
        if room > 0 and interleaved:
            queues[owner] = interleaved[:room]
    order = sorted(queues)
    if not order:
        return []
    start = turn % len(order)
    order = order[start:] + order[:start]
    picked, rank = [], 0
    while len(picked) < limit:
        took = False
        for owner in order:
            if rank < len(queues[owner]):
                picked.append(queues[owner][rank])
                took = True
                if len(picked) == limit:
                    break
        if not took:
            break
        rank += 1
    return picked


class Lane:
    """One lane process's loop. `run()` until `stop()`; `step()` is one pick (the tests drive it directly)."""

    def __init__(self, name: str = "webhooks", concurrency: int | None = None):
        self.concurrency = concurrency or settings.RELAY_WEBHOOK_CONCURRENCY
        self.lease_owner = delivery.new_lease_owner(name)
        self.posts = ThreadPoolExecutor(self.concurrency, thread_name_prefix="webhook-post")
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self.recorders = [
            threading.Thread(target=self._record, name=f"webhook-record-{i}", daemon=True) for i in range(RECORDERS)
        ]
        for recorder in self.recorders:
            recorder.start()
        self.in_flight = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._turn = 0
        self._housekept = 0.0
        self._pruned = 0.0
        self.outcomes: Counter = Counter()  # what this lane's attempts came to (the logs and the tests read it)

    # --- one pick --------------------------------------------------------------------------------

    def step(self) -> int:
        """Pick, lease and start what the caps and free threads allow. Returns how many started."""
        with self._lock:
            free = self.concurrency - self.in_flight
        if free <= 0:
            return 0
        self._turn += 1
        ids = pick(free, self._turn)
        if not ids:
            return 0
        jobs = delivery.claim(ids, self.lease_owner)
        with self._lock:
            self.in_flight += len(jobs)
        for job in jobs:
            self.posts.submit(self._attempt, job)
        return len(jobs)

    def _attempt(self, job) -> None:
        try:
            answer = delivery.attempt(job)
        except Exception:  # attempt() never raises; if it did, the lease runs out and the delivery is due again
            log.exception("webhook %s: attempt crashed", job.delivery.webhook_id)
            self._done(["error"])
            return
        self._answers.put((job, answer))

    def _record(self) -> None:
        """A recorder: record whatever answers have piled up, together (delivery.finish_many)."""
        while True:
            first = self._answers.get()
            if first is None:
                connection.close()  # this thread's own
                return
            batch = [first]
            while len(batch) < RECORD_BATCH:
                try:
                    more = self._answers.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._answers.put(None)  # for the other recorders
                    break
                batch.append(more)
            outcomes = ["error"] * len(batch)
            try:
                outcomes = delivery.finish_many(batch)
            except Exception:  # a database outage: the leases run out and the deliveries are sent again
                log.exception("webhooks: could not record %d attempts", len(batch))
                close_old_connections()
            finally:
                self._done(outcomes)

    def _done(self, outcomes: list[str]) -> None:
        with self._lock:
            self.in_flight -= len(outcomes)
            self.outcomes.update(outcomes)
        self._wake.set()

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until nothing this lane started is in flight (tests)."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)

    def housekeeping(self) -> None:
        now = timezone.now()
        housekeeping.probe(now)
        if time.monotonic() - self._pruned >= settings.RELAY_RETENTION_SWEEP_SECONDS:
            self._pruned = time.monotonic()
            housekeeping.prune(now)

    # --- the loop --------------------------------------------------------------------------------

    def _listen(self) -> None:
        """Wake the loop when an event commits (outbox.wake)."""
        poll = max(0.05, settings.RELAY_WEBHOOK_POLL_SECONDS)
        while not self._stopping.is_set():
            try:
                if get_redis().blpop([outbox.WAKE_KEY], timeout=max(1, int(poll))):
                    self._wake.set()
            except redis.RedisError:
                self._stopping.wait(poll)

    def run(self) -> None:
        threading.Thread(target=self._listen, name="webhook-wake", daemon=True).start()
        poll = settings.RELAY_WEBHOOK_POLL_SECONDS
        log.info(
            "webhook lane %s: %d in flight at most (%d per endpoint, %d per owner)",
            self.lease_owner,
            self.concurrency,
            settings.RELAY_WEBHOOK_ENDPOINT_IN_FLIGHT,
            settings.RELAY_WEBHOOK_OWNER_IN_FLIGHT,
        )
        while not self._stopping.is_set():
            self._wake.wait(poll)
            self._wake.clear()
            try:
                if time.monotonic() - self._housekept >= HOUSEKEEPING_SECONDS:
                    self._housekept = time.monotonic()
                    self.housekeeping()
                self.step()
            except Exception:  # the database or Redis went away: look again at the next poll
                log.exception("webhook lane: pick failed")
                close_old_connections()
                self._stopping.wait(poll)
            time.sleep(MIN_PICK_GAP_SECONDS)
        self.close()

    def close(self) -> None:
        """Let the attempts in flight finish (each bounded by its timeouts) and be recorded, then stop."""
        self.posts.shutdown(wait=True, cancel_futures=False)
        for _ in self.recorders:
            self._answers.put(None)
        for recorder in self.recorders:
            recorder.join(30)

    def stop(self, *_args) -> None:
        self._stopping.set()
        self._wake.set()


def main(name: str) -> None:
    """The lane process: run until SIGTERM/SIGINT, then finish the attempts in flight (each bounded by its
    timeouts; a killed lane loses nothing, its leases run out)."""
    # httpx2 logs every request at INFO; each attempt's own line (delivery.finish) already says what it got.
    logging.getLogger("httpx2").setLevel(max(logging.WARNING, logging.getLogger().level))
    lane = Lane(name)
    signal.signal(signal.SIGTERM, lane.stop)
    signal.signal(signal.SIGINT, lane.stop)
    lane.run()
