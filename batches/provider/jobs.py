"""Provider jobs, step by step, on the control queue: send (build the input, pick the key, create upstream),
find a job whose create outcome was lost, poll, write the results (batches/provider/results.py), cancel.

Every step is idempotent and begins by taking the job with one conditional UPDATE (its status, and
`not_before` passed, moved forward as a lease): two messages for the same job, or a message and the
sweeper, never both act. A lost message costs time until the sweeper's next look (`due_jobs`), never work.
Polls are one per job (never per record), at most one per RELAY_PROVIDER_POLL_SECONDS (12 s: 5 a minute),
backing off to RELAY_PROVIDER_POLL_MAX_SECONDS while the job runs.
"""

import contextlib
import json
import logging
import random

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from batches import dispatch, storage
from batches.lifecycle import delegated, finish, stop
from batches.models import Batch, Item, ItemState
from batches.outcomes import Code
from batches.provider import placement, results, wire
from batches.provider.models import OPEN_JOB_STATUSES, JobStatus, ProviderJob
from policies import breaker, keypool, ratelimit
from policies.breaker import Failure
from relay import auth, catalog, routing, scrub
from relay.crypto import SecretUnavailable, sha256_hex
from relay.errors import RelayError
from relay.models import BatchMode, HostBinding, HostKey

log = logging.getLogger(__name__)

TASK = "provider_job"
SEND_LEASE_S = 600  # building and uploading up to 200 MB
# A create whose answer was lost is looked for once no create could still be in flight (its read timeout).
FIND_AFTER_S = 150
INGEST_LEASE_S = 300  # renewed every chunk of results written
RETRY_BASE_S, RETRY_MAX_S = 5.0, 300.0  # a failed send or poll, backing off
DB_RETRY_S = 2.0  # a step the database failed is tried again this soon


# --- hand-off and scheduling -----------------------------------------------------------------------


def hand_off(jobs: list) -> None:
    """After the caller's transaction commits: one message per new job (the sweeper re-sends lost ones)."""
    ids = [job.id for job in jobs]
    if ids:
        transaction.on_commit(lambda: [dispatch.hand_off(TASK, job_id) for job_id in ids])


def _later(job_id, when) -> None:
    dispatch.hand_off_at(TASK, job_id, when)


def due_jobs(limit: int = 200) -> int:
    """The sweeper's look: open jobs whose step is due (their message lost, or a lease run out): sent again,
    at most once per job per lease period (dispatch.redispatch)."""
    now = timezone.now()
    ids = list(
        ProviderJob.objects.filter(Q(not_before__isnull=True) | Q(not_before__lte=now), status__in=OPEN_JOB_STATUSES)
        .order_by("not_before")
        .values_list("id", flat=True)[:limit]
    )
    for job_id in ids:
        dispatch.redispatch(TASK, job_id)
    return len(ids)


def _take(job: ProviderJob, status: str, lease_s: float, **fields) -> bool:
    """The job, for this process, if it is in `status` and its step is due; its lease moved `lease_s` ahead."""
    now = timezone.now()
    until = now + timezone.timedelta(seconds=lease_s)
    taken = ProviderJob.objects.filter(
        Q(not_before__isnull=True) | Q(not_before__lte=now), pk=job.pk, status=status
    ).update(not_before=until, **fields)
    if taken:
        job.not_before = until
        for name, value in fields.items():
            if not hasattr(value, "resolve_expression"):
                setattr(job, name, value)
    return bool(taken)


def _set(job: ProviderJob, frm: str, **fields) -> bool:
    """Move the job on from `frm` (fenced: only if still there)."""
    moved = ProviderJob.objects.filter(pk=job.pk, status=frm).update(**fields)
    for name, value in fields.items():
        if not hasattr(value, "resolve_expression"):
            setattr(job, name, value)
    return bool(moved)


def _backoff(n: int) -> float:
    return min(RETRY_MAX_S, RETRY_BASE_S * 2 ** min(n, 10)) * random.uniform(0.8, 1.0)


def poll_interval(polls: int) -> float:
    """Seconds to the next poll: RELAY_PROVIDER_POLL_SECONDS, growing by half each poll up to the max."""
    base = settings.RELAY_PROVIDER_POLL_SECONDS
    return min(max(base, settings.RELAY_PROVIDER_POLL_MAX_SECONDS), base * 1.5 ** min(polls, 20))


# --- the step ------------------------------------------------------------------------------------


def advance(job_id) -> None:
    """Take the job one step on, whatever it is at (the one task of provider jobs)."""
    job = ProviderJob.objects.filter(pk=job_id).first()
    if job is None or job.status not in OPEN_JOB_STATUSES:
        return
    if (
        job.cancel_requested_at is None
        and Batch.objects.filter(pk=job.batch_id, cancel_requested_at__isnull=False).exists()
    ):
        cancel_jobs(job.batch_id)  # the batch stopped and its cancel message was lost
        return
    now = timezone.now()
    if job.not_before is not None and job.not_before > now:
        _later(job.pk, job.not_before)
        return
    step = {
        JobStatus.PENDING: _send,
        JobStatus.SUBMITTING: _find,
        JobStatus.RUNNING: _poll,
        JobStatus.INGESTING: _ingest,
    }[job.status]
    try:
        step(job)
    except (OperationalError, InterfaceError):
        # The database went away mid-step (a restart, a failover). What was written stays; the step's lease
        # would hold the job for up to SEND_LEASE_S: hand it back as soon as the database answers again.
        log.warning("job %s: the database failed during its %s step; retrying it shortly", job.pk, job.status)
        connection.close()
        when = timezone.now() + timezone.timedelta(seconds=DB_RETRY_S)
        finish.durably(lambda: ProviderJob.objects.filter(pk=job.pk, status=job.status).update(not_before=when) >= 0)
        _later(job.pk, when)


def cancel_jobs(batch_id) -> int:
    """The batch was cancelled or its window closed: its jobs stop. Unsent ones end now (their records
    cancelled or expired); sent ones are cancelled upstream and their results (what finished) written."""
    n = 0
    for job in ProviderJob.objects.filter(batch_id=batch_id, status__in=OPEN_JOB_STATUSES):
        n += 1
        ProviderJob.objects.filter(pk=job.pk, cancel_requested_at__isnull=True).update(
            cancel_requested_at=timezone.now()
        )
        if job.status == JobStatus.PENDING and _take(job, JobStatus.PENDING, SEND_LEASE_S):
            _end_unsent(job)
            continue
        if job.status in (JobStatus.RUNNING, JobStatus.SUBMITTING) and job.upstream_id:
            context = _context(job)
            if context is not None:
                try:
                    wire.cancel(context.target, job.kind, job.upstream_id)
                except (wire.Refused, Exception) as exc:  # the poll sees the job end either way
                    log.warning("job %s: cancel upstream failed: %s", job.pk, exc)
        dispatch.hand_off(TASK, job.pk)
    return n


# --- context: the batch, the binding, the key ----------------------------------------------------


class _Context:
    def __init__(self, batch, binding, route, target, key):
        self.batch, self.binding, self.route, self.target, self.key = batch, binding, route, target, key


def _context(job: ProviderJob, pick: bool = False) -> "_Context | None":
    """What the job needs to talk to its provider: its batch, binding, route and host key (`pick`: choose a
    key by the policy's selection, as the live pipeline does; else the job's own)."""
    batch = Batch.objects.filter(pk=job.batch_id).first()
    binding = HostBinding.objects.select_related("host", "model", "pricing").filter(pk=job.binding_id).first()
    if batch is None or binding is None:
        return None
    snap = catalog.held()
    policy = catalog.policy(batch.policy_id, snap) if batch.policy_id else None
    route = None
    if policy is not None:
        try:
            route = routing.resolve(policy, binding.model.name, snap)
        except RelayError:
            route = None
    keys = list(route.keys) if route is not None and route.binding.id == binding.id else []
    for key in keys:  # as the pipeline does: any pool key the provider echoes back is scrubbed (relay.scrub)
        with contextlib.suppress(SecretUnavailable):
            scrub.remember(key.get_value())
    if not pick:
        key = HostKey.objects.filter(pk=job.host_key_id).first() if job.host_key_id else None
        if key is None:
            return _Context(batch, binding, route, None, None)
        return _Context(batch, binding, route, _target(binding, key), key)
    key = _pick(policy, keys) if keys else None
    return _Context(batch, binding, route, _target(binding, key) if key else None, key)


def _target(binding, key) -> wire.Target | None:
    try:
        value = key.get_value()
    except SecretUnavailable:
        return None
    scrub.remember(value)  # a provider echoing it back gets it scrubbed
    return wire.Target(binding.host.base_url, binding.adapter, value)


class _Cand:
    def __init__(self, key, value):
        self.key, self.value, self.key_hash = key, value, sha256_hex(value)[:12]


def _pick(policy, keys):
    """The policy's key selection and breakers, as for a live call; no inbound limit is spent (a job is one
    request to the provider's batch quota, not the policy's requests)."""
    cands = []
    for key in keys:
        try:
            cands.append(_Cand(key, key.get_value()))
        except SecretUnavailable:
            continue
    if not cands:
        return None
    picks = keypool.Picks(policy, cands, 1).start(ratelimit.plan(f"provider-job:{policy.id}", None, subject=""))
    for cand, tier in picks:
        tier.release()
        return cand.key
    return None


# --- send ------------------------------------------------------------------------------------------


def _send(job: ProviderJob) -> None:
    if not _take(job, JobStatus.PENDING, SEND_LEASE_S):
        return
    batch = Batch.objects.filter(pk=job.batch_id).first()
    if batch is None:
        return
    if batch.cancel_requested_at is not None:
        _end_unsent(job)
        return
    # The submitting credential is checked again for each job (a revoked key stops its batch here).
    try:
        auth.recheck(batch.submitter(), catalog.held())
    except RelayError as exc:
        _fail_records(job, Code.CREDENTIAL_INVALID, f"batch: credential no longer valid: {exc.message}")
        return
    context = _context(job, pick=True)
    if context is None or context.route is None or context.route.binding.id != job.binding_id:
        _release(job, placement.NOTE_CATALOG_CHANGED)  # the record no longer routes to this binding: the relay runs it
        return
    if context.binding.batch_mode == BatchMode.RELAY:
        _release(job, placement.NOTE_CATALOG_CHANGED)
        return
    if context.target is None:
        _wait(job, _backoff(job.create_attempts), "no usable host key (breakers open or secrets unreadable)")
        return
    if context.key.id != job.host_key_id:
        job.upstream_input_file_id = ""  # an uploaded file belongs to the key's organisation
    records = wire.InputFile(job.kind, job.pk, job.endpoint)
    creating = False
    try:
        if job.kind == "anthropic" or not job.upstream_input_file_id:
            _write_records(job, context.binding, records)
        if job.kind == "openai" and not job.upstream_input_file_id:
            file_id = wire.openai_upload(context.target, records)
            _set(job, JobStatus.PENDING, upstream_input_file_id=file_id, host_key_id=context.key.id)
        creating = True
        _set(
            job,
            JobStatus.PENDING,
            status=JobStatus.SUBMITTING,
            host_key_id=context.key.id,
            submit_started_at=timezone.now(),
            create_attempts=F("create_attempts") + 1,
            not_before=timezone.now() + timezone.timedelta(seconds=FIND_AFTER_S),
        )
        if job.kind == "openai":
            upstream_id = wire.openai_create(context.target, job, job.upstream_input_file_id)
        else:
            upstream_id = wire.anthropic_create(context.target, records)
    except wire.Refused as exc:
        _refused(job, context, exc)
        return
    except Exception as exc:
        if not creating:  # the upload broke off: nothing was created, send again after a pause
            _wait(job, _backoff(job.create_attempts), f"sending the job failed: {exc}", frm=JobStatus.PENDING)
            return
        # No answer to the create: it may have happened. The job is looked for (_find), never sent twice.
        log.warning("job %s: create failed without an answer: %s", job.pk, exc)
        _later(job.pk, job.not_before)
        return
    finally:
        records.close()
    _started(job, upstream_id)


def _write_records(job: ProviderJob, binding, records: wire.InputFile) -> None:
    """The job's records in the shape its API takes: the binding's upstream model name, nothing relay-owned."""
    rows = Item.objects.filter(provider_job_id=job.pk, state=ItemState.DELEGATED).order_by("idx")
    chunk: list = []

    def flush():
        for (idx, _), data in zip(chunk, storage.read_many([ref for _, ref in chunk]), strict=True):
            body = json.loads(data)
            body["model"] = binding.upstream_name
            body.pop("openrelay", None)
            records.add(job.custom_id(idx), json.dumps(body).encode())
        chunk.clear()

    for row in rows.values_list("idx", "input_ref").iterator(chunk_size=2000):
        chunk.append(row)
        if len(chunk) >= 500:
            flush()
    flush()


def _started(job: ProviderJob, upstream_id: str) -> None:
    now = timezone.now()
    when = now + timezone.timedelta(seconds=poll_interval(0))
    _set(
        job,
        JobStatus.SUBMITTING,
        status=JobStatus.RUNNING,
        upstream_id=upstream_id,
        submitted_at=now,
        not_before=when,
        last_error="",
    )
    log.info("job %s: sent as %s (%d records)", job.pk, upstream_id, job.records)
    _later(job.pk, when)


def _refused(job: ProviderJob, context: _Context, exc: wire.Refused) -> None:
    frm = job.status
    if exc.capacity:
        _capacity(job, frm, exc.retry_after, f"the provider refused the job for capacity ({exc.status})")
        return
    if exc.key:
        breaker.record_failure(sha256_hex(context.target.key_value)[:12], Failure.AUTH)
        _wait(job, _backoff(job.create_attempts), f"the provider refused the key ({exc.status})", frm=frm)
        return
    if exc.transient:
        _wait(job, _backoff(job.create_attempts), f"the provider answered {exc.status}", frm=frm)
        return
    # The provider refused the job itself (a malformed input, say): its records fail with the provider's word.
    body = scrub.scrub_bytes(exc.body).decode("utf-8", errors="replace")
    _fail_records(job, Code.UPSTREAM_ERROR, f"batch item: upstream status {exc.status}", exc.status, body, frm=frm)


def _wait(job: ProviderJob, seconds: float, why: str, frm: str | None = None, **fields) -> None:
    when = timezone.now() + timezone.timedelta(seconds=seconds)
    _set(job, frm or job.status, status=JobStatus.PENDING, not_before=when, last_error=why[:500], **fields)
    log.info("job %s: waiting %.0fs: %s", job.pk, seconds, why)
    _later(job.pk, when)


def _capacity(job: ProviderJob, frm: str, retry_after: float | None, why: str) -> None:
    """No room at the provider now. auto: the records run in the relay instead (if the batch's window allows);
    provider: wait and send the job again (never a failed record)."""
    binding = HostBinding.objects.filter(pk=job.binding_id).first()
    if binding is not None and binding.batch_mode == BatchMode.AUTO:
        _release(job, placement.NOTE_CAPACITY, frm=frm)
        return
    seconds = max(retry_after or 0.0, _backoff(job.capacity_waits))
    ProviderJob.objects.filter(pk=job.pk).update(capacity_waits=F("capacity_waits") + 1)
    # A job the provider failed keeps nothing upstream worth polling: the next send creates it anew.
    _wait(job, seconds, why, frm=frm, upstream_id="")


# --- find a lost create, poll ---------------------------------------------------------------------


def _find(job: ProviderJob) -> None:
    if not _take(job, JobStatus.SUBMITTING, FIND_AFTER_S):
        return
    context = _context(job)
    if context is None or context.target is None:
        _wait(job, _backoff(job.create_attempts), "the job's key is gone: sent again", frm=JobStatus.SUBMITTING)
        return
    try:
        upstream_id = wire.find(context.target, job)
    except (wire.Refused, Exception) as exc:
        log.warning("job %s: looking for its upstream batch failed: %s", job.pk, exc)
        _later(job.pk, job.not_before)
        return
    if upstream_id is None:
        log.warning("job %s: its create never reached the provider: sending it again", job.pk)
        _set(job, JobStatus.SUBMITTING, status=JobStatus.PENDING, not_before=None)
        dispatch.hand_off(TASK, job.pk)
        return
    try:
        _started(job, upstream_id)
    except Exception:  # another job adopted it (uniq_provider_job_upstream): this one was never created
        log.warning("job %s: %s belongs to another job: sending it again", job.pk, upstream_id)
        _set(job, JobStatus.SUBMITTING, status=JobStatus.PENDING, not_before=None)


def _poll(job: ProviderJob) -> None:
    interval = poll_interval(job.polls + 1)
    if not _take(job, JobStatus.RUNNING, interval, polls=F("polls") + 1):
        return
    job.polls += 1
    context = _context(job)
    if context is None or context.target is None:
        _later(job.pk, job.not_before)  # the key's secret is unreadable now: polled again later
        return
    try:
        st = wire.status(context.target, job.kind, job.upstream_id)
    except (wire.Refused, Exception) as exc:  # a provider answering 500 to polls: poll again, never fail
        ProviderJob.objects.filter(pk=job.pk).update(last_error=f"poll: {exc}"[:500])
        _later(job.pk, job.not_before)
        return
    ProviderJob.objects.filter(pk=job.pk, status=JobStatus.RUNNING).update(
        upstream_status=st.raw_status[:32], completed=st.completed, failed=st.failed
    )
    if st.phase == "running":
        _later(job.pk, job.not_before)
        return
    if st.phase == "failed":
        if st.capacity:
            _capacity(job, JobStatus.RUNNING, None, f"the provider failed the job: {st.message}")
        else:
            message = f"batch item: the provider failed its batch job: {st.message}"
            _fail_records(job, Code.UPSTREAM_ERROR, message, frm=JobStatus.RUNNING)
        return
    _set(job, JobStatus.RUNNING, status=JobStatus.INGESTING, ended_at=timezone.now(), not_before=None)
    _ingest(job, st)


def _ingest(job: ProviderJob, st: "wire.Status | None" = None) -> None:
    if not _take(job, JobStatus.INGESTING, INGEST_LEASE_S):
        return
    context = _context(job)
    if context is None or context.target is None:
        _later(job.pk, job.not_before)
        return
    try:
        if st is None:
            st = wire.status(context.target, job.kind, job.upstream_id)
        results.write(job, context, wire.results(context.target, job.kind, st), renew=lambda: _renew(job))
    except (wire.Refused, Exception) as exc:
        # Reading the results broke off: what was written stays (fenced per record), the rest next time.
        log.warning("job %s: reading its results failed: %s", job.pk, exc, exc_info=True)
        ProviderJob.objects.filter(pk=job.pk).update(last_error=f"results: {exc}"[:500])
        _later(job.pk, job.not_before)
        return
    results.missing(job, context)
    _set(job, JobStatus.INGESTING, status=JobStatus.DONE, not_before=None)
    stop.complete_if_done(job.batch_id)
    dispatch.wake_workers()  # records the provider expired may have come back to the relay (auto)


def _renew(job: ProviderJob) -> None:
    until = timezone.now() + timezone.timedelta(seconds=INGEST_LEASE_S)
    ProviderJob.objects.filter(pk=job.pk, status=JobStatus.INGESTING).update(not_before=until)


# --- endings without results ----------------------------------------------------------------------


def _release(job: ProviderJob, note: str, frm: str | None = None) -> None:
    """auto mode (or the catalog changed): the job's records go back to the relay's workers."""
    with transaction.atomic():
        if not _set(job, frm or job.status, status=JobStatus.RELEASED, not_before=None):
            return
        n = delegated.back_to_relay(job.pk, note)
    log.info("job %s: %d records go back to the relay (%s)", job.pk, n, note)
    dispatch.wake_workers()


def _end_unsent(job: ProviderJob) -> None:
    """A job never sent whose batch was cancelled or expired: its records end so, as pending ones do."""
    flags = Batch.objects.filter(pk=job.batch_id).values_list("expired_at", flat=True).first()
    code = Code.BATCH_EXPIRED if flags else Code.BATCH_CANCELLED
    with transaction.atomic():
        results.stop_records(job, code)
        _set(job, JobStatus.PENDING, status=JobStatus.DONE, not_before=None)
    stop.complete_if_done(job.batch_id)


def _fail_records(job, code: str, error: str, status: int | None = None, body: str = "", frm=None) -> None:
    with transaction.atomic():
        results.fail_records(job, code, error, status, body)
        _set(job, frm or job.status, status=JobStatus.DONE, not_before=None, last_error=error[:500])
    stop.complete_if_done(job.batch_id)
