"""The only importer of the Celery app: the queue names, hand-offs of control work, re-dispatch,
wake-ups of the item workers, and the length of a queue. Messages carry no state: PostgreSQL decides
what runs; a lost message costs latency until the next sweep, never work."""

import logging
import os

import redis

# The relay's Celery app (relay.celery), current in every process once Django has loaded the shell app.
from celery import current_app as app
from django.conf import settings
from django.db import connection
from django.utils import timezone
from kombu.exceptions import ChannelError
from kombu.transport.redis import PRIORITY_STEPS, Channel

from batches.lifecycle.states import CLAIMABLE_SQL, St, due
from batches.models import Item
from batches.queues import CONTROL_QUEUE, ITEM_QUEUE, QUEUES  # noqa: F401 - the names, read here
from core.redis import get_redis

log = logging.getLogger(__name__)

# --- queues -------------------------------------------------------------------------------------


def hand_off(task: str, batch_id, queue: str = CONTROL_QUEUE) -> None:
    """Send a control message (validate/finalize) by task name; if it is lost, the sweeper sends it again."""
    try:
        app.send_task(f"batches.tasks.{task}", args=[str(batch_id)], queue=queue)
    except Exception:  # the broker is down: the sweeper re-dispatches
        log.warning("could not hand off %s for batch %s", task, batch_id, exc_info=True)


def hand_off_at(task: str, obj_id, when) -> None:
    """`hand_off` delivered at `when` (a countdown): a provider job's next poll or send. If it is lost (a Redis
    flush, a restart), the sweeper finds the step due and sends it again."""
    delay = max(0.0, (when - timezone.now()).total_seconds()) if when is not None else 0.0
    try:
        app.send_task(f"batches.tasks.{task}", args=[str(obj_id)], queue=CONTROL_QUEUE, countdown=delay)
    except Exception:  # the broker is down: the sweeper re-dispatches
        log.warning("could not schedule %s for %s", task, obj_id, exc_info=True)


def hand_off_once_at(task: str, obj_id, when) -> bool:
    """`hand_off_at`, once per (task, object, moment) however many sweeps ask for it (deduplicated in Redis
    until a minute past `when`). True if it was sent now. A lost message is the sweeper's to make up for."""
    delay = max(0.0, (when - timezone.now()).total_seconds())
    try:
        key = f"relay:at:{task}:{obj_id}:{int(when.timestamp() * 1000)}"
        if not get_redis().set(key, 1, nx=True, ex=int(delay) + 60):
            return False
    except redis.RedisError:
        return False
    hand_off_at(task, obj_id, when)
    return True


def redispatch(task: str, batch_id) -> None:
    """At most one re-sent control message per batch per lease period, however often the sweeper runs."""
    try:
        key = f"batch_redispatch:{task}:{batch_id}"
        fresh = get_redis().set(key, 1, nx=True, ex=settings.RELAY_BATCH_LEASE_SECONDS)
    except redis.RedisError:
        return
    if fresh:
        hand_off(task, batch_id)


_broker_clients: dict = {}


def _broker_redis():
    """A plain client on a Redis broker, with kombu's queue key names ((client, key names of a queue)),
    or None when the broker is something else (then the broker's own connection is asked)."""
    url = settings.CELERY_BROKER_URL or ""  # what the app was configured from (read live: tests change it)
    pid = os.getpid()
    hit = _broker_clients.get(url)
    if hit is not None and hit[0] == pid:
        return hit[1:]
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    options = settings.CELERY_BROKER_TRANSPORT_OPTIONS or {}
    prefix, steps = options.get("global_keyprefix", ""), options.get("priority_steps", PRIORITY_STEPS)

    def keys(queue: str) -> list[str]:  # kombu.transport.redis.Channel._q_for_pri over every step
        return [prefix + (f"{queue}{Channel.sep}{pri}" if pri else queue) for pri in steps]

    # Short timeouts: a create answers 503 within seconds when the broker is down (`broker_reachable`).
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    _broker_clients[url] = (pid, client, keys)
    return client, keys


def queue_lengths(queues=QUEUES) -> dict[str, int | None]:
    """Messages waiting in each broker queue (None for one that could not be read). On a Redis broker:
    one pipelined LLEN per priority key of every queue, what kombu's own queue_declare(passive=True)
    reads, without a pooled broker connection and channel per call (measured 3.3 ms of CPU and 6 ms
    per call that way; 0.08 ms so)."""
    direct = _broker_redis()
    if direct is None:
        return {queue: _declared_length(queue) for queue in queues}
    client, keys = direct
    try:
        pipe = client.pipeline(transaction=False)
        steps = [keys(queue) for queue in queues]
        for queue_keys in steps:
            for key in queue_keys:
                pipe.llen(key)
        lengths = iter(pipe.execute())
        return {queue: sum(next(lengths) for _ in queue_keys) for queue, queue_keys in zip(queues, steps, strict=True)}
    except redis.RedisError:  # the broker is down: the sweeper will try again
        log.warning("could not read the length of queues %s", ", ".join(queues), exc_info=True)
        return dict.fromkeys(queues)


def queue_length(queue: str) -> int | None:
    """Messages waiting in one broker queue (None if unreachable)."""
    return queue_lengths((queue,))[queue]


def _declared_length(queue: str) -> int | None:
    try:
        with app.connection_or_acquire() as conn:
            return conn.default_channel.queue_declare(queue=queue, passive=True).message_count
    except ChannelError:  # no such queue yet: nothing is waiting in it
        return 0
    except Exception:  # the broker is down: the sweeper will try again
        log.warning("could not read the length of queue %s", queue, exc_info=True)
        return None


def broker_reachable() -> bool:
    """Whether the broker answers now (a Redis broker: one PING; another kind is assumed up)."""
    direct = _broker_redis()
    if direct is None:
        return True
    try:
        return bool(direct[0].ping())
    except redis.RedisError:
        return False


# A batch that may run now with an item that may run now (indexed, as lifecycle.stop's pending probe).
_CLAIMABLE_WORK_SQL = f"""
SELECT EXISTS (
    SELECT 1 FROM batches_batch b
    WHERE b.status IN ({CLAIMABLE_SQL}) AND (b.not_before IS NULL OR b.not_before <= %(now)s)
      AND (SELECT idx FROM batches_item i WHERE i.batch_id = b.id AND i.state = 'available'
           AND (i.not_before IS NULL OR i.not_before <= %(now)s) ORDER BY idx LIMIT 1) IS NOT NULL
)
"""


def has_claimable_work() -> bool:
    """Is any item claimable now (its batch may run, it is available and due)?"""
    now = timezone.now()
    if connection.vendor != "postgresql":
        return Item.objects.filter(due(now), state=St.AVAILABLE).exists()
    with connection.cursor() as cursor:
        cursor.execute(_CLAIMABLE_WORK_SQL, {"now": now})
        return cursor.fetchone()[0]


def wake_workers(known_work: bool = False) -> int:
    """Keep at most RELAY_BATCH_WAKEUP_WINDOW wake-ups queued while work is available (`known_work`: the
    caller just saw some, skip the check).

    Redis never holds one message per item: which item runs is decided at
    claim time. A lost wake-up only costs latency until the next sweep. The
    window bounds what one top-up queues, not the work in flight: every drain
    that finds work passes a wake-up on (`pass_on`), so in-flight work grows to
    every slot that consumes the queue, however many workers there are.
    """
    if not known_work and not has_claimable_work():
        return 0
    queued = queue_length(ITEM_QUEUE)
    if queued is None:
        return 0
    missing = max(0, settings.RELAY_BATCH_WAKEUP_WINDOW - queued)
    for _ in range(missing):
        app.send_task("batches.tasks.run_items", queue=ITEM_QUEUE)
    return missing


# Wake-ups a drain passes on: two, so idle slots fill in a doubling chain (3 hops for 8 slots, not 8).
# Measured (scale-out, 3 workers, 24 slots, 16 wake-ups queued by the submit): every slot busy 0.21-0.30 s
# after the 202 with one.
PASS_ON = 2


def pass_on() -> bool:
    """A drain found work: queue PASS_ON more wake-ups unless one is already waiting, so idle slots of any
    worker join in. Slots fill until a wake-up stays queued (every consuming slot is busy); when the work
    runs out, the few surplus wake-ups find nothing and end. True if they were sent."""
    if queue_length(ITEM_QUEUE) != 0:  # one is waiting (or the broker is down: the sweeper wakes them)
        return False
    try:
        for _ in range(PASS_ON):
            app.send_task("batches.tasks.run_items", queue=ITEM_QUEUE)
    except Exception:
        log.warning("could not pass a wake-up on", exc_info=True)
        return False
    return True


def wake_at(when) -> None:
    """Wake the workers when `when` comes (an item's backoff or a batch's wait ends), not at the next sweep.

    One delayed message per 100 ms slot however many items become due in it
    (deduplicated in Redis); the sweeper covers a lost one.
    """
    delay = max(0.0, (when - timezone.now()).total_seconds())
    slot = int(when.timestamp() * 10)
    try:
        if not get_redis().set(f"relay:wake_at:{slot}", 1, nx=True, ex=int(delay) + 60):
            return
    except redis.RedisError:
        return
    try:
        app.send_task("batches.tasks.wake", countdown=delay, queue=CONTROL_QUEUE)
    except Exception:  # the broker is down: the sweeper wakes them
        log.warning("could not schedule a wake-up", exc_info=True)
