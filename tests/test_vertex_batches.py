"""Vertex AI batch prediction for Claude (gateway.batch_apis.vertex), driven step by step against the fake
Vertex AI of devkit.vertex: the input uploaded to its Cloud Storage, the job created, found again by its label
after a create whose answer was lost, polled, its predictions read back, cancelled; every call with the service
account's access token. The fake's clock is moved by hand, so progress is exact."""

import json
import uuid
from types import SimpleNamespace

import pytest

from core.hostkinds import vertex as vertex_kind
from core.models import Host
from devkit.upstream import Reply
from devkit.vertex import DEMO_BUCKET, PROJECT_NUMBER
from gateway import batch_apis as wire
from gateway.batch_apis.vertex import VertexBatchAPI
from gateway.upstream import UpstreamError

T = 10.0  # the jobs' seconds under the hand-moved clock
START = 1_800_000_000.0
CLAUDE = "claude-3-5-haiku@20241022"


class Clock:
    def __init__(self):
        self.t = START

    def __call__(self) -> float:
        return self.t

    def at(self, fraction: float) -> None:
        self.t = START + fraction * T


@pytest.fixture
def clock(fake):
    c = Clock()
    fake.vertex.clock = c
    fake.vertex.job_seconds = T
    vertex_kind.forget_tokens()
    yield c
    vertex_kind.forget_tokens()


def vertex_host(fake, **options) -> Host:
    settings = {"project": "relay-test", "region": "us-east5", "gcs_bucket": DEMO_BUCKET, "storage_url": fake.url}
    return Host(name="vx", kind="vertex", base_url=fake.url, options={**settings, **options})


def new_job():
    job_id = uuid.uuid4()
    return SimpleNamespace(
        id=job_id,
        pk=job_id,
        endpoint="/v1/messages",
        upstream_id="",
        upstream_input_file_id="",
        host_id=1,
        binding_id=1,
        custom_id=lambda idx: f"{job_id.hex}-{idx}",
    )


def api_for(fake, job=None, sa: str = "", **options) -> VertexBatchAPI:
    host = vertex_host(fake, **options)
    binding = SimpleNamespace(host=host, adapter="anthropic", upstream_name=CLAUDE)
    sa = sa or fake.vertex.add_service_account("relay-batch@relay-test.iam.gserviceaccount.com", "relay-test")
    target = wire.Target(fake.url, "anthropic", sa, None, host=host, binding=binding)
    return VertexBatchAPI(target, job or new_job())


def body(text: str, **extra) -> bytes:
    return json.dumps(
        {"model": CLAUDE, "max_tokens": 32, "messages": [{"role": "user", "content": text}], **extra}
    ).encode()


def send(api: VertexBatchAPI, texts) -> str:
    """The job's records uploaded and its batch created: its upstream name (also set on the job)."""
    records = api.records()
    try:
        for i, text in enumerate(texts):
            records.add(api.job.custom_id(i), body(text, stream=False))
        api.job.upstream_input_file_id = api.upload(records)
        api.job.upstream_id = api.create(records)
    finally:
        records.close()
    return api.job.upstream_id


def test_a_job_is_uploaded_created_polled_and_read_back(fake, clock):
    api = api_for(fake)
    hex_id = api.job.id.hex
    name = send(api, ["one", "two", "three"])
    # The input: one {"custom_id", "request"} line a record, in the live call's envelope.
    assert api.job.upstream_input_file_id == f"gs://{DEMO_BUCKET}/relay/{hex_id}/input.jsonl"
    lines = [json.loads(x) for x in fake.vertex.object(DEMO_BUCKET, f"relay/{hex_id}/input.jsonl").splitlines()]
    assert [x["custom_id"] for x in lines] == [f"{hex_id}-{i}" for i in range(3)]
    assert lines[0]["request"] == {
        "max_tokens": 32,
        "messages": [{"role": "user", "content": "one"}],
        "anthropic_version": "vertex-2023-10-16",
    }
    # The job: named with the project's number, labelled with the relay job, the model the binding's.
    assert name.startswith(f"projects/{PROJECT_NUMBER}/locations/us-east5/batchPredictionJobs/")
    made = fake.vertex.job(name)
    assert made.spec["labels"] == {"relay_job": hex_id}
    assert made.spec["model"] == f"publishers/anthropic/models/{CLAUDE}"
    assert made.spec["outputConfig"]["gcsDestination"]["outputUriPrefix"] == f"gs://{DEMO_BUCKET}/relay/{hex_id}/output"

    assert api.status().raw_status == "JOB_STATE_PENDING"
    clock.at(0.5)
    running = api.status()
    assert (running.phase, running.raw_status) == ("running", "JOB_STATE_RUNNING") and 0 < running.completed < 3
    clock.at(0.95)
    ended = api.status()
    assert (ended.phase, ended.raw_status, ended.completed, ended.failed) == ("ended", "JOB_STATE_SUCCEEDED", 3, 0)
    assert ended.sources and ended.sources[0].startswith(f"gs://{DEMO_BUCKET}/relay/{hex_id}/output/prediction-")
    results = list(api.results(ended))
    assert [r.custom_id for r in results] == [f"{hex_id}-{i}" for i in range(3)]
    assert all(r.outcome == "succeeded" and r.status_code == 200 for r in results)
    assert results[1].parsed["type"] == "message" and "two" in results[1].parsed["content"][0]["text"]
    assert results[1].parsed["usage"]["input_tokens"] > 0
    # One token for the whole job: minted once, carried by every call.
    assert len(fake.vertex.mints) == 1
    assert {e["op"] for e in fake.vertex.requests()} >= {"upload", "create", "get", "list_objects", "download"}


def test_a_partly_failed_job_gives_each_record_its_own_outcome(fake, clock):
    error = {"type": "error", "error": {"type": "invalid_request_error", "message": "prompt refused"}}
    fake.answer_when("PLEASE-FAIL", Reply(status=400, body=error))
    api = api_for(fake)
    send(api, ["fine", "PLEASE-FAIL", "also fine"])
    clock.at(0.95)
    st = api.status()
    assert (st.phase, st.raw_status, st.completed, st.failed) == ("ended", "JOB_STATE_PARTIALLY_SUCCEEDED", 2, 1)
    results = {r.custom_id.rsplit("-", 1)[1]: r for r in api.results(st)}
    assert sorted(results) == ["0", "1", "2"]
    assert results["1"].outcome == "errored" and results["1"].status_code == 400
    assert json.loads(results["1"].body)["error"] == {"type": "invalid_request_error", "message": "prompt refused"}
    assert results["0"].outcome == results["2"].outcome == "succeeded"


def test_records_that_never_ran_come_out_expired_when_the_job_expires(fake, clock):
    fake.batches.expire_when("NEVER-ENDS")  # the demo upstream's knob: that record never finishes
    api = api_for(fake)
    send(api, ["quick", "NEVER-ENDS", "quick too"])
    clock.at(0.95)
    assert api.status().phase == "running"
    clock.at(1.0)
    st = api.status()
    assert (st.phase, st.raw_status, st.completed) == ("ended", "JOB_STATE_EXPIRED", 2)
    outcomes = {r.custom_id.rsplit("-", 1)[1]: r.outcome for r in api.results(st)}
    assert outcomes == {"0": "succeeded", "1": "expired", "2": "succeeded"}


def test_a_lost_create_is_found_by_its_label_and_no_other_job_claims_it(fake, clock):
    sa = fake.vertex.add_service_account("relay-lost@relay-test.iam.gserviceaccount.com", "relay-test")
    api = api_for(fake, sa=sa)
    fake.vertex.drop_create_answers(1)
    with pytest.raises(UpstreamError):
        send(api, ["lost"])
    assert fake.vertex.creates() == 1 and api.job.upstream_id == ""  # made at Vertex, unknown to the relay
    found = api.find()
    assert found is not None and fake.vertex.job(found).spec["labels"]["relay_job"] == api.job.id.hex
    assert api.find(owned={found}) is None  # held by another job already: not this one's
    assert api_for(fake, sa=sa).find() is None  # another job: nothing carries its label
    # A failed job with the label is not the lost create (sending again makes a new one).
    failing = api_for(fake, sa=sa)
    fake.vertex.fail_jobs(1)
    send(failing, ["doomed"])
    clock.at(0.2)
    assert failing.status().phase == "failed"
    assert failing.find() is None


def test_a_cancelled_job_ends_with_its_unrun_records_canceled(fake, clock):
    api = api_for(fake)
    send(api, ["a", "b", "c", "d"])
    clock.at(0.5)  # half the records run
    api.cancel()
    st = api.status()
    assert (st.phase, st.raw_status) == ("running", "JOB_STATE_CANCELLING")
    clock.at(0.6)
    st = api.status()
    assert (st.phase, st.raw_status) == ("ended", "JOB_STATE_CANCELLED")
    outcomes = [r.outcome for r in sorted(api.results(st), key=lambda r: r.custom_id)]
    assert outcomes == ["succeeded", "succeeded", "canceled", "canceled"]


def test_a_job_failed_for_quota_is_capacity_and_another_failure_is_not(fake, clock):
    quota = api_for(fake)
    fake.vertex.fail_jobs(1, code=8, message="Quota exceeded for concurrent batch prediction jobs")
    send(quota, ["x"])
    invalid = api_for(fake)
    fake.vertex.fail_jobs(1, code=3, message="The input is not valid JSONL")
    send(invalid, ["y"])
    clock.at(0.2)
    st = quota.status()
    assert (st.phase, st.capacity) == ("failed", True) and "Quota exceeded" in st.message
    st = invalid.status()
    assert (st.phase, st.capacity, st.message) == ("failed", False, "The input is not valid JSONL")


def test_a_create_refused_for_quota_is_capacity(fake, clock):
    fake.vertex.refuse_creates(1)
    api = api_for(fake)
    with pytest.raises(wire.Refused) as exc:
        send(api, ["x"])
    assert exc.value.status == 429 and exc.value.capacity
    assert b"RESOURCE_EXHAUSTED" in exc.value.body


def test_a_job_whose_input_is_gone_fails(fake, clock):
    api = api_for(fake)
    send(api, ["x"])
    name = api.job.upstream_input_file_id.removeprefix(f"gs://{DEMO_BUCKET}/")
    del fake.vertex.buckets[DEMO_BUCKET][name]
    clock.at(0.2)
    st = api.status()
    assert st.phase == "failed" and "input" in st.message


def test_a_host_without_a_bucket_or_on_the_global_location_takes_no_batch_jobs(fake):
    assert VertexBatchAPI.unready(vertex_host(fake)) == ""
    no_bucket = Host(kind="vertex", base_url=fake.url, options={"project": "relay-test"})
    assert VertexBatchAPI.unready(no_bucket) == "the host has no gcs_bucket"
    assert "regional location" in VertexBatchAPI.unready(vertex_host(fake, region="global"))


def test_the_registry_names_it_for_a_vertex_hosts_claude_bindings_only(fake):
    host = vertex_host(fake)
    assert wire.api("vertex") is VertexBatchAPI
    assert wire.for_host(host, "anthropic") is VertexBatchAPI
    assert wire.for_host(host, "openai") is None  # Vertex's batch for Gemini takes Gemini's shape: run in the relay


@pytest.mark.parametrize(
    "line, outcome, status",
    [
        (
            {"custom_id": "j-0", "response": {"type": "message", "content": [], "usage": {}}, "status": ""},
            "succeeded",
            200,
        ),
        ({"custom_id": "j-1", "response": {"body": {"type": "message", "content": []}}}, "succeeded", 200),
        (
            {"custom_id": "j-2", "response": {"type": "error", "error": {"type": "overloaded_error"}}, "status": "x"},
            "errored",
            529,
        ),
        ({"custom_id": "j-3", "status": "Bad Request: messages: Field required"}, "errored", 500),
        ({"custom_id": "j-4", "error": {"code": 400, "message": "invalid instance"}}, "errored", 400),
        ({"custom_id": "j-5", "response": {"type": "message"}, "status": "quota"}, "errored", 500),
    ],
)
def test_a_prediction_line_is_read_whatever_its_form(line, outcome, status):
    result = VertexBatchAPI.parse_line(json.dumps(line).encode())
    assert (result.custom_id, result.outcome, result.status_code) == (line["custom_id"], outcome, status)
    if outcome == "errored":
        assert json.loads(result.body)["type"] == "error"
    assert VertexBatchAPI.parse_line(b"not json").outcome == "errored"


# --- provider batch mode end to end, in process: placement → job → the fake → results ---------------------


@pytest.mark.django_db(transaction=True)
def test_a_claude_batch_runs_as_a_vertex_batch_prediction_job_at_the_batch_price(catalog, fake, settings):
    from batches.models import Batch, Item
    from batches.provider.models import JobStatus, ProviderJob
    from core.models import HostBinding, HostKey, LLMModel, Pricing
    from policies.models import PolicyHostKey
    from tests.test_provider_batches import anthropic_batch, drive
    from usage.models import UsageEvent
    from usage.pricing import provider_batch_cost
    from usage.tokens import Tokens

    settings.RELAY_PROVIDER_POLL_SECONDS = 0
    settings.RELAY_PROVIDER_POLL_MAX_SECONDS = 0
    vertex_kind.forget_tokens()
    fake.vertex.job_seconds = 0.6
    host = vertex_host(fake)
    host.save()
    pricing = Pricing.objects.create(
        name="p-vx",
        input_nanos_per_mtok=3_000_000_000,
        output_nanos_per_mtok=15_000_000_000,
        batch_input_nanos_per_mtok=1_000_000_000,
        batch_output_nanos_per_mtok=5_000_000_000,
    )
    model = LLMModel.objects.create(name="vx-haiku", provider="anthropic")
    HostBinding.objects.create(
        model=model, host=host, adapter="anthropic", upstream_name=CLAUDE, pricing=pricing, batch_mode="provider"
    )
    key = HostKey(name="vx-key", host=host)
    key.set_value(fake.vertex.add_service_account("relay-e2e@relay-test.iam.gserviceaccount.com", "relay-test"))
    key.save()
    PolicyHostKey.objects.create(policy=catalog.policy, host_key=key, position=100)
    fake.answer_when("bad one", Reply(status=400, body={"type": "error", "error": {"type": "x", "message": "no"}}))

    def claude(custom_id, content="hello"):
        params = {"model": "vx-haiku", "max_tokens": 64, "messages": [{"role": "user", "content": content}]}
        return {"custom_id": custom_id, "params": params}

    batch = anthropic_batch(catalog, [claude(str(i)) for i in range(5)] + [claude("bad", "bad one")])
    job = ProviderJob.objects.get(batch=batch)
    assert job.kind == "vertex" and job.records == 6
    drive(batch)
    job.refresh_from_db()
    assert job.status == JobStatus.DONE and job.upstream_status == "JOB_STATE_PARTIALLY_SUCCEEDED"
    upstream = fake.vertex.job(job.upstream_id)
    assert upstream.spec["labels"] == {"relay_job": job.id.hex} and len(upstream.records) == 6
    assert json.loads(upstream.records[0])["custom_id"] == job.custom_id(0)
    states = dict(Item.objects.filter(batch=batch).values_list("custom_id", "state"))
    assert states.pop("bad") == "discarded" and set(states.values()) == {"completed"}
    assert Batch.objects.get(pk=batch.pk).status == "completed"
    events = list(UsageEvent.objects.filter(batch_id=str(batch.id)).exclude(input_tokens=0))
    assert len(events) == 5 and {e.executed_by for e in events} == {"provider"}
    for e in events:  # billed at the binding's batch price, what Vertex charges for a batch record
        assert e.cost_nano_usd == provider_batch_cost(pricing, Tokens(input=e.input_tokens, output=e.output_tokens))
