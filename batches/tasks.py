"""Thin Celery tasks. Messages carry no state: Postgres decides what runs."""

from celery import shared_task

from batches import services


@shared_task(name="batches.tasks.run_items", ignore_result=True, acks_late=True)
def run_items() -> int:
    return services.drain()


@shared_task(name="batches.tasks.sweep", ignore_result=True)
def sweep() -> dict:
    return services.sweep()
