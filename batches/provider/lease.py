"""A provider job's lease: who holds the job's step now. Every take gives the job a new lease token, and every
write of that step is fenced on it (`move`), so a process whose lease ran out, while a second taker has the job,
can no longer move it, above all not to `submitting`: a job is created at the provider once. A send renews its
lease while it reads the records out (`renewer`) and stops when another taker has the job."""

import logging
import time
import uuid

from django.db.models import Q
from django.utils import timezone

from batches.provider.models import JobStatus, ProviderJob
from gateway import batch_apis as wire
from usage import job_budgets

log = logging.getLogger(__name__)

SEND_LEASE_S = 600  # building and uploading up to 200 MB
# A create whose answer was lost is looked for once no create could still be in flight (its read timeout).
FIND_AFTER_S = 150
RENEW_EVERY_S = 10.0  # a send renews its lease (and checks it still holds it) this often while reading out


def take(job: ProviderJob, status: str, lease_s: float, **fields) -> bool:
    """The job, for this process, if it is in `status` and its step is due; its lease moved `lease_s` ahead."""
    now = timezone.now()
    until = now + timezone.timedelta(seconds=lease_s)
    lease = uuid.uuid4()
    taken = ProviderJob.objects.filter(
        Q(not_before__isnull=True) | Q(not_before__lte=now), pk=job.pk, status=status
    ).update(not_before=until, lease=lease, **fields)
    if taken:
        job.not_before, job.lease, job.status = until, lease, status
        for name, value in fields.items():
            if not hasattr(value, "resolve_expression"):
                setattr(job, name, value)
    return bool(taken)


def move(job: ProviderJob, frm: str, **fields) -> bool:
    """Move the job on from `frm`, fenced: only if still there and still this process's (its lease token)."""
    moved = ProviderJob.objects.filter(pk=job.pk, status=frm, lease=job.lease).update(**fields)
    if not moved:
        log.info("job %s: no longer %s under this process's lease: left as it is", job.pk, frm)
        return False
    for name, value in fields.items():
        if not hasattr(value, "resolve_expression"):
            setattr(job, name, value)
    return True


def end(job: ProviderJob, frm: str, **fields) -> bool:
    """`move` for a move that ends what the job holds of its budgets: what is left of its reservation is
    given back in the same transaction (call inside one)."""
    held = job.budget_hold
    if not move(job, frm, budget_hold=None, **fields):
        return False
    job_budgets.release_job_hold(held)
    return True


def renewer(job: ProviderJob):
    """A check for a send in progress: every RENEW_EVERY_S it moves the job's lease on (fenced on its token
    and status), and raises wire.LeaseLost when another taker has the job."""
    last = [0.0]

    def check():
        now = time.monotonic()
        if now - last[0] < RENEW_EVERY_S:
            return
        lease_s = SEND_LEASE_S if job.status == JobStatus.PENDING else FIND_AFTER_S
        until = timezone.now() + timezone.timedelta(seconds=lease_s)
        if not ProviderJob.objects.filter(pk=job.pk, status=job.status, lease=job.lease).update(not_before=until):
            raise wire.LeaseLost(f"job {job.pk}: another process took it while this one was sending it")
        job.not_before = until
        last[0] = now

    return check
