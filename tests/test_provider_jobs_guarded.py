"""Provider batch jobs that cost only their own tenant, and only once: a job reserves its records' worst case on
the batch's spend budgets before it is sent (a spent budget holds it unsent), settles per chunk of results and
gives the rest back when it ends; a job's send is fenced on its lease (a second taker never creates it twice);
a lost Anthropic create is adopted only by its own relay-made custom_ids; the provider's words about a job
pass the scrubber. Each step is the real service the Celery task calls (jobs.advance); PostgreSQL, Redis and
HTTP (the fake provider's batch API) are real."""

import json
import time

import pytest
from django.utils import timezone

from batches.models import Item
from batches.provider import jobs, lease
from batches.provider.models import OPEN_JOB_STATUSES, JobStatus, ProviderJob
from core.models import HostBinding, HostKey
from devkit.upstream import Reply
from gateway import batch_apis as wire
from tests.test_provider_batches import anthropic_batch, chat, claude, drive, openai_batch, output_lines
from usage import budgets
from usage.models import Budget, BudgetHold, BudgetPeriod, UsageEvent

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fast_polls"),
]


@pytest.fixture
def fast_polls(settings):
    settings.RELAY_PROVIDER_POLL_SECONDS = 0
    settings.RELAY_PROVIDER_POLL_MAX_SECONDS = 0


@pytest.fixture
def provider(catalog, fake):
    fake.batches.job_seconds = 0.3
    HostBinding.objects.update(batch_mode="provider")
    return fake.batches


def _period(budget) -> BudgetPeriod:
    start, _ = budgets.period_bounds(budget.period)
    return BudgetPeriod.objects.get(budget=budget, period_start=start)


def _advance_now(job_id) -> None:
    """One step of the job, as if its wait were over."""
    ProviderJob.objects.filter(pk=job_id).update(not_before=None)
    jobs.advance(job_id)


def _billed(batch) -> int:
    return sum(e.billed_cost_nano_usd or 0 for e in UsageEvent.objects.filter(batch_id=str(batch.id)))


# --- spend budgets ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["provider", "auto"])
def test_a_spent_budget_sends_nothing_to_the_provider_until_it_is_raised(catalog, provider, fake, mode):
    fake.answer_when("please fail", Reply(status=400, body={"error": {"message": "bad"}}))
    HostBinding.objects.update(batch_mode=mode)
    budget = Budget.objects.create(name="proj", project=catalog.project, usd_nanos=0, period="month")
    batch = openai_batch(catalog, [chat("a"), chat("b"), chat("c", "please fail")])
    job = ProviderJob.objects.get(batch=batch)
    for _ in range(3):
        _advance_now(job.pk)
    job.refresh_from_db()
    # Nothing reached the provider: no upload, no create. The job waits (never fails, never goes to the relay).
    assert provider.requests() == []
    assert job.status == JobStatus.PENDING and job.budget_hold is None
    assert job.last_error.startswith("budget_exceeded: budget proj") and job.not_before > timezone.now()
    assert {i.state for i in Item.objects.filter(batch=batch)} == {"delegated"}

    # Raised: the job reserves, is sent, settles what it cost and gives the rest back.
    budget.usd_nanos = 10**12
    budget.save()
    _advance_now(job.pk)
    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING and job.budget_hold is not None
    reserved = _period(budget).reserved_nanos
    assert reserved > 0 and reserved == sum(h.nanos for h in BudgetHold.objects.all())
    drive(batch)
    assert {i.state for i in Item.objects.filter(batch=batch)} == {"completed", "discarded"}
    period = _period(budget)
    assert period.reserved_nanos == 0 and not BudgetHold.objects.exists()
    assert 0 < period.spent_nanos == _billed(batch) < reserved
    assert ProviderJob.objects.get(pk=job.pk).budget_hold is None


def test_a_budget_that_fits_one_job_stops_after_one_job(catalog, provider, settings):
    settings.RELAY_PROVIDER_JOB_MAX_RECORDS = 2
    budget = Budget.objects.create(name="proj", project=catalog.project, usd_nanos=10**12, period="month")
    batch = openai_batch(catalog, [chat(f"r{i}") for i in range(6)])
    first, *rest = ProviderJob.objects.filter(batch=batch).order_by("id")
    assert len(rest) == 2
    _advance_now(first.pk)
    one_job = _period(budget).reserved_nanos  # the six records are alike: every job reserves this much
    assert one_job > 0
    budget.usd_nanos = one_job + one_job // 2
    budget.save()
    for _ in range(2):
        for job in rest:
            _advance_now(job.pk)
    assert provider.creates("openai") == 1 and provider.uploads() == 1
    for job in ProviderJob.objects.filter(pk__in=[j.pk for j in rest]):
        assert job.status == JobStatus.PENDING and job.budget_hold is None and "budget_exceeded" in job.last_error
    period = _period(budget)
    assert period.reserved_nanos == one_job and period.spent_nanos + period.reserved_nanos <= budget.usd_nanos

    # The first job's results settle its reservation: spent what it cost, nothing held for it any more.
    while ProviderJob.objects.get(pk=first.pk).status in OPEN_JOB_STATUSES:
        _advance_now(first.pk)
        time.sleep(0.05)
    period = _period(budget)
    assert period.reserved_nanos == 0 and period.spent_nanos == _billed(batch) > 0


def test_a_job_that_does_not_fit_its_budget_waits_without_reading_its_records_again(catalog, provider, monkeypatch):
    # A little room left (the budget check passes) but less than the job's worst case: the reservation refuses.
    # The first look reads the records out to learn their worst case; every later look weighs the stored figure.
    budget = Budget.objects.create(name="proj", project=catalog.project, usd_nanos=1, period="month")
    batch = openai_batch(catalog, [chat(f"r{i}") for i in range(4)])
    job = ProviderJob.objects.get(batch=batch)
    reads = []
    real = jobs._write_records
    monkeypatch.setattr(jobs, "_write_records", lambda *a, **k: reads.append(1) or real(*a, **k))
    for _ in range(4):
        _advance_now(job.pk)
    job.refresh_from_db()
    assert len(reads) == 1 and job.worst_nanos > 1
    assert job.status == JobStatus.PENDING and job.budget_hold is None and "budget_exceeded" in job.last_error
    assert provider.requests() == [] and _period(budget).reserved_nanos == 0

    # Raised past the stored worst case: reserved before the read-out, then sent once.
    budget.usd_nanos = job.worst_nanos
    budget.save()
    _advance_now(job.pk)
    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING and _period(budget).reserved_nanos == job.worst_nanos
    assert provider.creates("openai") == 1


def test_a_job_whose_worker_died_after_reserving_is_sent_once_and_reserves_once(catalog, provider, monkeypatch):
    class WorkerDied(BaseException):
        """The process ends mid-send (killed): nothing after it runs."""

    budget = Budget.objects.create(name="proj", project=catalog.project, usd_nanos=10**12, period="month")
    batch = openai_batch(catalog, [chat("a"), chat("b")])
    job = ProviderJob.objects.get(batch=batch)
    upload = wire.OpenAIBatchAPI.upload

    def dies(*args, **kwargs):
        raise WorkerDied

    monkeypatch.setattr(wire.OpenAIBatchAPI, "upload", dies)
    with pytest.raises(WorkerDied):
        jobs.advance(job.pk)
    monkeypatch.setattr(wire.OpenAIBatchAPI, "upload", upload)
    job.refresh_from_db()
    reserved = _period(budget).reserved_nanos
    assert job.status == JobStatus.PENDING and job.budget_hold is not None and reserved > 0
    assert jobs.due_jobs() == 0  # its lease holds: nobody takes it yet

    # Its lease runs out: the sweeper's look finds it, the next taker sends it on the same reservation.
    ProviderJob.objects.filter(pk=job.pk).update(not_before=timezone.now() - timezone.timedelta(seconds=1))
    assert jobs.due_jobs() == 1
    jobs.advance(job.pk)
    assert _period(budget).reserved_nanos == reserved
    drive(batch)
    period = _period(budget)
    assert provider.creates("openai") == 1
    assert period.reserved_nanos == 0 and period.spent_nanos == _billed(batch) > 0


def test_the_sweeper_gives_back_what_an_ended_job_still_holds(catalog, provider):
    budget = Budget.objects.create(name="proj", project=catalog.project, usd_nanos=10**12, period="month")
    batch = openai_batch(catalog, [chat("a")])
    job = ProviderJob.objects.get(batch=batch)
    jobs.advance(job.pk)
    assert _period(budget).reserved_nanos > 0
    # A process that died between a job's end and its giving back (endings give back in their transaction).
    ProviderJob.objects.filter(pk=job.pk).update(status=JobStatus.RELEASED, not_before=None)
    jobs.due_jobs()
    assert _period(budget).reserved_nanos == 0 and not BudgetHold.objects.exists()
    assert ProviderJob.objects.get(pk=job.pk).budget_hold is None


def test_records_released_to_the_relay_give_back_the_jobs_reservation(catalog, provider):
    HostBinding.objects.update(batch_mode="auto")
    budget = Budget.objects.create(name="proj", project=catalog.project, usd_nanos=10**12, period="month")
    provider.refuse_creates(1, "openai")
    batch = openai_batch(catalog, [chat("a")])
    job = ProviderJob.objects.get(batch=batch)
    jobs.advance(job.pk)  # reserved, then refused for capacity: auto mode hands the records to the relay
    job.refresh_from_db()
    assert job.status == JobStatus.RELEASED and job.budget_hold is None
    assert _period(budget).reserved_nanos == 0 and not BudgetHold.objects.exists()


# --- a send fenced on its lease --------------------------------------------------------------------------


def test_a_second_taker_after_the_lease_ran_out_never_creates_an_openai_job_twice(catalog, provider, monkeypatch):
    batch = openai_batch(catalog, [chat("a"), chat("b")])
    job = ProviderJob.objects.get(batch=batch)
    upload = wire.OpenAIBatchAPI.upload
    calls = []

    def slow_upload(api, records):
        calls.append(1)
        if len(calls) == 1:
            # The first sender is still uploading when its lease runs out: a second taker sends the job.
            ProviderJob.objects.filter(pk=job.pk).update(not_before=timezone.now() - timezone.timedelta(seconds=1))
            jobs.advance(job.pk)
            assert ProviderJob.objects.get(pk=job.pk).status == JobStatus.RUNNING
        return upload(api, records)

    monkeypatch.setattr(wire.OpenAIBatchAPI, "upload", slow_upload)
    jobs.advance(job.pk)  # the first sender finishes its upload late: it must not create the job again
    assert len(calls) == 2 and provider.creates("openai") == 1
    drive(batch)
    assert {i.state for i in Item.objects.filter(batch=batch)} == {"completed"}
    assert provider.creates("openai") == 1


def test_a_sender_that_lost_its_lease_mid_body_cuts_the_anthropic_create_off(catalog, provider, monkeypatch):
    monkeypatch.setattr(lease, "RENEW_EVERY_S", 0.0)  # time passes between the reads: each read looks
    batch = anthropic_batch(catalog, [claude("a"), claude("b")])
    job = ProviderJob.objects.get(batch=batch)
    create = wire.AnthropicBatchAPI.create
    calls = []

    def late_create(api, records):
        calls.append(1)
        if len(calls) == 1:
            # The first sender stalls before its body is out; its lease runs out. A second taker looks for the
            # create (nothing at the provider), then sends the job itself.
            ProviderJob.objects.filter(pk=job.pk).update(not_before=timezone.now() - timezone.timedelta(seconds=1))
            jobs.advance(job.pk)
            assert ProviderJob.objects.get(pk=job.pk).status == JobStatus.PENDING
            jobs.advance(job.pk)
            assert ProviderJob.objects.get(pk=job.pk).status == JobStatus.RUNNING
        return create(api, records)

    monkeypatch.setattr(wire.AnthropicBatchAPI, "create", late_create)
    jobs.advance(job.pk)
    assert len(calls) == 2 and provider.creates("anthropic") == 1
    drive(batch)
    assert {i.state for i in Item.objects.filter(batch=batch)} == {"completed"}
    assert provider.creates("anthropic") == 1


# --- Anthropic: a lost create adopted only by its own custom_ids -----------------------------------------


def test_two_lost_anthropic_creates_of_one_size_each_adopt_their_own_batch(catalog, provider):
    provider.drop_create_answers(2, "anthropic")
    batches = [anthropic_batch(catalog, [claude("a")]), anthropic_batch(catalog, [claude("a")])]
    pair = [ProviderJob.objects.get(batch=b) for b in batches]
    for job in pair:
        jobs.advance(job.pk)
        assert ProviderJob.objects.get(pk=job.pk).status == JobStatus.SUBMITTING
    assert provider.creates("anthropic") == 2
    deadline = time.monotonic() + 20
    while ProviderJob.objects.filter(pk__in=[j.pk for j in pair], status__in=OPEN_JOB_STATUSES).exists():
        assert time.monotonic() < deadline, list(ProviderJob.objects.filter(pk__in=[j.pk for j in pair]).values())
        for job in pair:
            _advance_now(job.pk)
        time.sleep(0.05)
    assert provider.creates("anthropic") == 2  # neither was created a third time
    for job in pair:
        job.refresh_from_db()
        upstream = provider.job(job.upstream_id)
        assert [cid.partition("-")[0] for cid, _ in upstream.requests] == [job.id.hex]
        assert Item.objects.get(batch_id=job.batch_id).state == "completed"


def test_a_lost_anthropic_create_never_waits_on_a_batch_another_job_holds(catalog, provider, monkeypatch):
    provider.job_seconds = 60  # the other job's batch runs on while this one is looked for
    held = anthropic_batch(catalog, [claude("a")])
    other = ProviderJob.objects.get(batch=held)
    jobs.advance(other.pk)
    assert ProviderJob.objects.get(pk=other.pk).status == JobStatus.RUNNING

    def never_arrives(api, records):
        raise ConnectionError("the connection broke before the request was sent")

    batch = anthropic_batch(catalog, [claude("a")])
    job = ProviderJob.objects.get(batch=batch)
    monkeypatch.setattr(wire.AnthropicBatchAPI, "create", never_arrives)
    jobs.advance(job.pk)
    assert ProviderJob.objects.get(pk=job.pk).status == JobStatus.SUBMITTING
    # Its look finds one batch of its size and time, still running, that the other job holds: not a candidate,
    # so the job is sent again now rather than waiting for that batch to end.
    _advance_now(job.pk)
    job.refresh_from_db()
    assert job.status == JobStatus.PENDING and job.upstream_id == ""
    assert provider.creates("anthropic") == 1


# --- the provider's words about a job, scrubbed -----------------------------------------------------------


def test_a_secret_in_the_providers_job_error_never_reaches_the_tenant(catalog, provider):
    from batches.surfaces.openai import finalize

    batch = openai_batch(catalog, [chat("a")])
    job = ProviderJob.objects.get(batch=batch)
    secret = HostKey.objects.get(name="openai-0").get_value()
    provider.fail_jobs(f"Input rejected for key {secret}: not allowed")
    drive(batch)
    job.refresh_from_db()
    item = Item.objects.get(batch=batch)
    assert item.state == "discarded" and "not allowed" in item.error
    finalize.finalize(batch.id)
    shown = json.dumps(output_lines(batch)) + item.error + job.last_error
    assert "the provider failed its batch job" in shown
    assert secret not in shown and "redacted" in shown
