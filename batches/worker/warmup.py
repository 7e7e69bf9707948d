"""A worker process's warm-up: what its first item would otherwise pay, loaded before it takes work,
and the Celery signals that run it (connected from the app config's ready(): relay/celery.py imports
nothing of the batch engine)."""

import logging
import os
import socket
import threading
import time

from celery import signals
from django.db import connection, connections

from batches import dispatch
from batches.lifecycle import claim
from batches.worker.bookkeeper import bookkeeper
from core import warmup as warm_up_runner
from core.redis import get_redis
from gateway import routing, upstream

log = logging.getLogger(__name__)


def warm_up(*, own_connection: bool = True) -> None:
    """What a worker process's first item would otherwise pay (called once per process before it takes
    work: `connect` below): its database connection with the claim statements prepared,
    its Redis and broker connections, the catalog of the policies that batches may run under. Measured:
    a fresh process's first item took 73 ms against 12 ms for its second on a quiet machine, and
    300-650 ms when the 16-24 pool processes of a scale-out start together on 2 cores. Best effort:
    whatever fails here is done again by the first item. `own_connection=False`: the calling thread
    runs no item (the `threads` pool's main thread), so its own connection is not prepared."""
    steps = (
        *((("database", claim.warm_up),) if own_connection else ()),
        ("redis", lambda: get_redis().ping()),
        ("broker", _warm_broker),
        # Inherited from the worker's parent (relay/celery.py): loaded again only if the catalog changed
        # since the fork (one Redis read otherwise).
        ("catalog", routing.warm),
        ("upstream", upstream.warm),
        ("bookkeeper", _warm_bookkeeper),
    )
    warm_up_runner.run_warm_up(steps, log, what="worker process", first="item")


def _warm_bookkeeper() -> None:
    """The bookkeeper thread's connection, with the claim statements prepared (it claims ahead)."""
    if connection.vendor == "postgresql":
        bookkeeper().submit(claim.warm_up).result(timeout=30)


def _warm_broker() -> None:
    """The first wake-up a process sends (`pass_on`) cost 12 ms of CPU, 0.5 ms after: the result backend
    is resolved (an entry-points scan, even with results ignored) and the producer's connection made."""
    dispatch.app.backend  # noqa: B018 - resolved on first access
    with dispatch.app.producer_or_acquire() as producer:
        producer.channel  # noqa: B018 - connects
    dispatch.queue_length(dispatch.ITEM_QUEUE)


# --- the Celery signals that run it --------------------------------------------------------------


def connect() -> None:
    """Connect the worker's warm-up to Celery's worker_init (called from the batches app's ready(),
    which a worker runs before it sends worker_init)."""
    signals.worker_init.connect(_after_django_fixup, weak=False, dispatch_uid="batches.worker.warm_up")


def _after_django_fixup(sender=None, **kwargs) -> None:
    if _runs_tasks_here(sender):
        # The item worker's `threads` pool (relay/processes.py): its slots are threads of this
        # process, and no worker_process_init comes. Warmed here, before the consumer starts, so the
        # worker reports ready warm. This thread runs no slot: its connection (the catalog's load
        # used it) is not prepared, and is closed.
        warm_up(own_connection=False)
        connections.close_all()
        announce_slots(int(getattr(sender, "concurrency", 0) or 0))
        return
    # Connected here, in the worker's parent, so it runs after Celery's Django fixup's own
    # worker_process_init receiver (which closes every database connection a pool process inherits).
    signals.worker_process_init.connect(_warm_up_process, weak=False, dispatch_uid="batches.worker.warm_process")
    _warm_parent()


def _runs_tasks_here(worker) -> bool:
    """Does this worker run its tasks in its own process, as threads (the `threads` pool)? Prefork
    forks pool processes, and solo sends worker_process_init itself."""
    pool = getattr(worker, "pool_cls", "")
    name = pool if isinstance(pool, str) else getattr(pool, "__module__", "")
    return "thread" in name


def _warm_parent() -> None:
    """What every pool process would load for itself, loaded once here, before they are forked: they
    inherit it (the catalog cache of gateway.routing.warm; its generation is checked at use, as always).
    Best effort; the parent's database connections are closed again, none is inherited."""
    try:
        routing.warm()
    except Exception:
        log.warning("catalog warm-up failed; each process loads its own", exc_info=True)
    finally:
        connections.close_all()


def _warm_up_process(**kwargs) -> None:
    """Each pool process connects and loads what every item needs before it takes its first task
    (`warm_up`), not during it; the worker reports ready once its processes are up."""
    warm_up()


# --- the slots this worker offers, for /metrics ---------------------------------------------------

# One key per item-worker process, refreshed while it lives: /metrics lists every live worker's
# slots (busy 0 of 8 included), which the running items alone cannot show for an idle one.
SLOTS_KEY_PREFIX = "relay:worker_slots:"
SLOTS_REFRESH_S = 10.0
SLOTS_TTL_S = 35


def announce_slots(capacity: int) -> None:
    """Keep this process's slots announced while it lives (a daemon thread refreshes the key; it
    expires SLOTS_TTL_S after the process dies)."""
    if capacity <= 0:
        return

    def refresh() -> None:
        while True:
            announce_once(capacity)
            time.sleep(SLOTS_REFRESH_S)

    threading.Thread(target=refresh, name="slots-announcer", daemon=True).start()


def announce_once(capacity: int) -> None:
    """`relay:worker_slots:<host>:<pid>` = capacity, for SLOTS_TTL_S."""
    try:
        get_redis().set(f"{SLOTS_KEY_PREFIX}{socket.gethostname()}:{os.getpid()}", capacity, ex=SLOTS_TTL_S)
    except Exception:  # Redis away: /metrics shows the worker again once it is back
        log.debug("could not announce this worker's slots", exc_info=True)
