"""Celery tasks of the gateway core: thin, each calls one service."""

import logging

from celery import shared_task

from relay import metrics_rollup

log = logging.getLogger(__name__)


@shared_task(name="relay.tasks.roll_up_metrics", ignore_result=True)
def roll_up_metrics() -> int:
    """Count the usage events written since the last run into /metrics' rollup (relay/metrics_rollup.py)."""
    if _rollup_idle():
        return 0
    return metrics_rollup.catch_up()


def _rollup_idle() -> bool:
    """Nothing for the rollup to do: no event written since its last run and no gap left to look for again.
    One statement instead of a run's locked transaction, gap look-ups and cursor writes, every beat, on a
    relay nobody calls."""
    from django.db.models import Subquery

    from core.models import UsageRollupCursor
    from usage.models import UsageEvent

    newest = Subquery(UsageEvent.objects.order_by("-pk").values("pk")[:1])
    cursor = UsageRollupCursor.objects.filter(pk=1).annotate(newest=newest)
    row = cursor.values_list("last_id", "gaps", "newest").first()
    if row is None:  # the rollup's first run makes its cursor
        return False
    last_id, gaps, newest_id = row
    return not gaps and (newest_id is None or newest_id <= last_id)
