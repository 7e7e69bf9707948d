"""Provider batch mode end to end: the official `openai` and `anthropic` SDKs → the relay (live server) → the
control worker (real Celery processes) → the fake provider's batch APIs. The same scripts run against a
provider-mode binding and a relay-mode binding and get results of the same shape; a job survives a PostgreSQL
restart mid-run. (A job at OpenAI surviving the fleet killed and Redis flushed mid-run is proven beside every
other provider kind's, in one kill: tests/test_cloud_batches_e2e.py.)"""

import json
import time

import anthropic
import openai
import pytest

from batches.models import Batch, Item
from batches.provider.models import JobStatus, ProviderJob
from core.models import HostBinding, LLMModel
from tests.test_openai_batches import jsonl, wait_status
from tests.test_provider_batches import chat, openai_batch
from tests.workers import pg_cluster, restart_postgresql, wait_for
from usage.models import UsageEvent

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def worker_env():
    return {"RELAY_PROVIDER_POLL_SECONDS": "0.2", "RELAY_PROVIDER_POLL_MAX_SECONDS": "0.5"}


@pytest.fixture
def modes(catalog, fake):
    """gpt-4o and claude-sonnet at the provider; gpt-live and claude-live, the same hosts, in the relay."""
    fake.batches.job_seconds = 0.5
    HostBinding.objects.update(batch_mode="provider")
    for name, like in (("gpt-live", "gpt-4o"), ("claude-live", "claude-sonnet")):
        source = HostBinding.objects.get(model__name=like)
        model = LLMModel.objects.create(name=name, provider=source.model.provider)
        HostBinding.objects.create(
            model=model,
            host=source.host,
            adapter=source.adapter,
            upstream_name=source.upstream_name,
            pricing=source.pricing,
            batch_mode="relay",
        )
    return fake.batches


@pytest.fixture
def oai(live_server, catalog, worker):
    assert worker.alive(), worker.output()
    with openai.OpenAI(base_url=live_server.url + "/v1", api_key=catalog.key, max_retries=0) as sdk:
        yield sdk


@pytest.fixture
def claude(live_server, catalog, worker):
    assert worker.alive(), worker.output()
    with anthropic.Anthropic(base_url=live_server.url, api_key=catalog.key, max_retries=0) as sdk:
        yield sdk


def shape(value):
    """The structure of a JSON value: keys and types, not the values."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items() if k not in ("id", "created", "system_fingerprint")}
    if isinstance(value, list):
        return [shape(v) for v in value[:1]]
    return type(value).__name__


def openai_script(sdk, model: str) -> dict:
    records = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"hello {i}"}]},
        }
        for i in range(3)
    ]
    uploaded = sdk.files.create(file=("in.jsonl", jsonl(records)), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_status(sdk, batch.id, timeout=30)
    assert done.status == "completed" and done.request_counts.completed == 3, done
    lines = [json.loads(line) for line in sdk.files.content(done.output_file_id).text.splitlines()]
    return {"batch": shape(done.model_dump()), "line": shape(lines[0]), "ids": sorted(r["custom_id"] for r in lines)}


def test_openai_sdk_gets_the_same_shapes_from_provider_and_relay_mode(oai, modes):
    at_provider = openai_script(oai, "gpt-4o")
    in_relay = openai_script(oai, "gpt-live")
    assert at_provider == in_relay
    assert set(UsageEvent.objects.filter(model="gpt-4o").values_list("executed_by", flat=True)) == {"provider"}
    assert set(UsageEvent.objects.filter(model="gpt-live").values_list("executed_by", flat=True)) == {"relay"}
    assert modes.creates("openai") == 1


def anthropic_script(sdk, model: str) -> dict:
    requests = [
        {
            "custom_id": f"r{i}",
            "params": {"model": model, "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]},
        }
        for i in range(3)
    ]
    batch = sdk.messages.batches.create(requests=requests)
    deadline = time.monotonic() + 30
    while batch.processing_status != "ended":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = sdk.messages.batches.retrieve(batch.id)
    assert batch.request_counts.succeeded == 3, batch
    results = list(sdk.messages.batches.results(batch.id))
    return {
        "batch": shape(batch.model_dump(mode="json")),
        "result": shape(results[0].model_dump(mode="json")),
        "ids": sorted(r.custom_id for r in results),
    }


def test_anthropic_sdk_gets_the_same_shapes_from_provider_and_relay_mode(claude, modes):
    assert anthropic_script(claude, "claude-sonnet") == anthropic_script(claude, "claude-live")
    assert set(UsageEvent.objects.filter(model="claude-sonnet").values_list("executed_by", flat=True)) == {"provider"}
    assert modes.creates("anthropic") == 1


@pytest.mark.skipif(pg_cluster() is None, reason="needs root and the machine's own PostgreSQL cluster to restart")
@pytest.mark.alone  # every xdist worker's database goes down with the server
def test_a_postgresql_restart_mid_job_loses_nothing(workers, catalog, fake):
    fake.batches.job_seconds = 4
    HostBinding.objects.update(batch_mode="provider")
    w = workers("pg-restart-provider", extra_env={"RELAY_PROVIDER_POLL_SECONDS": "0.3"})
    batch = openai_batch(catalog, [chat(str(i)) for i in range(30)])
    try:
        wait_for(lambda: ProviderJob.objects.filter(status=JobStatus.RUNNING).exists(), 20, what="the job sent")
    except AssertionError:
        raise AssertionError(str(list(ProviderJob.objects.values())) + w.output()) from None
    restart_postgresql()
    wait_for(lambda: Batch.objects.get(pk=batch.pk).status == "completed", 60, interval=0.5, what="the batch")
    assert w.alive(), w.output()
    assert fake.batches.creates("openai") == 1
    assert Item.objects.filter(batch_id=batch.pk, state="completed").count() == 30
    assert UsageEvent.objects.filter(batch_id=str(batch.pk), executed_by="provider").count() == 30
