"""Operator pages outside the API: the landing page at `/` and the admin's read-only health page."""

import logging

from django.contrib import admin
from django.db.models import Count
from django.shortcuts import render
from django.utils import timezone

from relay import metrics

log = logging.getLogger(__name__)

CELERY_INSPECT_TIMEOUT_S = 1.0


def landing(request):
    """`/`: where things are, instead of a 404."""
    return render(request, "relay/landing.html", {})


def celery_workers() -> tuple[list[dict], str]:
    """Workers that answered a broadcast within CELERY_INSPECT_TIMEOUT_S: name, pool size, tasks served."""
    from relay.celery import app

    try:
        stats = app.control.inspect(timeout=CELERY_INSPECT_TIMEOUT_S).stats() or {}
    except Exception as exc:  # the broker is down: say so on the page
        return [], f"{type(exc).__name__}: {exc}"[:300]
    workers = []
    for name, s in sorted(stats.items()):
        pool = s.get("pool") or {}
        workers.append(
            {
                "name": name,
                "concurrency": pool.get("max-concurrency"),
                "pool": _pool_kind(pool),
                "served": sum((s.get("total") or {}).values()),
                "uptime_s": s.get("uptime"),
            }
        )
    return workers, ""


def _pool_kind(pool: dict) -> str:
    """What a worker's slots are: the item worker runs threads of one process (relay/processes.py), the
    control worker forked processes. Celery's stats say so by the keys its pool reports."""
    if "threads" in pool:  # started on demand, up to the concurrency
        return f"threads ({pool['threads']} started)"
    return f"{len(pool.get('processes') or [])} processes"


def _safe(fn, default):
    try:
        return fn(), ""
    except Exception as exc:
        log.warning("health page: %s failed", fn.__name__, exc_info=True)
        return default, f"{type(exc).__name__}: {exc}"[:300]


def health_page(request):
    """`/admin/health/` (staff only): queues, workers, slots, breakers, items — read-only."""
    from batches.models import Item

    queues, queues_error = _safe(metrics.queue_depths, {})
    breakers, breakers_error = _safe(metrics.breaker_snapshots, [])
    workers, workers_error = celery_workers()
    items = dict(Item.objects.values_list("state").annotate(n=Count("pk")).order_by())
    context = {
        **admin.site.each_context(request),
        "title": "Health",
        "queues": queues,
        "queues_error": queues_error,
        "workers": workers,
        "workers_error": workers_error,
        "slots_busy": metrics.slots_busy(),
        "breakers": [
            {"host": h, "key": k, **snap, "open_until_dt": _dt(snap["open_until"])} for h, k, snap in breakers
        ],
        "breakers_error": breakers_error,
        "items": items,
        "now": timezone.now(),
    }
    return render(request, "admin/relay_health.html", context)


def _dt(epoch):
    if epoch is None:
        return None
    from datetime import UTC, datetime

    return datetime.fromtimestamp(epoch, UTC)
