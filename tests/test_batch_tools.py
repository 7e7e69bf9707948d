"""Tool calling inside OpenAI batch records, end to end: the official openai SDK
→ the relay (live server) → a real Celery worker → the fake model upstream and
a real HTTPS tool executor / MCP server on loopback (test CA)."""

import openai
import pytest

from tests.test_openai_batches import by_custom_id, jsonl, wait_status
from tests.test_tool_loop import QUESTION, final_turn, tool_turn
from tests.tls.servers import Step
from usage.models import UsageEvent

pytest_plugins = ["tests.tls.fixtures"]
pytestmark = pytest.mark.django_db(transaction=True)

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
]


@pytest.fixture(scope="module")
def worker_env(test_pki):
    # TEST-ONLY: the worker may reach executors on loopback, verified with the throwaway CA.
    return {
        "RELAY_TOOL_EXECUTOR_TEST_LOOPBACK_CA": str(test_pki.ca_cert),
        # A provider-mode binding's job polled fast (test_auto_mode_…).
        "RELAY_PROVIDER_POLL_SECONDS": "0.2",
        "RELAY_PROVIDER_POLL_MAX_SECONDS": "0.5",
    }


@pytest.fixture
def sdk(live_server, catalog, worker):
    assert worker.alive(), worker.output()
    with openai.OpenAI(base_url=live_server.url + "/v1", api_key=catalog.key) as client:
        yield client


def record(custom_id, tool_config, **extra):
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "gpt-4o",
            "messages": QUESTION,
            "tools": TOOLS,
            **extra,
            "openrelay": {"tool_config": tool_config},
        },
    }


def run_batch(sdk, records):
    uploaded = sdk.files.create(file=("in.jsonl", jsonl(records)), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    return wait_status(sdk, batch.id)


def test_http_executor_round_trip_inside_a_batch(sdk, fake, executor):
    fake.script("*", [tool_turn(("call_1", "add", {"a": 2, "b": 3})), final_turn()])
    config = {"url": executor.url(), "authorization": "Bearer exec-secret", "context": {"tenant": "t1"}}
    done = run_batch(sdk, [record("r1", config)])
    assert done.status == "completed" and done.request_counts.completed == 1
    line = by_custom_id(sdk, done.output_file_id)["r1"]
    body = line["response"]["body"]
    assert body["choices"][0]["message"]["content"].startswith("2 + 3 = 5")
    assert body["openrelay"] == {"tool_rounds": 1}
    # The executor got the calls, the context and the authorization verbatim.
    (call,) = executor.received
    assert call["headers"]["Authorization"] == "Bearer exec-secret"
    assert call["body"]["custom_id"] == "r1" and call["body"]["context"] == {"tenant": "t1"}
    # The model saw the tool result, and never the relay-owned key.
    second = fake.received[-1]["body"]
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    assert all("openrelay" not in r["body"] for r in fake.received)
    # One usage event per model invocation.
    ids = sorted(UsageEvent.objects.filter(source="batch").values_list("request_id", flat=True))
    assert len(ids) == 2 and ids[1] == ids[0] + ":1"


def test_mcp_executor_inside_a_batch(sdk, fake, mcp_server):
    fake.script("*", [tool_turn(("call_1", "get_weather", {"city": "Paris"})), final_turn()])
    done = run_batch(sdk, [record("m1", {"url": mcp_server.url(), "type": "mcp"})])
    line = by_custom_id(sdk, done.output_file_id)["m1"]
    assert line["response"]["body"]["openrelay"] == {"tool_rounds": 1}
    assert fake.received[-1]["body"]["messages"][-1]["content"] == "sunny in Paris"
    assert len(mcp_server.requests_with_method("tools/call")) == 1


def test_tool_failures_fail_only_their_record_with_a_code(sdk, fake, executor):
    # Both model calls ("broken-executor" and "plain" run concurrently, in either order) get a tool turn.
    fake.script("*", [tool_turn(("call_1", "add", {"a": 1, "b": 1})) for _ in range(2)])
    executor.script([Step(status=500, body={"detail": "boom"})])
    records = [
        record("broken-executor", {"url": executor.url()}),
        record("bad-config", {"url": "http://plain-http.example/tools"}),
        {
            **record("moved", {"url": executor.url()}),
            "body": {"model": "gpt-4o", "messages": QUESTION, "tool_config": {"url": executor.url()}},
        },
        {
            "custom_id": "plain",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o", "messages": QUESTION},
        },
    ]
    done = run_batch(sdk, records)
    assert done.status == "completed"
    assert done.request_counts.completed == 1 and done.request_counts.failed == 3
    errors = by_custom_id(sdk, done.error_file_id)
    assert errors["broken-executor"]["error"]["code"] == "tool_executor_error"
    assert errors["bad-config"]["error"]["code"] == "invalid_tool_config"
    assert errors["moved"]["error"]["code"] == "tool_config_moved"
    outputs = by_custom_id(sdk, done.output_file_id)
    assert set(outputs) == {"plain"} and "openrelay" not in outputs["plain"]["response"]["body"]
    # A failed tool round still bills the model invocation it made.
    assert UsageEvent.objects.filter(error_kind="tool_executor_error").count() == 1


def test_auto_mode_runs_tool_calling_records_in_the_relay_and_the_rest_at_the_provider(sdk, fake, executor):
    """A mixed batch on an `auto` binding: plain records go to the provider's batch API (half price), the
    tool-calling one runs in the relay, which must sit between its model turns; every record finishes."""
    from batches.models import Item
    from batches.provider.models import ProviderJob
    from core.models import HostBinding

    HostBinding.objects.filter(model__name="gpt-4o").update(batch_mode="auto")
    fake.batches.job_seconds = 0.5
    fake.script("*", [tool_turn(("call_1", "add", {"a": 2, "b": 3})), final_turn()])
    plain = [
        {
            "custom_id": f"p{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": f"plain {i}"}]},
        }
        for i in range(3)
    ]
    done = run_batch(sdk, [record("tool", {"url": executor.url()}), *plain])
    assert done.status == "completed" and done.request_counts.completed == 4, done
    lines = by_custom_id(sdk, done.output_file_id)
    assert lines["tool"]["response"]["body"]["choices"][0]["message"]["content"].startswith("2 + 3 = 5")
    assert all(lines[f"p{i}"]["response"]["status_code"] == 200 for i in range(3))
    where = dict(Item.objects.values_list("custom_id", "placement"))
    assert where["tool"] == "tool_config"
    (job,) = ProviderJob.objects.all()
    assert job.records == 3 and job.status == "done"
    ran = dict(UsageEvent.objects.filter(source="batch").values_list("request_id", "executed_by"))
    assert sorted(ran.values()) == ["provider", "provider", "provider", "relay", "relay"]  # the tool record: 2 turns
