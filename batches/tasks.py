"""Thin Celery tasks. Messages carry no state: Postgres decides what runs."""

from celery import shared_task

from batches import dispatch, sweeper
from batches.provider import jobs as provider_jobs
from batches.surfaces.openai import finalize, validation
from batches.worker import drain as worker_drain


@shared_task(name="batches.tasks.run_items", ignore_result=True, acks_late=True)
def run_items() -> int:
    return worker_drain.drain()


@shared_task(name="batches.tasks.sweep", ignore_result=True)
def sweep() -> dict:
    return sweeper.sweep()


# A delayed wake-up (batches.dispatch.wake_at): an item's backoff or a batch's wait for capacity ended.
@shared_task(name="batches.tasks.wake", ignore_result=True)
def wake() -> int:
    return dispatch.wake_workers()


# A batch's window closes (batches.sweeper.schedule_expiries sends it for the moment of its `expires_at`).
@shared_task(name="batches.tasks.expire_batch", ignore_result=True, acks_late=True)
def expire_batch(batch_id: str) -> bool:
    return sweeper.expire_on_time(batch_id)


# The OpenAI surface's two background steps. Both are idempotent (they act only
# on a batch in the expected status, holding its row), so a duplicate or a
# message re-sent by the sweeper is harmless.
@shared_task(name="batches.tasks.validate_openai_batch", ignore_result=True, acks_late=True)
def validate_openai_batch(batch_id: str) -> None:
    validation.validate(batch_id)


@shared_task(name="batches.tasks.finalize_openai_batch", ignore_result=True, acks_late=True)
def finalize_openai_batch(batch_id: str) -> None:
    finalize.finalize(batch_id)


# Provider batch mode (batches/provider/): one task takes a job one step on (send, find, poll, results);
# another stops a cancelled or expired batch's jobs. Both idempotent: each step takes its job first.
@shared_task(name="batches.tasks.provider_job", ignore_result=True, acks_late=True)
def provider_job(job_id: str) -> None:
    provider_jobs.advance(job_id)


@shared_task(name="batches.tasks.provider_cancel", ignore_result=True, acks_late=True)
def provider_cancel(batch_id: str) -> None:
    provider_jobs.cancel_jobs(batch_id)


@shared_task(name="batches.tasks.retention", ignore_result=True)
def retention() -> dict:
    """Expired files, native batches past RELAY_NATIVE_BATCH_RETENTION_SECONDS, the items of ended OpenAI and
    Anthropic batches past their item retention (their batch objects stay), stale revoked tokens."""
    from batches import retention as retention_

    return retention_.sweep()
