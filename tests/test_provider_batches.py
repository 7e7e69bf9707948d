"""Provider batch mode, step by step in process: records placed at a provider job as they are stored, the job
sent to the fake provider's batch API (OpenAI Files + Batches, Anthropic Message Batches), polled, its results
written to the items in the surface's own shape, billed at the provider's batch price; capacity waits, a lost
create found again, polls answered 500, cancel, auto mode's fall-backs. Each step is the real service the
Celery task calls (batches.provider.jobs.advance), called directly; PostgreSQL, Redis and HTTP are real."""

import io
import json
import time

import pytest
from django.utils import timezone

from batches import ingest
from batches.lifecycle import stop
from batches.models import Batch, Item
from batches.provider import jobs
from batches.provider.models import OPEN_JOB_STATUSES, JobStatus, ProviderJob
from batches.surfaces.anthropic import create as anthropic_create
from batches.surfaces.anthropic import read as anthropic_read
from batches.surfaces.openai import create as openai_create
from batches.surfaces.openai import finalize, validation
from batches.surfaces.openai import read as openai_read
from core import auth
from core.models import HostBinding, HostKey, Pricing
from devkit.upstream import Reply
from usage.models import UsageEvent
from usage.pricing import cost_nano_usd, provider_batch_cost
from usage.tokens import Tokens

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fast_polls"),
]
CHAT = "/v1/chat/completions"


@pytest.fixture
def fast_polls(settings):
    settings.RELAY_PROVIDER_POLL_SECONDS = 0
    settings.RELAY_PROVIDER_POLL_MAX_SECONDS = 0


@pytest.fixture
def provider(catalog, fake):
    fake.batches.job_seconds = 0.3
    HostBinding.objects.update(batch_mode="provider")
    return fake.batches


def chat(custom_id, content="hello", **body):
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": content}], **body},
    }


def claude(custom_id, content="hello"):
    return {
        "custom_id": custom_id,
        "params": {"model": "claude-sonnet", "max_tokens": 64, "messages": [{"role": "user", "content": content}]},
    }


def openai_batch(catalog, records) -> Batch:
    principal = auth.principal_for_key(catalog.key)
    body = {"endpoint": CHAT, "completion_window": "24h", "requests": records}
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**8, 50_000) as submission:
        batch = openai_create.create(principal, submission)
    validation.validate(batch.id)
    return Batch.objects.get(pk=batch.pk)


def anthropic_batch(catalog, requests) -> Batch:
    principal = auth.principal_for_key(catalog.key)
    with ingest.read_submission(io.BytesIO(json.dumps({"requests": requests}).encode()), 10**8, 50_000) as sub:
        return anthropic_create.create(principal, sub)


def drive(batch, timeout=15.0, skip_waits=True):
    """Advance the batch's jobs until none is open (what the control worker's messages do)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        open_jobs = list(ProviderJob.objects.filter(batch_id=batch.pk, status__in=OPEN_JOB_STATUSES))
        if not open_jobs:
            return
        for job in open_jobs:
            if skip_waits:
                ProviderJob.objects.filter(pk=job.pk).update(not_before=None)
            jobs.advance(job.pk)
        time.sleep(0.05)
    raise AssertionError(f"jobs still open: {list(ProviderJob.objects.filter(batch_id=batch.pk).values())}")


def output_lines(batch) -> dict:
    from batches import storage
    from batches.models import File

    batch.refresh_from_db()
    out = {}
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            data = b"".join(storage.iter_file(File.objects.get(pk=file_id).ref))
            for line in data.splitlines():
                row = json.loads(line)
                out[row["custom_id"]] = row
    return out


def test_openai_batch_runs_at_the_provider_and_bills_its_batch_price(catalog, provider, fake):
    fake.answer_when(
        "please fail", Reply(status=400, body={"error": {"message": "bad", "type": "invalid_request_error"}})
    )
    batch = openai_batch(catalog, [chat("a"), chat("b", "please fail"), chat("c")])
    items = list(Item.objects.filter(batch=batch).order_by("idx"))
    assert {i.state for i in items} == {"delegated"}
    job = ProviderJob.objects.get(batch=batch)
    assert job.records == 3 and job.kind == "openai" and job.status == JobStatus.PENDING

    drive(batch)
    job.refresh_from_db()
    assert job.status == JobStatus.DONE and job.upstream_id.startswith("batch_")
    # The provider saw the relay's custom_ids and the binding's upstream model name, never the users' ids.
    upstream = provider.job(job.upstream_id)
    assert upstream is not None and upstream.key.startswith("upstream-openai")
    assert upstream.metadata == {"relay_job": str(job.id)}
    assert provider.creates("openai") == 1 and provider.uploads() == 1
    lines = [json.loads(upstream.line(i)) for i in range(upstream.total)]
    assert {line["custom_id"] for line in lines} == {job.custom_id(i) for i in range(3)}
    assert {line["body"]["model"] for line in lines} == {"gpt-4o-2024-08-06"}

    finalize.finalize(batch.id)
    batch.refresh_from_db()
    assert batch.status == "completed"
    out = output_lines(batch)
    assert out["a"]["response"]["status_code"] == 200 and out["a"]["error"] is None
    assert out["a"]["response"]["body"]["object"] == "chat.completion"
    assert out["b"]["response"]["status_code"] == 400 and out["b"]["response"]["body"]["error"]["message"] == "bad"
    assert openai_read.request_counts(batch) == {"total": 3, "completed": 2, "failed": 1}

    events = {e.request_id: e for e in UsageEvent.objects.filter(batch_id=str(batch.id))}
    assert len(events) == 3 and {e.executed_by for e in events.values()} == {"provider"}
    a = events[str(items[0].id)]
    tokens = Tokens(input=a.input_tokens, output=a.output_tokens)
    price = Pricing.objects.get(name="p-gpt")
    assert a.input_tokens > 0 and a.cost_nano_usd == provider_batch_cost(price, tokens)
    assert (
        a.cost_nano_usd == cost_nano_usd(price, tokens) // 2
        or abs(a.cost_nano_usd * 2 - cost_nano_usd(price, tokens)) <= 2
    )
    assert a.billed_cost_nano_usd == cost_nano_usd(price, tokens) * 50 // 100
    assert a.host_key_id == job.host_key_id and a.model == "gpt-4o"
    b = events[str(items[1].id)]
    assert b.status == 400 and b.error_kind == "upstream_error" and b.cost_nano_usd is None
    # Advancing a finished job again writes nothing twice.
    jobs.advance(job.pk)
    assert UsageEvent.objects.filter(batch_id=str(batch.id)).count() == 3


def test_records_run_at_the_provider_count_against_spend_budgets(catalog, provider):
    from usage import budgets
    from usage.models import Budget, BudgetPeriod

    budget = Budget.objects.create(name="proj", project=catalog.project, usd_nanos=10**12, period="month")
    batch = openai_batch(catalog, [chat("a"), chat("b")])
    drive(batch)
    billed = sum(e.billed_cost_nano_usd for e in UsageEvent.objects.filter(batch_id=str(batch.id)))
    start, _ = budgets.period_bounds("month")
    assert billed > 0
    assert BudgetPeriod.objects.get(budget=budget, period_start=start).spent_nanos == billed
    jobs.advance(ProviderJob.objects.get(batch=batch).pk)  # a finished job advanced again charges nothing twice
    assert BudgetPeriod.objects.get(budget=budget, period_start=start).spent_nanos == billed


def test_batch_rates_from_the_pricing_when_set(catalog, provider):
    Pricing.objects.filter(name="p-gpt").update(batch_input_nanos_per_mtok=1_000_000_000, batch_output_nanos_per_mtok=0)
    batch = openai_batch(catalog, [chat("a")])
    drive(batch)
    event = UsageEvent.objects.get(batch_id=str(batch.id))
    assert event.cost_nano_usd == event.input_tokens * 1000  # 1 USD per million tokens, output free
    assert event.billed_cost_nano_usd > event.cost_nano_usd  # the margin is visible


def test_anthropic_batch_at_the_provider_with_expired_and_errored_requests(catalog, provider, fake):
    fake.answer_when(
        "bad one",
        Reply(status=400, body={"type": "error", "error": {"type": "invalid_request_error", "message": "no"}}),
    )
    provider.expire_when("too slow")
    batch = anthropic_batch(catalog, [claude("a"), claude("b", "bad one"), claude("c", "too slow")])
    assert Item.objects.filter(batch=batch, state="delegated").count() == 3
    drive(batch)
    batch.refresh_from_db()
    assert batch.status == "completed"
    counts = anthropic_read.request_counts(anthropic_read.shown(batch.pk))
    assert counts == {"processing": 0, "succeeded": 1, "errored": 1, "canceled": 0, "expired": 1}
    rows = {row["custom_id"]: row for row in map(json.loads, b"".join(anthropic_read.iter_results(batch)).splitlines())}
    assert rows["a"]["result"]["type"] == "succeeded" and rows["a"]["result"]["message"]["type"] == "message"
    assert rows["b"]["result"]["type"] == "errored"
    assert rows["b"]["result"]["error"]["error"]["type"] == "invalid_request_error"
    assert rows["c"]["result"]["type"] == "expired"
    assert UsageEvent.objects.filter(batch_id=str(batch.id), executed_by="provider").count() == 2


def test_auto_mode_keeps_tool_calling_records_in_the_relay_and_says_why(catalog, provider):
    HostBinding.objects.update(batch_mode="auto")
    tool = {"openrelay": {"tool_config": {"url": "https://tools.example.com/run"}}}
    batch = openai_batch(catalog, [chat("a"), chat("t", **tool)])
    items = {i.custom_id: i for i in Item.objects.filter(batch=batch)}
    assert items["a"].state == "delegated" and items["a"].placement == ""
    assert items["t"].state == "available" and items["t"].placement == "tool_config"
    assert items["t"].provider_job_id is None


def test_relay_mode_binding_changes_nothing(catalog, fake):
    fake.batches.job_seconds = 0.3
    batch = openai_batch(catalog, [chat("a")])
    assert Item.objects.get(batch=batch).state == "available"
    assert not ProviderJob.objects.filter(batch=batch).exists()


def test_job_limits_split_records_into_jobs(catalog, provider, settings):
    settings.RELAY_PROVIDER_JOB_MAX_RECORDS = 2
    batch = openai_batch(catalog, [chat(str(i)) for i in range(5)])
    assert sorted(ProviderJob.objects.filter(batch=batch).values_list("records", flat=True)) == [1, 2, 2]
    drive(batch)
    assert Item.objects.filter(batch=batch, state="completed").count() == 5
    assert provider.creates("openai") == 3


def test_a_429_on_create_waits_and_sends_again_never_failing(catalog, provider):
    provider.refuse_creates(2, "openai", retry_after=1)
    batch = openai_batch(catalog, [chat("a")])
    job = ProviderJob.objects.get(batch=batch)
    jobs.advance(job.pk)
    job.refresh_from_db()
    assert job.status == JobStatus.PENDING and job.not_before > timezone.now() and job.capacity_waits == 1
    assert "capacity" in job.last_error
    drive(batch)
    assert Item.objects.get(batch=batch).state == "completed"
    assert ProviderJob.objects.get(pk=job.pk).capacity_waits == 2


def test_token_limit_exceeded_waits_and_creates_the_job_again(catalog, provider):
    provider.fail_token_limit(1)
    batch = openai_batch(catalog, [chat("a"), chat("b")])
    drive(batch)
    job = ProviderJob.objects.get(batch=batch)
    assert job.capacity_waits == 1 and job.status == JobStatus.DONE
    assert provider.creates("openai") == 2 and provider.uploads() == 1  # the file is sent once
    assert Item.objects.filter(batch=batch, state="completed").count() == 2


def test_auto_mode_runs_records_in_the_relay_when_the_provider_has_no_room(catalog, provider):
    HostBinding.objects.update(batch_mode="auto")
    provider.refuse_creates(1, "anthropic")
    batch = anthropic_batch(catalog, [claude("a"), claude("b")])
    job = ProviderJob.objects.get(batch=batch)
    jobs.advance(job.pk)
    assert ProviderJob.objects.get(pk=job.pk).status == JobStatus.RELEASED
    items = list(Item.objects.filter(batch=batch))
    assert {(i.state, i.placement, i.provider_job_id) for i in items} == {("available", "provider_capacity", None)}


def test_a_lost_create_answer_is_found_by_listing_not_created_twice(catalog, provider):
    for kind, make in (
        ("openai", lambda: openai_batch(catalog, [chat("a")])),
        ("anthropic", lambda: anthropic_batch(catalog, [claude("a")])),
    ):
        provider.drop_create_answers(1, kind)
        batch = make()
        job = ProviderJob.objects.get(batch=batch)
        jobs.advance(job.pk)
        job.refresh_from_db()
        assert job.status == JobStatus.SUBMITTING and job.upstream_id == ""
        drive(batch)
        job.refresh_from_db()
        assert job.status == JobStatus.DONE and job.upstream_id
        assert provider.creates(kind) == 1, kind
        assert Item.objects.get(batch=batch).state == "completed"


def test_polls_answered_500_keep_polling_and_never_fail(catalog, provider):
    batch = openai_batch(catalog, [chat("a")])
    job = ProviderJob.objects.get(batch=batch)
    jobs.advance(job.pk)  # sent
    provider.fail_polls(60)  # far longer than the three polls below, however slow the machine
    for _ in range(3):
        ProviderJob.objects.filter(pk=job.pk).update(not_before=None)
        jobs.advance(job.pk)
    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING and "poll" in job.last_error
    provider.fail_polls_until(0)  # the provider's outage ends: no waiting it out
    drive(batch)
    assert Item.objects.get(batch=batch).state == "completed"


def test_polls_keep_to_the_budget(catalog, provider, settings):
    settings.RELAY_PROVIDER_POLL_SECONDS = 12
    settings.RELAY_PROVIDER_POLL_MAX_SECONDS = 60
    batch = openai_batch(catalog, [chat("a")])
    job = ProviderJob.objects.get(batch=batch)
    jobs.advance(job.pk)
    for _ in range(20):  # duplicate messages: only a due poll is made
        jobs.advance(job.pk)
    assert len(provider.polls(ProviderJob.objects.get(pk=job.pk).upstream_id)) == 0
    assert jobs.poll_interval(0) == 12 and jobs.poll_interval(50) == 60


def test_cancel_cancels_the_upstream_job_and_keeps_what_finished(catalog, provider):
    provider.job_seconds = 3
    batch = anthropic_batch(catalog, [claude(str(i)) for i in range(4)])
    job = ProviderJob.objects.get(batch=batch)
    jobs.advance(job.pk)
    job.refresh_from_db()
    assert stop.cancel(batch)
    jobs.cancel_jobs(batch.pk)
    assert provider.requests(op="cancel", job=job.upstream_id)
    drive(batch)
    batch.refresh_from_db()
    assert batch.status == "cancelled"
    assert not Item.objects.filter(batch=batch, state="delegated").exists()


def test_cancel_before_the_job_is_sent_cancels_its_records(catalog, provider):
    batch = openai_batch(catalog, [chat("a"), chat("b")])
    assert stop.cancel(batch)
    jobs.cancel_jobs(batch.pk)
    assert set(Item.objects.filter(batch=batch).values_list("state", "error_code")) == {
        ("cancelled", "batch_cancelled")
    }
    assert ProviderJob.objects.get(batch=batch).status == JobStatus.DONE
    assert provider.creates() == 0


def test_a_revoked_credential_stops_the_job_before_it_is_sent(catalog, provider):
    from core.services import revoke_relay_key

    batch = openai_batch(catalog, [chat("a")])
    revoke_relay_key(catalog.key_obj)
    drive(batch)
    item = Item.objects.get(batch=batch)
    assert item.state == "discarded" and item.error_code == "credential_invalid"
    assert provider.creates() == 0


def test_operators_see_jobs_in_the_admin_and_metrics(catalog, provider, client, django_user_model):
    from django.urls import reverse

    from tests.test_metrics import scrape, value

    batch = openai_batch(catalog, [chat("a"), chat("b")])
    drive(batch)
    job = ProviderJob.objects.get(batch=batch)
    client.force_login(django_user_model.objects.create_superuser("root", "root@example.com", "pw"))
    page = client.get(reverse("admin:batches_providerjob_change", args=[job.pk])).content.decode()
    host_key = HostKey.objects.get(pk=job.host_key_id)
    assert job.upstream_id in page and host_key.name in page
    assert "upstream-openai" not in page  # the key's name, never its value
    assert client.get(reverse("admin:batches_providerjob_changelist")).status_code == 200
    batch_page = client.get(reverse("admin:batches_batch_change", args=[batch.pk])).content.decode()
    assert job.upstream_id in batch_page
    _, samples = scrape()
    assert value(samples, "relay_provider_jobs", kind="openai", status="done") == 1
    assert value(samples, "relay_provider_job_records", status="done") == 2
    assert value(samples, "relay_batch_records_run_total", executed_by="provider") == 2


def test_a_host_key_a_provider_echoes_in_a_result_never_reaches_the_tenant(catalog, provider, fake):
    leak = {"id": "x", "object": "chat.completion", "choices": [{"message": {"content": "key upstream-openai-1"}}]}
    fake.answer_when("echo", Reply(body=leak))
    fake.answer_when("fail echo", Reply(status=401, body={"error": {"message": "bad key upstream-openai-2"}}))
    batch = openai_batch(catalog, [chat("a", "echo"), chat("b", "fail echo")])
    drive(batch)
    finalize.finalize(batch.id)
    out = json.dumps(output_lines(batch))
    i = out.find("upstream-openai")
    assert i < 0, out[max(0, i - 400) : i + 40]
    assert "[host key redacted]" in out


def test_auto_mode_runs_what_the_provider_expired_in_the_relay_while_the_window_is_open(catalog, provider):
    HostBinding.objects.update(batch_mode="auto")
    provider.expire_when("slowpoke")
    batch = anthropic_batch(catalog, [claude("a"), claude("s", "slowpoke")])
    drive(batch)
    items = {i.custom_id: i for i in Item.objects.filter(batch=batch)}
    assert items["a"].state == "completed" and items["a"].provider_job_id is not None
    assert (items["s"].state, items["s"].placement, items["s"].provider_job_id) == (
        "available",
        "provider_expired",
        None,
    )
    # The relay's workers run it now, as any other record.
    from batches.lifecycle import claim as claims
    from batches.worker import execute

    execute.run_item(claims.claim("test-runner"))
    items["s"].refresh_from_db()
    assert items["s"].state == "completed"
    batch.refresh_from_db()
    assert batch.status == "completed"
    ran = dict(UsageEvent.objects.filter(batch_id=str(batch.id)).values_list("request_id", "executed_by"))
    assert ran == {str(items["a"].id): "provider", str(items["s"].id): "relay"}
