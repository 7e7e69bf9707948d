"""Delivering webhooks: one signed POST per attempt, its record, the retry schedule, pausing, the sweep.

At least once: a delivery is POSTed until an answer is 2xx, with the same `webhook-id` and body on every
retry and a fresh timestamp and signature each time; receivers dedupe on the webhook-id.

- An attempt holds its delivery's row (SKIP LOCKED) from before the POST until its record commits, so two
  messages for one delivery never send it twice at once, and a worker killed mid-POST releases the row
  with its connection: the next sweep sends it again. The POST has a total deadline of 10 s, well inside
  the database's idle-in-transaction timeout (30 s); the address is resolved before the row is taken.
- 2xx is delivered. Anything else (another status, a 3xx: redirects are never followed, a network error,
  a refused address) is a failed attempt, retried after base × 2^(n-1) seconds capped at the maximum
  (RELAY_WEBHOOK_RETRY_BASE_SECONDS, RELAY_WEBHOOK_RETRY_MAX_SECONDS), jittered down to half of that (so a
  gap never exceeds the maximum), until RELAY_WEBHOOK_MAX_AGE_SECONDS after the event: then it fails.
- An endpoint whose every delivery has failed for RELAY_WEBHOOK_MAX_AGE_SECONDS is paused instead: its
  pending deliveries are kept and sent when an operator resumes it (services.resume).
- A failing endpoint is probed: when it has not been tried for RELAY_WEBHOOK_PROBE_SECONDS, the sweep makes
  its next delivery due now; the first 2xx after failures makes all its waiting deliveries due now. So a
  receiver back from an outage gets its backlog within about a probe interval, however long the backoff.
- The sweep (every RELAY_WEBHOOK_SWEEP_SECONDS, on the control queue) re-sends the message of every pending
  delivery overdue by two sweep intervals that no message carries any more (each hand-off is marked in the
  broker's Redis until a worker takes it): a Redis flush, a killed worker or a broker outage loses nothing,
  and a backlog of queued messages is not duplicated.
"""

import atexit
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import anyio
from django.conf import settings
from django.db import connection, transaction
from django.db.models import DateTimeField, F, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from batches import dispatch
from batches.models import Batch
from batches.tools import netguard
from batches.webhooks import guard, outbox, signing
from batches.webhooks.models import Delivery, DeliveryAttempt, DeliveryOutcome, WebhookEndpoint
from relay import crypto

log = logging.getLogger(__name__)

PENDING, DELIVERED, FAILED = DeliveryOutcome.PENDING, DeliveryOutcome.DELIVERED, DeliveryOutcome.FAILED

# One attempt's whole budget: connect, send, the answer's status line and its first KiB.
TIMEOUT_SECONDS = 10.0
HEAD_BYTES = 1024
# What an attempt may read off the wire (headers and a few body reads) before it stops listening.
_WIRE_BYTES = netguard.MAX_HEADER_BYTES + 256 * 1024
USER_AGENT = "relay-webhooks/1"
# Retries due within this are sent as delayed messages; later ones are found by the sweep.
COUNTDOWN_MAX_SECONDS = 60.0
# Overdue deliveries the sweep re-sends at most per run (the rest at the next).
SWEEP_LIMIT = 1000
# Deliveries made due at once when a failing endpoint answers again (the rest by the sweep).
RELEASE_LIMIT = 1000


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


# --- one attempt ---------------------------------------------------------------------------------


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
        return guard.resolve(url)
    except (guard.Blocked, guard.Unresolvable) as exc:
        return f"refused: {exc.message}"


async def _post(pin: netguard.Pin, headers: dict, body: bytes) -> tuple[int, bytes]:
    client, _budget = netguard.pinned_client(
        pin,
        timeout=TIMEOUT_SECONDS,
        max_bytes=_WIRE_BYTES,
        headers={"User-Agent": USER_AGENT, "Content-Type": "application/json", **headers},
    )
    async with client:
        with anyio.fail_after(TIMEOUT_SECONDS):
            async with client.stream("POST", pin.target.url, content=body) as response:
                head = b""
                async for chunk in response.aiter_raw():
                    head += chunk
                    if len(head) >= HEAD_BYTES:
                        break
                return response.status_code, head[:HEAD_BYTES]


# This process's event loop for the POSTs: anyio's blocking portal, a daemon thread started once per process
# (a forked pool process starts its own). A fresh loop per delivery (anyio.run) cost more than the POST itself.
_loop: dict = {"pid": None, "portal": None, "cm": None}
_loop_lock = threading.Lock()


def _in_loop(fn, *args):
    with _loop_lock:
        if _loop["pid"] != os.getpid():
            _loop["cm"] = anyio.from_thread.start_blocking_portal()  # kept: the portal lives as long as it does
            _loop["portal"] = _loop["cm"].__enter__()
            _loop["pid"] = os.getpid()
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
    try:
        if isinstance(target, str):
            answer.error = target
        else:
            headers = signing.headers(webhook_id, int(time.time()), body, signing_keys(endpoint, started))
            status, head = _in_loop(_post, target, headers, body)
            answer.status_code, answer.head = status, head.decode("utf-8", "replace")
            if 300 <= status < 400:
                answer.error = f"answered {status}: redirects are not followed"
            elif not answer.ok:
                answer.error = f"answered {status}"
    except TimeoutError:
        answer.error = f"no answer within {TIMEOUT_SECONDS:g} s"
    except crypto.SecretUnavailable as exc:
        answer.error = f"the signing secret cannot be read: {exc}"
    except Exception as exc:  # a network error, a refused answer (netguard): a failed attempt
        answer.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    answer.error = answer.error[:300]
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


# --- delivering one delivery ------------------------------------------------------------------------


def deliver(delivery_id) -> str:
    """One attempt of a pending, due delivery; what happened: delivered, retry, failed, paused (the endpoint
    is paused, or was just paused), waiting (a native cancel whose batch is not done), or skipped (not
    pending, not due, gone, or another worker holds it). Idempotent: duplicate messages are harmless."""
    dispatch.webhook_taken(delivery_id)
    now = timezone.now()
    row = Delivery.objects.filter(pk=delivery_id, outcome=PENDING).select_related("endpoint", "event").first()
    if row is None or row.next_attempt_at > now:
        return "skipped"
    if row.endpoint.paused_at is not None:
        return "paused"
    if row.event.waits_for_batch and _batch_running(row.event.batch_id):
        _wait_for_batch(row, now)
        return "waiting"
    target = prepare(row.endpoint.url)  # before the row is held: a slow resolver must not hold it
    with transaction.atomic():
        delivery = _hold(delivery_id, now)
        if delivery is None:
            return "skipped"
        answer = send(target, row.endpoint, delivery.webhook_id, row.event.body.encode())
        outcome = record(delivery, row.endpoint, answer)
    log.info(
        "webhook %s to %s attempt %d: %s (%s, %d ms)",
        delivery.webhook_id,
        row.endpoint.public_id,
        delivery.attempts + 1,
        outcome,
        answer.status_code or answer.error,
        answer.duration_ms,
    )
    return outcome


def _hold(delivery_id, now) -> Delivery | None:
    qs = Delivery.objects.filter(pk=delivery_id, outcome=PENDING, next_attempt_at__lte=now)
    if connection.vendor == "postgresql":
        qs = qs.select_for_update(skip_locked=True)
    return qs.first()


def _batch_running(batch_id) -> bool:
    return Batch.objects.filter(pk=batch_id, completed_at__isnull=True).exists()


def _wait_for_batch(delivery: Delivery, now) -> None:
    """Look again soon: a cancelled native batch is done once its running items stop (their next heartbeat)."""
    pause = min(5.0, max(0.25, (now - delivery.event.created_at).total_seconds() / 4))
    Delivery.objects.filter(pk=delivery.pk, outcome=PENDING).update(next_attempt_at=now + timedelta(seconds=pause))
    transaction.on_commit(lambda: outbox.send([delivery.pk], countdown=pause))


def record(delivery: Delivery, endpoint: WebhookEndpoint, answer: Answer) -> str:
    """Inside the attempt's transaction: its log line, then delivered, a retry, failed or the endpoint paused."""
    now = timezone.now()
    number = delivery.attempts + 1
    log_attempt(delivery, number, answer)
    fields = {"attempts": number, "last_attempt_at": now, "last_status_code": answer.status_code}
    rows = Delivery.objects.filter(pk=delivery.pk)
    if answer.ok:
        rows.update(outcome=DELIVERED, delivered_at=now, last_error="", **fields)
        if endpoint.failing_since is not None:  # as read before the POST; a failure since is cleared by the next 2xx
            _answered(endpoint.pk, delivery.pk, now)
        return "delivered"
    fields["last_error"] = answer.error
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        failing_since=Coalesce(F("failing_since"), Value(now, output_field=DateTimeField())), last_failure_at=now
    )
    failing_since = WebhookEndpoint.objects.filter(pk=endpoint.pk).values_list("failing_since", flat=True).first()
    max_age = timedelta(seconds=settings.RELAY_WEBHOOK_MAX_AGE_SECONDS)
    deadline = delivery.schedule_from + max_age
    exhausted = now >= deadline
    if now - failing_since >= max_age or (exhausted and not _delivered_since(endpoint.pk, delivery.schedule_from)):
        # Every delivery has failed for as long as a delivery may retry: pause, keep what waits.
        WebhookEndpoint.objects.filter(pk=endpoint.pk, paused_at__isnull=True).update(paused_at=now)
        rows.update(next_attempt_at=now, **fields)
        log.warning("webhook endpoint %s paused: every delivery failed since %s", endpoint.public_id, failing_since)
        return "paused"
    if exhausted:
        rows.update(outcome=FAILED, **fields)
        return "failed"
    wait = min(gap(number), (deadline - now).total_seconds())
    rows.update(next_attempt_at=now + timedelta(seconds=wait), **fields)
    if wait <= COUNTDOWN_MAX_SECONDS:
        transaction.on_commit(lambda: outbox.send([delivery.pk], countdown=wait))
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
    transaction.on_commit(lambda: outbox.send(waiting))


# --- the sweep ------------------------------------------------------------------------------------


def sweep() -> dict:
    """Re-send the messages of overdue deliveries that no message carries any more (a Redis flush, a killed
    worker, a broker outage) and probe failing endpoints. Idempotent; any replica may run it, on the control
    queue. Rows an attempt holds are skipped; so are deliveries whose message still waits in the broker (a
    backlog is not a loss: re-sending it would only grow it)."""
    now = timezone.now()
    grace = 2 * settings.RELAY_WEBHOOK_SWEEP_SECONDS
    with transaction.atomic():
        overdue = Delivery.objects.filter(
            outcome=PENDING, next_attempt_at__lte=now - timedelta(seconds=grace), endpoint__paused_at__isnull=True
        ).order_by("next_attempt_at")
        if connection.vendor == "postgresql":
            overdue = overdue.select_for_update(skip_locked=True, of=("self",))
        ids = list(overdue.values_list("id", flat=True)[:SWEEP_LIMIT])
    waiting = dispatch.webhooks_in_flight(ids)
    lost = [pk for pk in ids if str(pk) not in waiting]
    outbox.send(lost)
    return {"resent": len(lost), "probed": probe(now)}


def probe(now) -> int:
    """Failing endpoints not tried for RELAY_WEBHOOK_PROBE_SECONDS: their next pending delivery is due now."""
    every = timedelta(seconds=settings.RELAY_WEBHOOK_PROBE_SECONDS)
    stale = WebhookEndpoint.objects.filter(
        failing_since__isnull=False, paused_at__isnull=True, last_failure_at__lt=now - every
    ).values_list("id", flat=True)[:100]
    probed = []
    for endpoint_id in stale:
        first = (
            Delivery.objects.filter(endpoint_id=endpoint_id, outcome=PENDING)
            .order_by("next_attempt_at")
            .values_list("id", "next_attempt_at")
            .first()
        )
        if first is None or first[1] <= now + every:
            continue  # nothing waits, or one is due soon anyway
        if Delivery.objects.filter(pk=first[0], outcome=PENDING).update(next_attempt_at=now):
            probed.append(first[0])
    outbox.send(probed)
    return len(probed)
