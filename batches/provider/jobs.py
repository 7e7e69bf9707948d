"""Provider jobs, step by step, on the control queue: send (build the input, pick the key, create upstream),
find a job whose create outcome was lost, poll, write the results (batches/provider/results.py), cancel.

Every step is idempotent and begins by taking the job with one conditional UPDATE (its status, and
`not_before` passed, moved forward as a lease, with a new `lease` token): two messages for the same job, or a
message and the sweeper, never both act. Every write of a step is fenced on its token, and a send renews its
lease as it reads the body out (and stops when the lease was lost), so a taker whose lease ran out mid-send
can never create the job a second time. A lost message costs time until the sweeper's next look
(`due_jobs`), never work.

Spend budgets: before a job is sent, its records' worst case less the batch discount (the bound relay-run
records reserve, usage.budgets) is reserved on every budget that governs the batch, and kept on the job;
each chunk of results settles its records' share with their billed cost, and what is left goes back when the
job ends. A spent budget holds the job unsent (`pending`, looked at again at least every minute), as it
holds a relay-run record of the OpenAI and Anthropic surfaces.
Polls are one per job (never per record), at most one per RELAY_PROVIDER_POLL_SECONDS (12 s: 5 a minute),
backing off to RELAY_PROVIDER_POLL_MAX_SECONDS while the job runs.
"""

import json
import logging
import random
from datetime import timedelta

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from batches import dispatch, storage
from batches.lifecycle import delegated, finish, stop
from batches.models import Batch, Item, ItemState
from batches.outcomes import Code
from batches.provider import placement, results
from batches.provider.lease import FIND_AFTER_S, SEND_LEASE_S
from batches.provider.lease import end as _end
from batches.provider.lease import move as _set
from batches.provider.lease import renewer as _renewer
from batches.provider.lease import take as _take
from batches.provider.models import OPEN_JOB_STATUSES, JobStatus, ProviderJob
from core import catalog, scrub
from core.errors import RelayError
from core.models import BatchMode, HostBinding, HostKey
from gateway import batch_apis as wire
from gateway import stages
from gateway.upstream import UpstreamError
from policies import breaker
from policies.breaker import Failure
from usage import budgets, job_budgets

log = logging.getLogger(__name__)

TASK = "provider_job"
INGEST_LEASE_S = 300  # renewed every chunk of results written
RETRY_BASE_S, RETRY_MAX_S = 5.0, 300.0  # a failed send or poll, backing off
DB_RETRY_S = 2.0  # a step the database failed is tried again this soon
# A job's budget reservation lives through the provider's 24 h window, capacity waits and the writing of its
# results; a job that ends gives it back at once (a reservation outliving its job row expires and is reclaimed).
JOB_HOLD_TTL = timedelta(hours=48)


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
    return len(ids) + _release_ended_holds(limit)


def _release_ended_holds(limit: int) -> int:
    """Reservations still named by jobs that ended (a process that died between a job's end and its giving
    back): given back. Endings give back in their own transaction, so this finds nothing in a healthy run."""
    n = 0
    for job_id, held in ProviderJob.objects.filter(
        budget_hold__isnull=False, status__in=(JobStatus.DONE, JobStatus.RELEASED)
    ).values_list("id", "budget_hold")[:limit]:
        with transaction.atomic():
            if ProviderJob.objects.filter(pk=job_id, budget_hold__isnull=False).update(budget_hold=None):
                job_budgets.release_job_hold(held)
                n += 1
    if n:
        log.warning("gave back the budget reservations of %d ended provider job(s)", n)
    return n


def _why(text: str) -> str:
    """A job's error as stored and shown: the provider's words can quote anything it holds (a key, a
    caller's secret), so they pass the scrubber (core.scrub) first."""
    return scrub.scrub_text(str(text))[:500]


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
            if context is not None and context.api is not None:
                try:
                    context.api.cancel()
                except (wire.Refused, Exception) as exc:  # the poll sees the job end either way
                    log.warning("job %s: cancel upstream failed: %s", job.pk, exc)
        dispatch.hand_off(TASK, job.pk)
    return n


# --- context: the batch, the binding, the key ----------------------------------------------------


class _Context:
    """`api`: the job's provider batch API (wire.REGISTRY), bound to the job and its target; None with no
    usable key. `key_hash`: the key's breaker name (gateway.stages.Candidate)."""

    def __init__(self, job, batch, binding, route, cand):
        self.batch, self.binding, self.route = batch, binding, route
        self.key = cand.key if cand is not None else None
        self.key_hash = cand.key_hash if cand is not None else ""
        self.target = wire.Target.of(binding, cand.key, cand.value) if cand else None
        self.api = wire.api(job.kind)(self.target, job) if self.target is not None else None


def _context(job: ProviderJob, pick: bool = False) -> "_Context | None":
    """What the job needs to talk to its provider: its batch, binding, route, host key and batch API. The route
    and the key come from the pipeline's own stages (gateway.stages): `resolve` under the batch's policy, and
    with `pick` the key chosen by `pick_one` (the policy's selection and breakers, as for a live call); else
    the job's own key."""
    batch = Batch.objects.filter(pk=job.batch_id).first()
    binding = HostBinding.objects.select_related("host", "model", "pricing").filter(pk=job.binding_id).first()
    if batch is None or binding is None:
        return None
    route = None
    if batch.policy_id:
        try:
            route = stages.resolve(batch.policy_id, binding.model.name, catalog.held())
        except RelayError:
            route = None
    keys = list(route.keys) if route is not None and route.binding.id == binding.id else []
    # Every pool key is remembered by the scrubber (one the provider echoes back is scrubbed), as for a live call.
    candidates = stages.key_candidates(keys)
    if pick:
        cand = stages.pick_one(route.policy, candidates) if candidates else None
    else:
        key = HostKey.objects.filter(pk=job.host_key_id).first() if job.host_key_id else None
        cand = next(iter(stages.key_candidates([key] if key is not None else [])), None)
    return _Context(job, batch, binding, route, cand)


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
    principal = batch.submitter()
    try:
        stages.recheck_credential(principal, catalog.held())
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
    # A spent budget holds the job before anything is read or sent (the reservation below is the real gate).
    reserve = False
    if job.budget_hold is None:
        try:
            reserve = stages.admit_job_check(principal, batch.policy_id)
        except budgets.BudgetExceeded as exc:
            _wait_budget(job, exc)
            return
    if reserve and job.worst_nanos is not None:
        # Weighed before anything is read: a job that does not fit waits at the cost of one statement.
        try:
            if not _reserve(job, principal, batch, job.worst_nanos):
                return
        except budgets.BudgetExceeded as exc:
            _wait_budget(job, exc)
            return
        reserve = False
    if context.key.id != job.host_key_id or reserve:
        job.upstream_input_file_id = ""  # an uploaded file belongs to the key's organisation; reserving reads
    api = context.api
    records = api.records()
    records.on_read = _renewer(job)
    creating = False
    try:
        worst = None
        # An input file uploaded by an earlier send (same key) is reused; else the records are written out.
        if not job.upstream_input_file_id:
            worst = _write_records(job, context.binding, records, batch.discount_percent)
            if job.worst_nanos is None and not _set(job, JobStatus.PENDING, worst_nanos=worst):
                return  # another taker has the job
        if reserve and not _reserve(job, principal, batch, worst or 0):
            return
        if not job.upstream_input_file_id:
            file_id = api.upload(records)  # None: this API takes the records in the create itself
            if file_id is not None and not _set(
                job, JobStatus.PENDING, upstream_input_file_id=file_id, host_key_id=context.key.id
            ):
                return  # another taker has the job: its own send goes on
        creating = True
        # The one move that lets a create happen, fenced on this process's lease: two takers never both pass.
        if not _set(
            job,
            JobStatus.PENDING,
            status=JobStatus.SUBMITTING,
            host_key_id=context.key.id,
            submit_started_at=timezone.now(),
            create_attempts=F("create_attempts") + 1,
            not_before=timezone.now() + timezone.timedelta(seconds=FIND_AFTER_S),
        ):
            return
        upstream_id = api.create(records)
    except wire.LeaseLost as exc:
        log.warning("%s: its send is abandoned", exc)
        return
    except wire.Refused as exc:
        _refused(job, context, exc)
        return
    except budgets.BudgetExceeded as exc:
        _wait_budget(job, exc)
        return
    except Exception as exc:
        _score_no_answer(context, batch, exc)
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


def _reserve(job: ProviderJob, principal, batch, worst: int) -> bool:
    """The job's records' worst case reserved on the budgets governing its batch and kept on the job, in one
    transaction (a process dying in between leaves neither). Raises BudgetExceeded; False: the job is no
    longer this process's (nothing is reserved then)."""
    with transaction.atomic():
        held = stages.admit_job(principal, batch.policy_id, worst, job.records, JOB_HOLD_TTL)
        if held is None:
            return True
        if not _set(job, JobStatus.PENDING, budget_hold=held):
            transaction.set_rollback(True)
            return False
    log.info("job %s: reserved %d nano-USD on %d budget(s)", job.pk, worst, len(held["budgets"]))
    return True


def _wait_budget(job: ProviderJob, exc) -> None:
    """A budget of the batch is spent: the job waits unsent (the surfaces' records wait so too), looking
    again at least every BATCH_RECHECK_S so a raised budget or a new period is seen."""
    _wait(job, exc.retry_after, f"{exc.code}: {exc.message}")


def _write_records(job: ProviderJob, binding, records: wire.InputFile, discount_percent: int) -> int:
    """The job's records in the shape its API takes: the binding's upstream model name, nothing relay-owned.
    Returns their summed worst case (price × the most tokens each can be billed, less the batch's discount:
    what a relay-run record reserves, gateway.stages.admit; an unpriced model counts 0)."""
    rows = Item.objects.filter(provider_job_id=job.pk, state=ItemState.DELEGATED).order_by("idx")
    chunk: list = []
    worst = [0]

    def flush():
        for (idx, _), data in zip(chunk, storage.read_many([ref for _, ref in chunk]), strict=True):
            body = json.loads(data)
            # Bounded as the relay-run record would be, on the body as stored (what its call would carry).
            worst[0] += stages.worst_nanos(binding.pricing, body, discount_percent) or 0
            records.add(job.custom_id(idx), json.dumps(stages.upstream_body(binding, body)).encode())
        chunk.clear()
        if records.on_read is not None:
            records.on_read()  # a long read-out keeps (and checks) the lease

    for row in rows.values_list("idx", "input_ref").iterator(chunk_size=2000):
        chunk.append(row)
        if len(chunk) >= 500:
            flush()
    flush()
    return worst[0]


def _started(job: ProviderJob, upstream_id: str) -> None:
    now = timezone.now()
    when = now + timezone.timedelta(seconds=poll_interval(0))
    if not _set(
        job,
        JobStatus.SUBMITTING,
        status=JobStatus.RUNNING,
        upstream_id=upstream_id,
        submitted_at=now,
        not_before=when,
        last_error="",
    ):
        # Another taker has the job (this create outlived the lease): its look (_find) adopts the batch.
        log.warning("job %s: created as %s after its lease passed on: left to the job's look", job.pk, upstream_id)
        return
    log.info("job %s: sent as %s (%d records)", job.pk, upstream_id, job.records)
    _later(job.pk, when)


def _refused(job: ProviderJob, context: _Context, exc: wire.Refused) -> None:
    frm = job.status
    if exc.absent:  # the host has no batch API at all (an OpenAI-compatible server's 404/405): the relay runs them
        _release(job, placement.NOTE_NO_BATCH_API, frm=frm)
        return
    if exc.capacity:
        _capacity(job, frm, exc.retry_after, f"the provider refused the job for capacity ({exc.status})")
        return
    if exc.key:
        stages.score_failure(context.key_hash, Failure.AUTH)
        _wait(job, _backoff(job.create_attempts), f"the provider refused the key ({exc.status})", frm=frm)
        return
    if exc.transient:
        _wait(job, _backoff(job.create_attempts), f"the provider answered {exc.status}", frm=frm)
        return
    # The provider refused the job itself (a malformed input, say): its records fail with the provider's word.
    body = scrub.scrub_bytes(exc.body).decode("utf-8", errors="replace")
    _fail_records(job, Code.UPSTREAM_ERROR, f"batch item: upstream status {exc.status}", exc.status, body, frm=frm)


def _score_no_answer(context: _Context, batch: Batch, exc: Exception) -> None:
    """A call that got no HTTP answer scores the key's breaker as a live call's does (policies.breaker.RULES):
    a connect failure benches the key for everyone, a break after sending scores the batch's submitter."""
    failure = breaker.transport_failure(exc.kind) if isinstance(exc, UpstreamError) else None
    if failure is not None:
        stages.score_failure(context.key_hash, failure, principal=batch.submitter())


def _wait(job: ProviderJob, seconds: float, why: str, frm: str | None = None, **fields) -> None:
    when = timezone.now() + timezone.timedelta(seconds=seconds)
    _set(job, frm or job.status, status=JobStatus.PENDING, not_before=when, last_error=_why(why), **fields)
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
    # The upstream batches other jobs on this host already hold are nobody's lost create (an API that finds a
    # job by reading its candidates' results never waits on one another job holds).
    since = (job.submit_started_at or job.created_at) - wire.FIND_WINDOW
    others = ProviderJob.objects.filter(host_id=job.host_id, kind=job.kind, submitted_at__gte=since)
    owned = set(others.exclude(upstream_id="").exclude(pk=job.pk).values_list("upstream_id", flat=True))
    try:
        upstream_id = context.api.find(owned)
    except wire.NotYetKnown as exc:
        log.info("job %s: its lost create cannot be told apart yet (%s): looked for again later", job.pk, exc)
        _later(job.pk, job.not_before)
        return
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
        with transaction.atomic():
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
        st = context.api.status()
    except (wire.Refused, Exception) as exc:  # a provider answering 500 to polls: poll again, never fail
        ProviderJob.objects.filter(pk=job.pk).update(last_error=_why(f"poll: {exc}"))
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
            message = _why(f"batch item: the provider failed its batch job: {st.message}")
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
            st = context.api.status()
        results.write(job, context, context.api.results(st), renew=lambda: _renew(job))
    except (wire.Refused, Exception) as exc:
        # Reading the results broke off: what was written stays (fenced per record), the rest next time.
        log.warning("job %s: reading its results failed: %s", job.pk, exc, exc_info=True)
        ProviderJob.objects.filter(pk=job.pk).update(last_error=_why(f"results: {exc}"))
        _later(job.pk, job.not_before)
        return
    with transaction.atomic():
        results.missing(job, context)
        _end(job, JobStatus.INGESTING, status=JobStatus.DONE, not_before=None)
    stop.complete_if_done(job.batch_id)
    dispatch.wake_workers()  # records the provider expired may have come back to the relay (auto)


def _renew(job: ProviderJob) -> None:
    until = timezone.now() + timezone.timedelta(seconds=INGEST_LEASE_S)
    ProviderJob.objects.filter(pk=job.pk, status=JobStatus.INGESTING, lease=job.lease).update(not_before=until)


# --- endings without results ----------------------------------------------------------------------


def _release(job: ProviderJob, note: str, frm: str | None = None) -> None:
    """auto mode (or the catalog changed): the job's records go back to the relay's workers."""
    with transaction.atomic():
        # The records reserve their own worst case when the relay runs them: the job's reservation goes back.
        if not _end(job, frm or job.status, status=JobStatus.RELEASED, not_before=None):
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
        _end(job, JobStatus.PENDING, status=JobStatus.DONE, not_before=None)
    stop.complete_if_done(job.batch_id)


def _fail_records(job, code: str, error: str, status: int | None = None, body: str = "", frm=None) -> None:
    error = _why(error)
    with transaction.atomic():
        results.fail_records(job, code, error, status, body)
        _end(job, frm or job.status, status=JobStatus.DONE, not_before=None, last_error=error)
    stop.complete_if_done(job.batch_id)
