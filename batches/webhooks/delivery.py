"""Delivering webhooks: one signed POST per attempt, its record, the retry schedule, pausing, probing, retention.

At least once: a delivery is POSTed until an answer is 2xx, with the same `webhook-id` and body on every
retry and a fresh timestamp and signature each time; receivers dedupe on the webhook-id.

- An attempt is three steps, so the webhook lane (lane.py) can run many at once without a database
  connection per POST: `claim` leases due deliveries (lease_owner, lease_expires_at: a short UPDATE), `attempt`
  resolves and POSTs with no database work, and `finish` records the answer in one transaction fenced on the
  lease. A lane killed mid-POST loses nothing: the lease runs out and the delivery is due again; an attempt
  whose lease was taken over records nothing. `deliver` runs the three steps for one delivery.
- Every phase of an attempt has its own timeout: DNS (RELAY_WEBHOOK_DNS_TIMEOUT_SECONDS, guard.resolve),
  connect with TLS (…_CONNECT_…), the answer's first byte (…_FIRST_BYTE_…) and the whole attempt
  (RELAY_WEBHOOK_TIMEOUT_SECONDS).
- 2xx is delivered. Anything else (another status, a 3xx: redirects are never followed, a network error,
  a refused address) is a failed attempt, retried after base × 2^(n-1) seconds capped at the maximum
  (RELAY_WEBHOOK_RETRY_BASE_SECONDS, RELAY_WEBHOOK_RETRY_MAX_SECONDS), jittered down to half of that (so a
  gap never exceeds the maximum), until RELAY_WEBHOOK_MAX_AGE_SECONDS after the event: then it fails.
  A test event (POST …/test) is sent once and never retried.
- An endpoint is paused automatically when every attempt has failed for RELAY_WEBHOOK_PAUSE_AFTER_SECONDS
  and at least RELAY_WEBHOOK_PAUSE_AFTER_FAILURES times in a row — or when a delivery runs out of retries
  with none delivered since it was raised. Its owner sees why (`paused_reason`); its pending deliveries are
  kept and sent when it is resumed (services.resume).
- A failing endpoint is probed: when it has not been tried for RELAY_WEBHOOK_PROBE_SECONDS, its next delivery
  is made due now; the first 2xx after failures makes all its waiting deliveries due now. So a receiver back
  from an outage gets its backlog within about a probe interval, however long the backoff.
"""

import asyncio
import atexit
import logging
import os
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import anyio
import httpx2
from django.conf import settings
from django.db import connection, transaction
from django.db.models import DateTimeField, F, Q, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from batches.models import Batch
from batches.tools import netguard
from batches.webhooks import guard, outbox, signing
from batches.webhooks.models import Delivery, DeliveryAttempt, DeliveryOutcome, WebhookEndpoint
from core import crypto

log = logging.getLogger(__name__)

PENDING, DELIVERED, FAILED = DeliveryOutcome.PENDING, DeliveryOutcome.DELIVERED, DeliveryOutcome.FAILED

HEAD_BYTES = 1024
# What an attempt may read off the wire (headers and a few body reads) before it stops listening.
_WIRE_BYTES = netguard.MAX_HEADER_BYTES + 256 * 1024
USER_AGENT = "relay-webhooks/1"
# Deliveries made due at once when a failing endpoint answers again (the rest as they come due).
RELEASE_LIMIT = 1000
# Settled deliveries one retention pass deletes at most (the rest at the next pass).
PRUNE_LIMIT = 2000
# Beyond an attempt's own timeouts, how long its lease outlasts it (recording it, a slow database, a busy
# machine): the attempt's whole timeout again, and at least this.
LEASE_MARGIN_SECONDS = 5.0


@dataclass
class Answer:
    """What one attempt got: the receiver's status and the first KiB of its answer, or why there was none."""

    started_at: object
    duration_ms: int
    status_code: int | None = None
    head: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


@dataclass
class Job:
    """A claimed delivery and all an attempt needs, read before the POST so the POST needs no database."""

    delivery: Delivery
    endpoint: WebhookEndpoint
    body: bytes
    lease: str

    @property
    def owner_hash(self) -> str:
        return self.endpoint.owner_hash


# --- one attempt ---------------------------------------------------------------------------------


def attempt_seconds() -> float:
    """The longest an attempt takes: its DNS look-up, then the whole POST."""
    return settings.RELAY_WEBHOOK_DNS_TIMEOUT_SECONDS + settings.RELAY_WEBHOOK_TIMEOUT_SECONDS


def lease_seconds() -> float:
    """How long a claimed delivery stays leased: past every timeout of its attempt, with room to record it. A lane
    killed mid-POST delays its deliveries by about this, never loses them."""
    return attempt_seconds() + settings.RELAY_WEBHOOK_TIMEOUT_SECONDS + LEASE_MARGIN_SECONDS


def signing_keys(endpoint: WebhookEndpoint, now) -> list[str]:
    """The endpoint's secret, and the one before it while a rotation keeps it active."""
    keys = [crypto.decrypt(endpoint.secret_sealed)]
    expires = endpoint.previous_secret_expires_at
    if endpoint.previous_secret_sealed and expires is not None and expires > now:
        keys.append(crypto.decrypt(endpoint.previous_secret_sealed))
    return keys


def prepare(url: str) -> netguard.Pin | str:
    """The checked, pinned destination of an attempt, or why it may not be sent (a failed attempt)."""
    try:
        return guard.pinned(url)
    except (guard.Blocked, guard.Unresolvable) as exc:
        return f"refused: {exc.message}"


def _timeouts() -> httpx2.Timeout:
    """Per phase: connect (TCP and the TLS handshake: httpcore counts both as connecting), the first byte of the
    answer (and every later read), writing the body; the whole attempt is bounded in `_post`."""
    s = settings
    return httpx2.Timeout(
        s.RELAY_WEBHOOK_TIMEOUT_SECONDS,
        connect=s.RELAY_WEBHOOK_CONNECT_TIMEOUT_SECONDS,
        read=s.RELAY_WEBHOOK_FIRST_BYTE_TIMEOUT_SECONDS,
        write=s.RELAY_WEBHOOK_FIRST_BYTE_TIMEOUT_SECONDS,
    )


# Keep-alive connections, one pool per endpoint (never shared between endpoints: one tenant's receiver that holds
# its connections must not hold another endpoint's), bound to the endpoint's current pin (guard.pinned): when the
# pin is renewed with other addresses, or the pool is older than the pin's age, a new pool takes over and the old
# one is closed once its attempts in flight have ended. A fresh connection per POST cost a TCP handshake and a
# client's set-up each time, most of an attempt's CPU. The pools live on the loop's thread only.
POOL_MAX_AGE_SECONDS = guard.PIN_SECONDS
# An idle pooled connection is closed after this: under the shortest idle timeout common receivers use (Node.js
# closes after 5 s), so a connection is rarely reused just as the receiver closes it (that attempt would fail,
# and be retried).
KEEPALIVE_SECONDS = 4.0
_pools: dict = {}  # endpoint id -> [pin, client, created (monotonic), last used (monotonic)]


def _pool_for(endpoint_id, pin: netguard.Pin, total: float) -> httpx2.AsyncClient:
    now = time.monotonic()
    held = _pools.get(endpoint_id)
    if held is not None and held[0] == pin and now - held[2] < POOL_MAX_AGE_SECONDS:
        held[3] = now
        return held[1]
    if held is not None:
        _retire(held[1], total)
    for key, (_pin, client, created, used) in list(_pools.items()):
        if now - used > POOL_MAX_AGE_SECONDS or now - created > 2 * POOL_MAX_AGE_SECONDS:
            del _pools[key]
            _retire(client, total)
    client = guard.pooled_client(
        pin,
        max_bytes=_WIRE_BYTES,
        max_connections=settings.RELAY_WEBHOOK_ENDPOINT_IN_FLIGHT,
        keepalive=KEEPALIVE_SECONDS,
        headers={"User-Agent": USER_AGENT, "Content-Type": "application/json"},
    )
    _pools[endpoint_id] = [pin, client, now, now]
    return client


def _retire(client: httpx2.AsyncClient, after: float) -> None:
    """Close a pool no new attempt uses, once the attempts still on it have ended (each within `after`)."""
    loop = asyncio.get_running_loop()
    loop.call_later(after + 1.0, lambda: loop.create_task(client.aclose()))


async def _post(endpoint_id, pin: netguard.Pin, headers: dict, body: bytes, total: float, timeouts) -> tuple:
    client = _pool_for(endpoint_id, pin, total)
    with anyio.fail_after(total):
        async with client.stream("POST", pin.target.url, content=body, headers=headers, timeout=timeouts) as response:
            head = b""
            async for chunk in response.aiter_raw():
                head += chunk
                if len(head) >= HEAD_BYTES:
                    break
            return response.status_code, head[:HEAD_BYTES]


# This process's event loop for the POSTs: anyio's blocking portal, a daemon thread started once per process
# (a forked process starts its own). Every POST of the lane runs on it at once; a thread waits for each.
_loop: dict = {"pid": None, "portal": None, "cm": None}
_loop_lock = threading.Lock()


def _in_loop(fn, *args):
    with _loop_lock:
        if _loop["pid"] != os.getpid():
            _loop["cm"] = anyio.from_thread.start_blocking_portal()  # kept: the portal lives as long as it does
            _loop["portal"] = _loop["cm"].__enter__()
            _loop["pid"] = os.getpid()
            _pools.clear()  # a forked process's copies belong to its parent's loop
            atexit.register(_close_loop, os.getpid())
        portal = _loop["portal"]
    return portal.call(fn, *args)


def _close_loop(pid: int) -> None:
    """At exit, stop the loop while the interpreter is whole (not from the garbage collector at teardown)."""
    if _loop["pid"] == pid and _loop["cm"] is not None:
        _loop["pid"], cm, _loop["cm"] = None, _loop["cm"], None
        cm.__exit__(None, None, None)


def send(target: netguard.Pin | str, endpoint: WebhookEndpoint, webhook_id: str, body: bytes) -> Answer:
    """One signed POST of `body` to the pinned target (or the refusal `prepare` gave). Never raises."""
    started, t0 = timezone.now(), time.monotonic()
    answer = Answer(started_at=started, duration_ms=0)
    total = settings.RELAY_WEBHOOK_TIMEOUT_SECONDS
    try:
        if isinstance(target, str):
            answer.error = target
        else:
            headers = signing.headers(webhook_id, int(time.time()), body, signing_keys(endpoint, started))
            status, head = _in_loop(_post, endpoint.pk, target, headers, body, total, _timeouts())
            answer.status_code, answer.head = status, head.decode("utf-8", "replace")
            if 300 <= status < 400:
                answer.error = f"answered {status}: redirects are not followed"
            elif not answer.ok:
                answer.error = f"answered {status}"
    except TimeoutError:
        answer.error = f"no answer within {total:g} s"
    except httpx2.ConnectTimeout:
        answer.error = f"could not connect within {settings.RELAY_WEBHOOK_CONNECT_TIMEOUT_SECONDS:g} s"
    except httpx2.ReadTimeout:
        answer.error = f"no answer within {settings.RELAY_WEBHOOK_FIRST_BYTE_TIMEOUT_SECONDS:g} s of sending"
    except crypto.SecretUnavailable as exc:
        answer.error = f"the signing secret cannot be read: {exc}"
    except Exception as exc:  # a network error, a refused answer (netguard): a failed attempt
        answer.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    answer.error = answer.error[:300]
    answer.duration_ms = int((time.monotonic() - t0) * 1000)
    return answer


def attempt(job: Job) -> Answer:
    """Resolve and POST, no database work: what the lane's threads run. Never raises."""
    started, t0 = timezone.now(), time.monotonic()
    target = prepare(job.endpoint.url)
    answer = send(target, job.endpoint, job.delivery.webhook_id, job.body)
    answer.started_at = started
    answer.duration_ms = int((time.monotonic() - t0) * 1000)
    return answer


def log_attempt(delivery: Delivery, number: int, answer: Answer) -> None:
    DeliveryAttempt.objects.create(
        delivery=delivery,
        number=number,
        started_at=answer.started_at,
        duration_ms=answer.duration_ms,
        status_code=answer.status_code,
        error=answer.error,
        response_head=answer.head,
        delivered=answer.ok,
    )


# --- claiming, and delivering one delivery --------------------------------------------------------------


def new_lease_owner(name: str) -> str:
    return f"{name[:40]}:{socket.gethostname()[:30]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def claimable(now):
    return Q(outcome=PENDING, next_attempt_at__lte=now) & (
        Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now)
    )


def claim(delivery_ids, lease_owner: str, now=None) -> list[Job]:
    """Lease those of `delivery_ids` that are pending, due, and held by no live lease; their jobs. A lease taken
    by another lane first (or still live) leaves its delivery out: duplicate picks are harmless."""
    now = now or timezone.now()
    until = now + timedelta(seconds=lease_seconds())
    # Each claim its own token (the process's name and a suffix): an attempt that outlived its lease cannot
    # record over a later claim of the same delivery, even by the same lane.
    lease_owner = f"{lease_owner[:90]}:{uuid.uuid4().hex[:8]}"
    # One statement: a lane that loses the race for a row waits for its lock, then finds its lease live and
    # leaves it (PostgreSQL re-checks the WHERE of an UPDATE on the row's newest version).
    if not Delivery.objects.filter(claimable(now), pk__in=list(delivery_ids)).update(
        lease_owner=lease_owner, lease_expires_at=until
    ):
        return []
    held = Delivery.objects.filter(
        pk__in=list(delivery_ids), lease_owner=lease_owner, lease_expires_at=until
    ).select_related("endpoint", "event")
    jobs = []
    for row in held:
        if row.endpoint.paused_at is not None:  # paused between the pick and the claim: keep it for the resume
            _release(row.pk, lease_owner)
        elif row.event.waits_for_batch and _batch_running(row.event.batch_id):
            _wait_for_batch(row, lease_owner, now)
        else:
            jobs.append(Job(delivery=row, endpoint=row.endpoint, body=row.event.body.encode(), lease=lease_owner))
    return jobs


def _release(delivery_id, lease_owner: str, **fields) -> int:
    return Delivery.objects.filter(pk=delivery_id, lease_owner=lease_owner).update(
        lease_owner="", lease_expires_at=None, **fields
    )


def deliver(delivery_id, lease_owner: str | None = None) -> str:
    """One attempt of a pending, due delivery, from claim to record; what happened: delivered, retry, failed,
    paused (the endpoint is paused, or was just paused), waiting (a native cancel whose batch is not done), or
    skipped (not pending, not due, gone, or leased by another attempt). Idempotent."""
    now = timezone.now()
    row = Delivery.objects.filter(pk=delivery_id, outcome=PENDING).select_related("endpoint", "event").first()
    if row is None or row.next_attempt_at > now:
        return "skipped"
    if row.endpoint.paused_at is not None:
        return "paused"
    if row.event.waits_for_batch and _batch_running(row.event.batch_id):
        lease_owner = lease_owner or new_lease_owner("inline")
        claim([delivery_id], lease_owner, now)  # leases it, sees the batch still running, releases it for later
        return "waiting"
    jobs = claim([delivery_id], lease_owner or new_lease_owner("inline"), now)
    if not jobs:
        return "skipped"
    return finish(jobs[0], attempt(jobs[0]))


def finish(job: Job, answer: Answer) -> str:
    """Record an attempt's answer in one transaction, fenced on its lease: an attempt whose lease ran out and
    was taken by another records nothing ("skipped"). Then clear the lease."""
    with transaction.atomic():
        rows = Delivery.objects.filter(pk=job.delivery.pk, outcome=PENDING, lease_owner=job.lease)
        if connection.vendor == "postgresql":
            rows = rows.select_for_update()
        delivery = rows.first()
        if delivery is None:
            log.warning("webhook %s: lease lost before its answer was recorded", job.delivery.webhook_id)
            return "skipped"
        endpoint = WebhookEndpoint.objects.filter(pk=delivery.endpoint_id).first()
        if endpoint is None:  # deleted meanwhile (its deliveries go with it)
            return "skipped"
        outcome = record(delivery, endpoint, answer, test=job.delivery.event.test)
    log.info(
        "webhook %s to %s attempt %d: %s (%s, %d ms)",
        delivery.webhook_id,
        endpoint.public_id,
        delivery.attempts + 1,
        outcome,
        answer.status_code or answer.error,
        answer.duration_ms,
    )
    return outcome


_DELIVERED_SQL = f"""
UPDATE {Delivery._meta.db_table} d
SET outcome = 'delivered', delivered_at = %(now)s, last_attempt_at = %(now)s, last_error = '',
    last_status_code = v.code, attempts = d.attempts + 1, lease_owner = '', lease_expires_at = NULL
FROM unnest(%(ids)s::uuid[], %(codes)s::int[], %(leases)s::text[]) AS v(id, code, lease)
WHERE d.id = v.id AND d.outcome = 'pending' AND d.lease_owner = v.lease
RETURNING d.id
"""


def finish_many(done: list[tuple[Job, Answer]]) -> list[str]:
    """Record many attempts: the plain case — a 2xx from an endpoint that was healthy when claimed, not a
    test — together, in one transaction of two statements (the lane's recorders take what has piled up), fenced
    on each lease like `finish`; every other answer one by one (`finish`). Outcomes in `done`'s order."""
    plain = [
        (job, answer)
        for job, answer in done
        if answer.ok
        and not job.delivery.event.test
        and job.endpoint.failing_since is None
        and not job.endpoint.consecutive_failures
    ]
    outcomes: dict = {}
    if plain:
        now = timezone.now()
        with transaction.atomic():
            held = _mark_delivered(plain, now)
            DeliveryAttempt.objects.bulk_create(
                [
                    DeliveryAttempt(
                        delivery_id=job.delivery.pk,
                        number=job.delivery.attempts + 1,
                        started_at=answer.started_at,
                        duration_ms=answer.duration_ms,
                        status_code=answer.status_code,
                        response_head=answer.head,
                        delivered=True,
                    )
                    for job, answer in plain
                    if job.delivery.pk in held
                ]
            )
        for job, _ in plain:
            outcomes[job.delivery.pk] = "delivered" if job.delivery.pk in held else "skipped"
        if len(held) < len(plain):
            log.warning("webhooks: %d leases lost before their answers were recorded", len(plain) - len(held))
        log.info("webhooks: %d delivered", len(held))
    for job, answer in done:
        if job.delivery.pk not in outcomes:
            outcomes[job.delivery.pk] = finish(job, answer)
    return [outcomes[job.delivery.pk] for job, _ in done]


def _mark_delivered(plain: list[tuple[Job, Answer]], now) -> set:
    """Inside the transaction: the deliveries of `plain` still leased to their attempt, marked delivered."""
    if connection.vendor != "postgresql":
        held = set()
        for job, answer in plain:
            if Delivery.objects.filter(pk=job.delivery.pk, outcome=PENDING, lease_owner=job.lease).update(
                outcome=DELIVERED,
                delivered_at=now,
                last_attempt_at=now,
                last_error="",
                last_status_code=answer.status_code,
                attempts=F("attempts") + 1,
                lease_owner="",
                lease_expires_at=None,
            ):
                held.add(job.delivery.pk)
        return held
    with connection.cursor() as cur:
        # Not waited for on disk: a record lost to a crash means the delivery is sent again (at least once).
        cur.execute("SET LOCAL synchronous_commit = off")
        cur.execute(
            _DELIVERED_SQL,
            {
                "now": now,
                "ids": [str(job.delivery.pk) for job, _ in plain],
                "codes": [answer.status_code for _, answer in plain],
                "leases": [job.lease for job, _ in plain],
            },
        )
        return {row[0] for row in cur.fetchall()}


def _batch_running(batch_id) -> bool:
    return Batch.objects.filter(pk=batch_id, completed_at__isnull=True).exists()


def _wait_for_batch(delivery: Delivery, lease_owner: str, now) -> None:
    """Look again soon: a cancelled native batch is done once its running items stop (their next heartbeat)."""
    pause = min(5.0, max(0.25, (now - delivery.event.created_at).total_seconds() / 4))
    _release(delivery.pk, lease_owner, next_attempt_at=now + timedelta(seconds=pause))


def record(delivery: Delivery, endpoint: WebhookEndpoint, answer: Answer, *, test: bool = False) -> str:
    """Inside the attempt's transaction: its log line, then delivered, a retry, failed or the endpoint paused.
    The lease is cleared with the same write. A test event is sent once: its failure is final and says nothing
    about the endpoint's health."""
    now = timezone.now()
    number = delivery.attempts + 1
    log_attempt(delivery, number, answer)
    fields = {
        "attempts": number,
        "last_attempt_at": now,
        "last_status_code": answer.status_code,
        "lease_owner": "",
        "lease_expires_at": None,
    }
    rows = Delivery.objects.filter(pk=delivery.pk)
    if answer.ok:
        rows.update(outcome=DELIVERED, delivered_at=now, last_error="", **fields)
        if not test and (endpoint.failing_since is not None or endpoint.consecutive_failures):
            _answered(endpoint.pk, delivery.pk, now)
        return "delivered"
    fields["last_error"] = answer.error
    if test:
        rows.update(outcome=FAILED, **fields)
        return "failed"
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        failing_since=Coalesce(F("failing_since"), Value(now, output_field=DateTimeField())),
        last_failure_at=now,
        consecutive_failures=F("consecutive_failures") + 1,
    )
    failing_since, failures = (
        WebhookEndpoint.objects.filter(pk=endpoint.pk).values_list("failing_since", "consecutive_failures").first()
    )
    max_age = timedelta(seconds=settings.RELAY_WEBHOOK_MAX_AGE_SECONDS)
    deadline = delivery.schedule_from + max_age
    exhausted = now >= deadline
    pause_after = timedelta(seconds=settings.RELAY_WEBHOOK_PAUSE_AFTER_SECONDS)
    failing_long = now - failing_since >= pause_after and failures >= settings.RELAY_WEBHOOK_PAUSE_AFTER_FAILURES
    if failing_long or (exhausted and not _delivered_since(endpoint.pk, delivery.schedule_from)):
        # Every attempt has failed for long enough: pause, keep what waits, and tell the owner why.
        reason = (
            f"Every delivery attempt has failed since {failing_since.isoformat(timespec='seconds')} "
            f"({failures} in a row); the last one: {answer.error}"
        )[:300]
        WebhookEndpoint.objects.filter(pk=endpoint.pk, paused_at__isnull=True).update(
            paused_at=now, paused_reason=reason
        )
        rows.update(next_attempt_at=now, **fields)
        log.warning("webhook endpoint %s paused: %s", endpoint.public_id, reason)
        return "paused"
    if exhausted:
        rows.update(outcome=FAILED, **fields)
        return "failed"
    wait = min(gap(number), (deadline - now).total_seconds())
    rows.update(next_attempt_at=now + timedelta(seconds=wait), **fields)
    return "retry"


def gap(number: int) -> float:
    """Seconds before the retry after failed attempt `number`: exponential, capped, jittered into its upper half."""
    base, cap = settings.RELAY_WEBHOOK_RETRY_BASE_SECONDS, settings.RELAY_WEBHOOK_RETRY_MAX_SECONDS
    ceiling = min(cap, base * 2 ** min(number - 1, 60))
    return random.uniform(ceiling / 2, ceiling)


def _delivered_since(endpoint_id, since) -> bool:
    return Delivery.objects.filter(
        endpoint_id=endpoint_id, outcome=DELIVERED, delivered_at__gte=since, event__test=False
    ).exists()


def _answered(endpoint_id, delivery_id, now) -> None:
    """A 2xx: the endpoint is healthy again. If it was failing, its waiting deliveries are due now."""
    WebhookEndpoint.objects.filter(pk=endpoint_id).update(consecutive_failures=0)
    if not WebhookEndpoint.objects.filter(pk=endpoint_id, failing_since__isnull=False).update(
        failing_since=None, last_failure_at=None
    ):
        return
    waiting = list(
        Delivery.objects.filter(endpoint_id=endpoint_id, outcome=PENDING)
        .exclude(pk=delivery_id)
        .order_by("next_attempt_at")
        .values_list("id", flat=True)[:RELEASE_LIMIT]
    )
    Delivery.objects.filter(pk__in=waiting, next_attempt_at__gt=now).update(next_attempt_at=now)
    transaction.on_commit(outbox.wake)
