"""Celery tasks of the gateway core: thin, each calls one service."""

import logging

from celery import shared_task

from relay import metrics_rollup

log = logging.getLogger(__name__)


@shared_task(name="relay.tasks.roll_up_metrics", ignore_result=True)
def roll_up_metrics() -> int:
    """Count the usage events written since the last run into /metrics' rollup (relay/metrics_rollup.py)."""
    return metrics_rollup.catch_up()
