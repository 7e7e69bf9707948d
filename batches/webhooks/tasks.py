"""Thin Celery tasks on the control queue. Messages carry only a delivery's id: PostgreSQL decides what is sent."""

from celery import shared_task

from batches.webhooks import delivery


# Idempotent (a pending, due delivery, held with SKIP LOCKED): a duplicate or a re-sent message is harmless.
@shared_task(name="batches.webhooks.tasks.deliver", ignore_result=True, acks_late=True)
def deliver(delivery_id: str) -> str:
    return delivery.deliver(delivery_id)


@shared_task(name="batches.webhooks.tasks.sweep", ignore_result=True)
def sweep() -> dict:
    return delivery.sweep()
