"""The Celery app `relay`. Configuration lives in Django settings (CELERY_*)."""

import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "relay.settings")

app = Celery("relay")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.worker_init.connect
def _after_django_fixup(sender=None, **kwargs) -> None:
    if _runs_tasks_here(sender):
        # The item worker's `threads` pool (relay/processes.py): its slots are threads of this
        # process, and no worker_process_init comes. Warmed here, before the consumer starts, so the
        # worker reports ready warm. This thread runs no slot: its connection (the catalog's load
        # used it) is not prepared, and is closed.
        from django.db import connections

        from batches import services

        services.warm_up(own_connection=False)
        connections.close_all()
        return
    # Connected here, in the worker's parent, so it runs after Celery's Django fixup's own
    # worker_process_init receiver (which closes every database connection a pool process inherits).
    signals.worker_process_init.connect(_warm_up, weak=False, dispatch_uid="relay.celery.warm_up")
    _warm_parent()


def _runs_tasks_here(worker) -> bool:
    """Does this worker run its tasks in its own process, as threads (the `threads` pool)? Prefork
    forks pool processes, and solo sends worker_process_init itself."""
    pool = getattr(worker, "pool_cls", "")
    name = pool if isinstance(pool, str) else getattr(pool, "__module__", "")
    return "thread" in name


def _warm_parent() -> None:
    """What every pool process would load for itself, loaded once here, before they are forked: they
    inherit it (the catalog cache of relay.routing.warm; its generation is checked at use, as always).
    Best effort; the parent's database connections are closed again, none is inherited."""
    import logging

    from django.db import connections

    from relay import routing

    try:
        routing.warm()
    except Exception:
        logging.getLogger(__name__).warning("catalog warm-up failed; each process loads its own", exc_info=True)
    finally:
        connections.close_all()


def _warm_up(**kwargs) -> None:
    """Each pool process connects and loads what every item needs before it takes its first task
    (batches.services.warm_up), not during it; the worker reports ready once its processes are up."""
    from batches import services

    services.warm_up()
