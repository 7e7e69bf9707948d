"""The clouds' batch APIs end to end: the official `openai` and `anthropic` SDKs → the relay (live server) → the
control worker (real Celery processes) → the fakes of Azure OpenAI's Global Batch, an OpenAI-compatible server's
Batch API, Bedrock's batch inference (its S3: moto's server on loopback) and Vertex AI's batch prediction jobs (its
Cloud Storage and OAuth2 token endpoint: the devkit fake), and OpenAI's own Batch API beside them. For each, the
records land at the provider's batch API, and a job survives the fleet killed (SIGKILL) and Redis flushed mid-run,
and a PostgreSQL restart, without being created twice, losing a record or billing one twice: every kind's job is in
flight through the one kill (and the one restart), as a lost node finds them."""

import json
import time

import anthropic
import openai
import pytest

from batches.models import Item
from batches.provider.models import JobStatus, ProviderJob
from core.models import Host, HostBinding
from core.redis import get_redis
from devkit.vertex import DEMO_BUCKET
from tests.test_cloud_batches import ACCESS_KEY_ID, MODEL_ID, ROLE, SECRET, _bind
from tests.test_openai_batches import jsonl, wait_status
from tests.test_storage_s3 import Bucket, s3_endpoint  # noqa: F401 - the session's S3 server (moto)
from tests.workers import pg_cluster, restart_postgresql, wait_for
from usage.models import UsageEvent

pytestmark = pytest.mark.django_db(transaction=True)
VERTEX_CLAUDE = "claude-3-5-haiku@20241022"
ENV = {"RELAY_PROVIDER_POLL_SECONDS": "0.2", "RELAY_PROVIDER_POLL_MAX_SECONDS": "0.5"}


@pytest.fixture
def fleet(workers):
    """A fleet of this test's own (the test kills it: the module's shared one would not come back)."""
    fleet = workers("cloud-batches", extra_env=dict(ENV))
    assert fleet.alive(), fleet.output()
    return fleet


class HeldClock:
    """The fakes' clock (they work a job's progress out from it on each request, devkit.batches): the real
    time until a test holds it, so that every job stays where it is, between its first record and its last,
    while the fleet dies and a new one starts; then moved on by hand, never back."""

    def __init__(self):
        self.held: float | None = None

    def __call__(self) -> float:
        return time.time() if self.held is None else self.held

    def hold(self, t: float) -> None:
        assert self.held is None or t >= self.held
        self.held = t


# Long beside the spread of the five creates (the clock is held 0.3 of it past the last: each job has run
# some of its records and none has run them all) and short enough for Azure's upload to be `pending` a moment
# (AZURE_FILE_PENDING of it); the real clock never has to run it out.
JOB_SECONDS = 20.0


def _openai_batch(sdk, model: str, n: int):
    records = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"hello {i}"}]},
        }
        for i in range(n)
    ]
    uploaded = sdk.files.create(file=("in.jsonl", jsonl(records)), purpose="batch")
    return sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def _succeeded(fake, key: str, op: str, provider: str = "openai") -> int:
    """The OpenAI-shaped fake's answered requests made with a host key starting with `key` (the OpenAI and the
    OpenAI-compatible hosts share its routes: their keys tell them apart)."""
    return sum(
        1 for e in fake.batches.requests(op=op, provider=provider) if e["status"] == 200 and e["key"].startswith(key)
    )


def test_every_kinds_job_survives_the_fleet_killed_and_redis_flushed_mid_job(
    live_server,
    catalog,
    fake,
    fleet,
    workers,
    s3_endpoint,  # noqa: F811 - the fixture imported above
):
    """One batch per provider kind (OpenAI, Azure OpenAI, an OpenAI-compatible server, Bedrock, Vertex) sent
    through the official SDKs, each job at its provider between its first record and its last, when every
    process of the fleet is SIGKILLed (an OOM kill, a lost node) and Redis flushed with every message: a new
    fleet takes each job over while it still runs, and each job was created once, every record came back
    once and was billed once, as executed by the provider."""
    clock = HeldClock()
    fake.batches.clock = fake.vertex.clock = clock
    fake.batches.job_seconds = fake.vertex.job_seconds = JOB_SECONDS
    HostBinding.objects.filter(model__name="gpt-4o").update(batch_mode="provider")
    azure = Host.objects.create(name="azure", kind="azure_openai", base_url=fake.url, options={})
    _bind(catalog, azure, "gpt-azure", "openai", "gpt-4o-mini", "azure-key-0", batch_mode="provider")
    compat = Host.objects.create(name="vllm", kind="openai_compatible", base_url=f"{fake.url}/v1", options={})
    _bind(catalog, compat, "llama", "openai", "meta-llama/Llama-3.1-8B", "compat-key-0", batch_mode="provider")
    fake.clouds.bedrock_keys[ACCESS_KEY_ID] = SECRET
    fake.batches.bedrock.use_s3(s3_endpoint)
    options = {
        "access_key_id": ACCESS_KEY_ID,
        "region": "us-east-1",
        "batch_bucket": Bucket(s3_endpoint).name,
        "batch_role_arn": ROLE,
        "batch_s3_url": s3_endpoint,
        "batch_control_url": fake.url,
    }
    bedrock = Host.objects.create(name="bedrock", kind="bedrock", base_url=fake.url, options=options)
    _bind(catalog, bedrock, "br-haiku", "anthropic", MODEL_ID, SECRET, batch_mode="provider")
    _vertex(catalog, fake)
    openai_models = {"openai": "gpt-4o", "azure_openai": "gpt-azure", "openai_compatible": "llama"}
    claude_models = {"bedrock": "br-haiku", "vertex": "vx-haiku"}
    n = {"openai": 10, "azure_openai": 10, "openai_compatible": 10, "bedrock": 100, "vertex": 10}  # Bedrock: >= 100
    try:
        with (
            openai.OpenAI(base_url=live_server.url + "/v1", api_key=catalog.key, max_retries=0) as oa,
            anthropic.Anthropic(base_url=live_server.url, api_key=catalog.key, max_retries=0) as an,
        ):
            batches = {kind: _openai_batch(oa, model, n[kind]) for kind, model in openai_models.items()}
            batches |= {kind: _claude_batch(an, model, n[kind]) for kind, model in claude_models.items()}
            wait_for(lambda: ProviderJob.objects.filter(status=JobStatus.RUNNING).count() == len(n), 60, what="jobs")
            clock.hold(time.time() + 0.3 * JOB_SECONDS)

            def mid_job() -> dict | None:
                """Each job as the relay last polled it, once every one is seen between its first record and
                its last (the relay learns the counts from its polls only)."""
                jobs = {job.kind: job for job in ProviderJob.objects.all()}
                return jobs if all(0 < jobs[kind].completed < n[kind] for kind in n) else None

            try:
                wait_for(mid_job, 30, what="every job seen mid-job")
            except AssertionError:
                raise AssertionError(str(list(ProviderJob.objects.values("kind", "status", "completed")))) from None
            for kind in openai_models:  # the counts move on the relay's own batch while the provider runs it
                assert 0 < oa.batches.retrieve(batches[kind].id).request_counts.completed < n[kind]
            fleet.kill()  # every process of the fleet: SIGKILL, pool children too
            get_redis().flushdb()  # and every message with it
            # The held clock kept every job where it was; the dead fleet polls no more from here.
            polled = dict(ProviderJob.objects.values_list("id", "polls"))
            workers("cloud-after-kill", extra_env=dict(ENV))
            wait_for(
                lambda: all(ProviderJob.objects.get(pk=pk).polls > count for pk, count in polled.items()),
                60,
                what="the new fleet polling every job still running",
            )
            clock.hold(time.time() + JOB_SECONDS)  # every job past its end
            for kind in openai_models:
                done = wait_status(oa, batches[kind].id, timeout=60)
                assert done.status == "completed" and done.request_counts.completed == n[kind], (kind, done)
                lines = [json.loads(line) for line in oa.files.content(done.output_file_id).text.splitlines()]
                assert sorted(line["custom_id"] for line in lines) == sorted(f"r{i}" for i in range(n[kind])), kind
            for kind in claude_models:
                ended = _ended(an, batches[kind])
                assert ended.request_counts.succeeded == n[kind], (kind, ended)
                results = list(an.messages.batches.results(ended.id))
                assert sorted(r.custom_id for r in results) == sorted(f"r{i}" for i in range(n[kind])), kind
                assert {r.result.type for r in results} == {"succeeded"}, kind
    finally:
        fake.batches.bedrock.use_s3(None)
    # Never created twice (nor uploaded twice).
    for key in ("upstream-openai-", "compat-key-0"):  # the catalog's OpenAI keys (tests.factories), vLLM's
        assert _succeeded(fake, key, "create") == 1 and _succeeded(fake, key, "upload") == 1, key
    assert _succeeded(fake, "azure-key-0", "create", "azure") == 1
    assert _succeeded(fake, "azure-key-0", "upload", "azure") == 1
    assert fake.batches.bedrock.creates() == 1 and fake.vertex.creates() == 1
    jobs = {job.kind: job for job in ProviderJob.objects.all()}
    assert fake.vertex.job(jobs["vertex"].upstream_id) is not None
    for kind in openai_models:
        # Every poll the provider saw was one the job's row let through (a worker killed between taking a
        # poll and sending it leaves one taken but unsent): duplicate messages never polled on their own.
        assert len(fake.batches.polls(jobs[kind].upstream_id)) <= jobs[kind].polls, kind
    for kind, job in jobs.items():  # nothing billed twice
        events = UsageEvent.objects.filter(batch_id=str(job.batch_id))
        assert events.count() == n[kind] and set(events.values_list("executed_by", flat=True)) == {"provider"}, kind


def _vertex(catalog, fake, name: str = "vx-haiku") -> None:
    """A Vertex host on the fake (its token endpoint, Cloud Storage and batch prediction jobs) with a Claude
    binding in provider mode; the host key is a service account the fake issued."""
    options = {"project": "relay-test", "region": "us-east5", "gcs_bucket": DEMO_BUCKET, "storage_url": fake.url}
    host = Host.objects.create(name="vertex", kind="vertex", base_url=fake.url, options=options)
    account = fake.vertex.add_service_account("relay-e2e@relay-test.iam.gserviceaccount.com", "relay-test")
    _bind(catalog, host, name, "anthropic", VERTEX_CLAUDE, account, batch_mode="provider")


def _claude_batch(sdk, model: str, n: int):
    requests = [
        {
            "custom_id": f"r{i}",
            "params": {"model": model, "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]},
        }
        for i in range(n)
    ]
    return sdk.messages.batches.create(requests=requests)


def _ended(sdk, batch, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while batch.processing_status != "ended":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = sdk.messages.batches.retrieve(batch.id)
    return batch


@pytest.mark.skipif(pg_cluster() is None, reason="needs root and the machine's own PostgreSQL cluster to restart")
@pytest.mark.alone  # every xdist worker's database goes down with the server
def test_a_postgresql_restart_while_every_clouds_job_runs_loses_and_repeats_nothing(live_server, catalog, fake, fleet):
    """One batch per cloud kind (Azure, an OpenAI-compatible server, Vertex) at its provider's batch API when the
    server restarts: each job is created once, every record comes back once, billed once."""
    fake.batches.job_seconds = 4
    fake.vertex.job_seconds = 4
    azure = Host.objects.create(name="azure", kind="azure_openai", base_url=fake.url, options={})
    _bind(catalog, azure, "gpt-azure", "openai", "gpt-4o-mini", "azure-key-0", batch_mode="provider")
    compat = Host.objects.create(name="vllm", kind="openai_compatible", base_url=f"{fake.url}/v1", options={})
    _bind(catalog, compat, "llama", "openai", "meta-llama/Llama-3.1-8B", "compat-key-0", batch_mode="provider")
    _vertex(catalog, fake)
    n = 12
    with (
        openai.OpenAI(base_url=live_server.url + "/v1", api_key=catalog.key, max_retries=0) as oa,
        anthropic.Anthropic(base_url=live_server.url, api_key=catalog.key, max_retries=0) as an,
    ):
        openai_batches = []
        for model in ("gpt-azure", "llama"):
            records = [
                {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": model, "messages": [{"role": "user", "content": f"hello {i}"}]}}
                for i in range(n)
            ]  # fmt: skip
            uploaded = oa.files.create(file=("in.jsonl", jsonl(records)), purpose="batch")
            openai_batches.append(
                oa.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
            )
        claude = _claude_batch(an, "vx-haiku", n)
        wait_for(lambda: ProviderJob.objects.filter(status=JobStatus.RUNNING).count() == 3, 30, what="three jobs sent")
        restart_postgresql()
        for b in openai_batches:
            done = wait_status(oa, b.id, timeout=90)
            assert done.status == "completed" and done.request_counts.completed == n, done
        claude = _ended(an, claude, timeout=90)
        assert claude.request_counts.succeeded == n, claude
    assert fleet.alive(), fleet.output()
    assert sorted(ProviderJob.objects.values_list("kind", flat=True)) == ["azure_openai", "openai_compatible", "vertex"]
    azure_creates = [e for e in fake.batches.requests(provider="azure", op="create") if e["status"] == 200]
    assert len(azure_creates) == 1 and fake.batches.creates("openai") == 1
    assert fake.vertex.creates() == 1
    for batch_id in Item.objects.values_list("batch_id", flat=True).distinct():
        events = UsageEvent.objects.filter(batch_id=str(batch_id))
        assert events.count() == n and set(events.values_list("executed_by", flat=True)) == {"provider"}
