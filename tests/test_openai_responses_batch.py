"""An OpenAI-surface batch on `/v1/responses`, through the official `openai` SDK against the live server and a
real worker: its records route like a live `/v1/responses` call (an `openai_responses` binding)."""

import json

import openai
import pytest

from batches.models import Batch
from tests.workers import wait_for
from usage.models import UsageEvent

pytestmark = pytest.mark.django_db(transaction=True)


def record(custom_id, text, model="gpt-resp"):
    body = {"model": model, "input": text}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body}


def test_sdk_batch_on_the_responses_endpoint(live_server, catalog, fake, worker):
    assert worker.alive(), worker.output()
    records = [
        record("r-1", "what is a relay"),
        record("r-2", "name a prime"),
        record("r-3", "x", model="claude-sonnet"),
    ]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    with openai.OpenAI(base_url=live_server.url + "/v1", api_key=catalog.key) as client:
        uploaded = client.files.create(file=("responses.jsonl", data), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h")
        assert batch.endpoint == "/v1/responses" and batch.status == "validating"

        def done():
            b = client.batches.retrieve(batch.id)
            return b if b.status in ("completed", "failed", "expired", "cancelled") else None

        finished = wait_for(done, 30, what="the responses batch to finish")
        assert finished.status == "completed", finished
        assert finished.request_counts.completed == 2 and finished.request_counts.failed == 1
        output = [json.loads(line) for line in client.files.content(finished.output_file_id).text.splitlines()]
        errors = [json.loads(line) for line in client.files.content(finished.error_file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in output}
    assert set(by_id) == {"r-1", "r-2"}
    body = by_id["r-1"]["response"]["body"]
    assert body["object"] == "response" and "what is a relay" in body["output"][0]["content"][0]["text"]
    # A model served by another shape's binding fails as a live /v1/responses call would.
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("r-3", "cross_shape_dispatch")]
    sent = [r for r in fake.received if r["path"] == "/v1/responses"]
    assert len(sent) == 2 and {r["body"]["model"] for r in sent} == {"gpt-4.1"}  # the binding's upstream_name
    assert Batch.objects.get().inbound_shape == "openai_responses"
    assert UsageEvent.objects.filter(batch_id=str(Batch.objects.get().pk)).count() == 3
