"""`run_tool_loop` end to end: gateway.pipeline.dispatch for every model invocation (fake upstream on
loopback, real routing, limits, key pool and usage events) and real HTTPS / MCP executors."""

import copy
import json
import time
from types import SimpleNamespace

import pytest

from batches.tools import run_tool_loop
from batches.tools.config import parse_tool_config
from core import auth
from devkit.upstream import Reply
from gateway import pipeline
from tests.tls.servers import Step
from usage.models import UsageEvent
from usage.services import record_event

pytest_plugins = ["tests.tls.fixtures"]
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("loopback_only")]

ITEM = "0192f0c4-5d6e-7a8b-9c0d-1e2f3a4b5c6d"
QUESTION = [{"role": "user", "content": "What is 2 + 3, and the weather in Paris?"}]


def tool_turn(*calls, prompt=10, completion=5) -> Reply:
    """A chat completion whose turn ends asking for tools."""
    tool_calls = [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for call_id, name, args in calls
    ]
    return Reply(
        body={
            "id": "chatcmpl-tools",
            "object": "chat.completion",
            "model": "gpt-4o-2024-08-06",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": None, "tool_calls": tool_calls, "refusal": None},
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }
    )


def final_turn(text="2 + 3 = 5 and it is sunny in Paris.", prompt=30, completion=12) -> Reply:
    return Reply(
        body={
            "id": "chatcmpl-final",
            "object": "chat.completion",
            "model": "gpt-4o-2024-08-06",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        }
    )


@pytest.fixture
def principal(catalog):
    """The batch's stored principal, as the item runner has it (authenticated with the catalog's relay key)."""
    return auth.authenticate(SimpleNamespace(headers={"Authorization": f"Bearer {catalog.key}"}))


@pytest.fixture
def invoke(principal):
    """What the item runner will pass: one pipeline.dispatch per invocation, each with its own request_id."""
    request_ids = []

    def invoke(body: dict, round_no: int) -> pipeline.Outcome:
        request_id = ITEM if round_no == 0 else f"{ITEM}:{round_no}"
        request_ids.append(request_id)
        return pipeline.dispatch(
            pipeline.Call(
                path="/v1/chat/completions",
                body=body,
                principal=principal,
                source="batch",
                request_id=request_id,
                deadline=time.monotonic() + 30,
                batch_id="batch_test",
                required_adapter="openai",
            )
        )

    invoke.request_ids = request_ids
    return invoke


def record_with(tool_config: dict, **extra) -> dict:
    return {"model": "gpt-4o", "messages": copy.deepcopy(QUESTION), "openrelay": {"tool_config": tool_config}, **extra}


def body_json(outcome) -> dict:
    return json.loads(outcome.body)


# --- multi-round conversations ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["http", "mcp"])
def test_two_tool_rounds_then_an_answer(fake, executor, mcp_server, invoke, kind):
    fake.script(
        "*",
        [
            tool_turn(("call_a", "add", {"a": 2, "b": 3})),
            tool_turn(("call_w", "get_weather", {"city": "Paris"}), ("call_b", "add", {"a": 1, "b": 1}), prompt=20),
            final_turn(),
        ],
    )
    url = executor.url() if kind == "http" else mcp_server.url()
    record = record_with(
        {"url": url, "type": kind, "authorization": "Bearer exec-key", "context": {"user": "u-1"}, "max_rounds": 4}
    )
    before = copy.deepcopy(record)

    result = run_tool_loop(record, None, "req-42", invoke)

    assert result.ok and result.error is None and result.code == ""
    assert result.tool_rounds == 2 and len(result.invocations) == 3
    assert record == before, "the record body is never mutated"

    # What the model saw, turn by turn: never `openrelay`, each turn the whole conversation so far.
    sent = [r["body"] for r in fake.received]
    assert len(sent) == 3 and all("openrelay" not in body and "tool_config" not in body for body in sent)
    assert all(body["model"] == "gpt-4o-2024-08-06" for body in sent)
    assert sent[0]["messages"] == QUESTION
    first_assistant = tool_turn(("call_a", "add", {"a": 2, "b": 3})).body["choices"][0]["message"]
    assert sent[1]["messages"] == [
        *QUESTION,
        first_assistant,  # as returned, content null and all
        {"role": "tool", "tool_call_id": "call_a", "content": "5"},
    ]
    assert sent[2]["messages"][:3] == sent[1]["messages"]
    assert sent[2]["messages"][3]["tool_calls"][0]["id"] == "call_w"
    assert sent[2]["messages"][4:] == [
        {"role": "tool", "tool_call_id": "call_w", "content": "sunny in Paris"},
        {"role": "tool", "tool_call_id": "call_b", "content": "2"},
    ]

    # The final answer carries openrelay.tool_rounds and the usage of all three invocations.
    final = body_json(result.outcome)
    assert final["openrelay"] == {"tool_rounds": 2}
    assert final["choices"][0]["message"]["content"] == "2 + 3 = 5 and it is sunny in Paris."
    assert final["usage"] == {
        "prompt_tokens": 10 + 20 + 30,
        "completion_tokens": 5 + 5 + 12,
        "total_tokens": 15 + 25 + 42,
        "prompt_tokens_details": {"cached_tokens": 4},
    }

    # Each invocation has its own usage event; recorded as the item runner will, they sum to the totals.
    assert invoke.request_ids == [ITEM, f"{ITEM}:1", f"{ITEM}:2"]
    for outcome in result.invocations:
        record_event(**outcome.event)
    events = UsageEvent.objects.order_by("request_id")
    assert [e.request_id for e in events] == [ITEM, f"{ITEM}:1", f"{ITEM}:2"]
    assert all(e.source == "batch" and e.status == 200 and e.batch_id == "batch_test" for e in events)
    totals = result.totals
    assert totals["invocations"] == 3 and totals["tool_rounds"] == 2
    assert totals["input_tokens"] == sum(e.input_tokens for e in events) == 56  # 60 prompt - 4 cached
    assert totals["cache_read_tokens"] == 4 and totals["output_tokens"] == 22
    assert totals["cost_nano_usd"] == sum(e.cost_nano_usd for e in events) > 0

    # The executor heard both rounds, with the record's custom_id, context and authorization.
    if kind == "http":
        assert [r["body"]["custom_id"] for r in executor.received] == ["req-42", "req-42"]
        assert [[c["id"] for c in r["body"]["tool_calls"]] for r in executor.received] == [
            ["call_a"],
            ["call_w", "call_b"],
        ]
        assert all(r["body"]["context"] == {"user": "u-1"} for r in executor.received)
        assert {r["headers"]["Authorization"] for r in executor.received} == {"Bearer exec-key"}
    else:
        calls = mcp_server.requests_with_method("tools/call")
        assert [c["params"]["name"] for c in calls] == ["add", "get_weather", "add"]
        assert {r["headers"]["authorization"] for r in mcp_server.received} == {"Bearer exec-key"}


def test_an_answer_without_tool_calls_is_final_at_once(fake, executor, invoke):
    fake.script("*", [final_turn("no tools needed")])
    result = run_tool_loop(record_with({"url": executor.url()}), None, "r", invoke)
    assert result.ok and result.tool_rounds == 0 and len(result.invocations) == 1
    final = body_json(result.outcome)
    assert final["openrelay"] == {"tool_rounds": 0}
    assert final["usage"]["prompt_tokens"] == 30, "one invocation: usage as the upstream reported it"
    assert executor.received == []


def test_a_parsed_config_argument_wins_and_the_body_is_still_stripped(fake, executor, invoke):
    fake.script("*", [tool_turn(("c1", "add", {"a": 1, "b": 2})), final_turn()])
    record = record_with({"url": "https://never-used.example/"})
    result = run_tool_loop(record, parse_tool_config({"url": executor.url()}), "r", invoke)
    assert result.ok and result.tool_rounds == 1
    assert all("openrelay" not in r["body"] for r in fake.received)


def test_records_without_tool_config_are_one_plain_invocation(fake, invoke):
    fake.script("*", [tool_turn(("c1", "add", {"a": 1, "b": 2}))])
    record = {"model": "gpt-4o", "messages": QUESTION, "openrelay": {}}
    result = run_tool_loop(record, None, "r", invoke)
    assert result.ok and result.tool_rounds == 0 and len(result.invocations) == 1
    # Client-side tools stay client-side: the tool_calls answer is returned untouched.
    assert body_json(result.outcome)["choices"][0]["finish_reason"] == "tool_calls"
    assert "openrelay" not in body_json(result.outcome)
    assert "openrelay" not in fake.received[0]["body"]


# --- limits ---------------------------------------------------------------------------------------


def test_round_exhaustion(fake, executor, invoke):
    fake.script("*", [tool_turn((f"c{i}", "add", {"a": i, "b": 1})) for i in range(5)])
    result = run_tool_loop(record_with({"url": executor.url(), "max_rounds": 2}), None, "r", invoke)
    assert not result.ok and result.code == "tool_rounds_exhausted"
    assert "after 2 tool round(s)" in result.error.message and "max_rounds=2" in result.error.message
    assert len(result.invocations) == 3, "max_rounds + 1 invocations at most"
    assert len(executor.received) == 2 and len(fake.received) == 3
    assert result.outcome is result.invocations[-1], "the last answer is kept for the error record"


def test_max_rounds_above_16_is_clamped_to_16(fake, executor, invoke):
    fake.script("*", [tool_turn((f"c{i}", "add", {"a": i, "b": 0})) for i in range(20)])
    result = run_tool_loop(record_with({"url": executor.url(), "max_rounds": 50}), None, "r", invoke)
    assert result.code == "tool_rounds_exhausted" and "max_rounds=16" in result.error.message
    assert len(result.invocations) == 17 and len(executor.received) == 16


def test_max_rounds_zero_takes_the_default_of_8(fake, executor, invoke):
    fake.script("*", [tool_turn((f"c{i}", "add", {"a": i, "b": 0})) for i in range(10)])
    result = run_tool_loop(record_with({"url": executor.url(), "max_rounds": 0}), None, "r", invoke)
    assert result.code == "tool_rounds_exhausted" and len(result.invocations) == 9


def test_timeout_ms_is_clamped_and_enforced(fake, executor, invoke):
    assert parse_tool_config({"url": executor.url(), "timeout_ms": 999_999}).timeout_ms == 120_000
    assert parse_tool_config({"url": executor.url(), "timeout_ms": 0}).timeout_ms == 30_000
    fake.script("*", [tool_turn(("c1", "add", {"a": 1, "b": 2}))])
    executor.script([Step(delay=3)])
    started = time.monotonic()
    result = run_tool_loop(record_with({"url": executor.url(), "timeout_ms": 300}), None, "r", invoke)
    assert result.code == "tool_executor_timeout" and "timeout_ms=300" in result.error.message
    assert time.monotonic() - started < 2
    assert len(result.invocations) == 1


# --- executor failures --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "step,code",
    [
        (Step(status=500, body={"error": "boom"}), "tool_executor_error"),
        (Step(status=503, body=b"unavailable"), "tool_executor_error"),
        (Step(body=b"not json at all"), "tool_executor_bad_response"),
        (Step(body={"results": [{"tool_call_id": "someone-else", "content": "x"}]}), "tool_executor_bad_response"),
        (Step(body={"output": "5"}), "tool_executor_bad_response"),
    ],
)
def test_executor_failures_fail_the_record(fake, executor, invoke, step, code):
    fake.script("*", [tool_turn(("c1", "add", {"a": 1, "b": 2})), final_turn()])
    executor.script([step])
    result = run_tool_loop(record_with({"url": executor.url()}), None, "r", invoke)
    assert not result.ok and result.code == code
    assert len(result.invocations) == 1 and len(fake.received) == 1, "no invocation after a failed round"


def test_mcp_executor_failure(fake, mcp_server, invoke):
    fake.script("*", [tool_turn(("c1", "add", {"a": 1, "b": 2}))])
    result = run_tool_loop(record_with({"url": mcp_server.url("/mcp-broken"), "type": "mcp"}), None, "r", invoke)
    assert result.code == "tool_executor_error" and "MCP server error" in result.error.message


def test_blocked_executor_address(fake, invoke):
    fake.script("*", [tool_turn(("c1", "add", {"a": 1, "b": 2}))])
    result = run_tool_loop(record_with({"url": "https://169.254.169.254/latest/meta-data/"}), None, "r", invoke)
    assert result.code == "tool_executor_blocked" and "metadata" in result.error.message


def test_unusable_tool_calls(fake, executor, invoke):
    broken = tool_turn(("c1", "add", {"a": 1, "b": 2}))
    del broken.body["choices"][0]["message"]["tool_calls"][0]["id"]
    fake.script("*", [broken])
    result = run_tool_loop(record_with({"url": executor.url()}), None, "r", invoke)
    assert result.code == "invalid_tool_calls" and "tool_calls[0] has no id" in result.error.message
    assert executor.received == []


# --- model failures pass through ------------------------------------------------------------------------


def test_a_failed_invocation_fails_the_record_with_its_outcome(fake, executor, invoke):
    error = {"error": {"message": "context length exceeded", "type": "invalid_request_error"}}
    fake.script("*", [tool_turn(("c1", "add", {"a": 1, "b": 2})), Reply(status=400, body=error)])
    result = run_tool_loop(record_with({"url": executor.url()}), None, "r", invoke)
    assert not result.ok and result.error is None and result.code == "upstream_error"
    assert result.outcome.status == 400 and body_json(result.outcome) == error
    assert result.tool_rounds == 1 and len(result.invocations) == 2
    assert result.invocations[1].event["status"] == 400


def test_a_relay_refusal_passes_through(fake, executor, invoke):
    record = record_with({"url": executor.url()})
    record["model"] = "no-such-model"
    result = run_tool_loop(record, None, "r", invoke)
    assert not result.ok and result.code == "model_not_found" and result.outcome.status == 404
    assert fake.received == []


# --- configuration failures: no invocation at all ------------------------------------------------------


@pytest.mark.parametrize(
    "record,code,fragment",
    [
        (
            {"model": "gpt-4o", "messages": QUESTION, "tool_config": {"url": "https://x.example"}},
            "tool_config_moved",
            "",
        ),
        (record_with({"url": "http://tools.example.com"}), "invalid_tool_config", "must use https"),
        (record_with({"type": "http"}), "invalid_tool_config", "url is required"),
        (record_with({"url": "https://t.example", "type": "soap"}), "invalid_tool_config", "type must be one of"),
        (record_with({"url": "https://t.example", "authorization": 7}), "invalid_tool_config", "authorization"),
        (record_with({"url": "https://t.example", "context": "x"}), "invalid_tool_config", "context"),
        (record_with({"url": "https://t.example", "max_rounds": -2}), "invalid_tool_config", "max_rounds"),
        (record_with({"url": "https://t.example", "timeout_ms": 1.5}), "invalid_tool_config", "timeout_ms"),
        (record_with("https://t.example"), "invalid_tool_config", "must be an object"),
        (
            {"model": "gpt-4o", "openrelay": {"tool_config": {"url": "https://t.example"}}},
            "invalid_tool_config",
            "messages",
        ),
    ],
)
def test_config_failures_never_invoke_the_model(fake, invoke, record, code, fragment):
    result = run_tool_loop(record, None, "r", invoke)
    assert not result.ok and result.code == code and fragment in result.error.message
    assert result.outcome is None and result.invocations == [] and fake.received == []


def test_cancel_between_rounds(fake, executor, invoke):
    fake.script("*", [tool_turn(("c1", "add", {"a": 1, "b": 2}))])
    result = run_tool_loop(record_with({"url": executor.url()}), None, "r", invoke, cancel=lambda: True)
    assert result.code == "cancelled" and len(result.invocations) == 1 and executor.received == []
