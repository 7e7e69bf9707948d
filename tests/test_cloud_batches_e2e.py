"""The clouds' batch APIs end to end: the official `openai` and `anthropic` SDKs → the relay (live server) → the
control worker (real Celery processes) → the fakes of Azure OpenAI's Global Batch, an OpenAI-compatible server's
Batch API and Bedrock's batch inference (its S3: moto's server on loopback). For each, the records land at the
provider's batch API, and a job survives its control worker killed (SIGKILL) and Redis flushed mid-run, and a
PostgreSQL restart, without being created twice, losing a record or billing one twice. Vertex AI's batch prediction
jobs (its Cloud Storage and OAuth2 token endpoint: the devkit fake) too."""

import json
import time

import anthropic
import openai
import pytest

from batches.models import Item
from batches.provider.models import JobStatus, ProviderJob
from core.models import Host
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


def _restart(fleet, workers) -> None:
    """Every process of the fleet killed (SIGKILL, as an OOM kill or a lost node), every message with Redis, and
    a new fleet started."""
    fleet.kill()
    get_redis().flushdb()
    workers("cloud-after-kill", extra_env=dict(ENV))


def _openai_crash(live_server, catalog, fleet, workers, model: str, n: int = 20):
    with openai.OpenAI(base_url=live_server.url + "/v1", api_key=catalog.key, max_retries=0) as sdk:
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
        batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(lambda: ProviderJob.objects.filter(status=JobStatus.RUNNING).exists(), 20, what="the job sent")
        wait_for(lambda: 0 < sdk.batches.retrieve(batch.id).request_counts.completed, 20, what="counts moving")
        _restart(fleet, workers)
        done = wait_status(sdk, batch.id, timeout=60)
        assert done.status == "completed" and done.request_counts.completed == n, done
        lines = [json.loads(line) for line in sdk.files.content(done.output_file_id).text.splitlines()]
        assert sorted(line["custom_id"] for line in lines) == sorted(f"r{i}" for i in range(n))
    relay_id = Item.objects.values_list("batch_id", flat=True).first()
    events = UsageEvent.objects.filter(batch_id=str(relay_id))
    assert events.count() == n and set(events.values_list("executed_by", flat=True)) == {"provider"}


def test_azure_batch_through_the_api_survives_its_control_worker_killed(live_server, catalog, fake, fleet, workers):
    fake.batches.job_seconds = 3
    host = Host.objects.create(name="azure", kind="azure_openai", base_url=fake.url, options={})
    _bind(catalog, host, "gpt-azure", "openai", "gpt-4o-mini", "azure-key-0", batch_mode="provider")
    _openai_crash(live_server, catalog, fleet, workers, "gpt-azure")
    creates = [e for e in fake.batches.requests(provider="azure", op="create") if e["status"] == 200]
    assert len(creates) == 1 and fake.batches.requests(provider="azure", op="upload")


def test_openai_compatible_batch_through_the_api_survives_its_control_worker_killed(
    live_server, catalog, fake, fleet, workers
):
    fake.batches.job_seconds = 3
    host = Host.objects.create(name="vllm", kind="openai_compatible", base_url=f"{fake.url}/v1", options={})
    _bind(catalog, host, "llama", "openai", "meta-llama/Llama-3.1-8B", "compat-key-0", batch_mode="provider")
    _openai_crash(live_server, catalog, fleet, workers, "llama")
    assert fake.batches.creates("openai") == 1 and fake.batches.uploads() == 1


def test_bedrock_batch_through_the_api_survives_its_control_worker_killed(
    live_server,
    catalog,
    fake,
    fleet,
    workers,
    s3_endpoint,  # noqa: F811 - the fixture imported above
):
    bucket = Bucket(s3_endpoint)
    fake.batches.job_seconds = 4
    fake.clouds.bedrock_keys[ACCESS_KEY_ID] = SECRET
    fake.batches.bedrock.use_s3(s3_endpoint)
    options = {
        "access_key_id": ACCESS_KEY_ID,
        "region": "us-east-1",
        "batch_bucket": bucket.name,
        "batch_role_arn": ROLE,
        "batch_s3_url": s3_endpoint,
        "batch_control_url": fake.url,
    }
    host = Host.objects.create(name="bedrock", kind="bedrock", base_url=fake.url, options=options)
    _bind(catalog, host, "br-haiku", "anthropic", MODEL_ID, SECRET, batch_mode="provider")
    n = 120
    try:
        with anthropic.Anthropic(base_url=live_server.url, api_key=catalog.key, max_retries=0) as sdk:
            requests = [
                {
                    "custom_id": f"r{i}",
                    "params": {"model": "br-haiku", "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]},
                }
                for i in range(n)
            ]
            batch = sdk.messages.batches.create(requests=requests)
            wait_for(lambda: ProviderJob.objects.filter(status=JobStatus.RUNNING).exists(), 20, what="the job sent")
            job = ProviderJob.objects.get()
            wait_for(lambda: bedrock_progress(fake, job) > 0, 20, what="records running at Bedrock")
            _restart(fleet, workers)
            deadline = time.monotonic() + 60
            while batch.processing_status != "ended":
                assert time.monotonic() < deadline, batch
                time.sleep(0.2)
                batch = sdk.messages.batches.retrieve(batch.id)
            assert batch.request_counts.succeeded == n, batch
            results = list(sdk.messages.batches.results(batch.id))
            assert sorted(r.custom_id for r in results) == sorted(f"r{i}" for i in range(n))
            assert {r.result.type for r in results} == {"succeeded"}
    finally:
        fake.batches.bedrock.use_s3(None)
    assert fake.batches.bedrock.creates() == 1
    events = UsageEvent.objects.filter(batch_id=str(Item.objects.values_list("batch_id", flat=True).first()))
    assert events.count() == n and set(events.values_list("executed_by", flat=True)) == {"provider"}


def bedrock_progress(fake, job) -> int:
    upstream = fake.batches.bedrock.job(ProviderJob.objects.get(pk=job.pk).upstream_id or "-")
    if upstream is None:
        return 0
    fake.batches.bedrock._advance(upstream)
    return upstream.success


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


def test_vertex_batch_through_the_api_survives_its_control_worker_killed(live_server, catalog, fake, fleet, workers):
    fake.vertex.job_seconds = 3
    _vertex(catalog, fake)
    n = 20
    with anthropic.Anthropic(base_url=live_server.url, api_key=catalog.key, max_retries=0) as sdk:
        batch = _claude_batch(sdk, "vx-haiku", n)
        wait_for(lambda: ProviderJob.objects.filter(status=JobStatus.RUNNING).exists(), 20, what="the job sent")
        _restart(fleet, workers)
        batch = _ended(sdk, batch)
        assert batch.request_counts.succeeded == n, batch
        assert sorted(r.custom_id for r in sdk.messages.batches.results(batch.id)) == sorted(f"r{i}" for i in range(n))
    job = ProviderJob.objects.get()
    assert job.kind == "vertex" and fake.vertex.job(job.upstream_id) is not None
    assert fake.vertex.creates() == 1
    events = UsageEvent.objects.filter(batch_id=str(Item.objects.values_list("batch_id", flat=True).first()))
    assert events.count() == n and set(events.values_list("executed_by", flat=True)) == {"provider"}


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
