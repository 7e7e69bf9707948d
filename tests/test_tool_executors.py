"""The http and mcp executors against real servers on loopback over HTTPS (throwaway test CA)."""

import gzip
import json
import time

import pytest

from batches.tools import executors
from batches.tools.config import ToolError, parse_tool_config
from tests.tls.servers import Step

pytest_plugins = ["tests.tls.fixtures"]
pytestmark = pytest.mark.usefixtures("loopback_only")

CALLS = [
    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
    {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
]


def http_config(executor, **extra):
    return parse_tool_config({"url": executor.url(), **extra})


def failure(config, calls=CALLS, **kwargs) -> ToolError:
    with pytest.raises(ToolError) as info:
        executors.execute(config, calls, custom_id="rec-1", **kwargs)
    return info.value


# --- http ---------------------------------------------------------------------------------


def test_http_round_trip(executor):
    config = http_config(executor, authorization="Token tools-secret v2", context={"tenant": "acme", "n": [1]})
    messages = executors.execute(config, CALLS, custom_id="rec-1")
    assert messages == [
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny in Paris"},
    ]
    (seen,) = executor.received
    assert seen["body"] == {"custom_id": "rec-1", "context": {"tenant": "acme", "n": [1]}, "tool_calls": CALLS}
    assert seen["headers"]["Authorization"] == "Token tools-secret v2", "sent verbatim, no Bearer added"
    assert seen["headers"]["Host"] == f"localhost:{executor.port}" and seen["sni"] == "localhost"
    assert seen["headers"]["Content-Type"] == "application/json"


def test_http_without_authorization_sends_none(executor):
    executors.execute(http_config(executor), CALLS[:1], custom_id="rec-1")
    assert "Authorization" not in executor.received[-1]["headers"]
    assert executor.received[-1]["body"]["context"] == {}


def test_http_results_in_any_order_come_back_in_call_order(executor):
    executor.script(
        [
            Step(
                body={
                    "results": [{"tool_call_id": "call_2", "content": "B"}, {"tool_call_id": "call_1", "content": "A"}]
                }
            )
        ]
    )
    messages = executors.execute(http_config(executor), CALLS, custom_id="rec-1")
    assert [(m["tool_call_id"], m["content"]) for m in messages] == [("call_1", "A"), ("call_2", "B")]


def test_http_non_string_content_is_sent_as_json_text(executor):
    executor.script(
        [
            Step(
                body={
                    "results": [
                        {"tool_call_id": "call_1", "content": {"temp": 21, "unit": "C"}},
                        {"tool_call_id": "call_2", "content": None},
                    ]
                }
            )
        ]
    )
    messages = executors.execute(http_config(executor), CALLS, custom_id="rec-1")
    assert messages[0]["content"] == '{"temp":21,"unit":"C"}' and messages[1]["content"] == ""


@pytest.mark.parametrize("status", [500, 502, 401, 404])
def test_http_non_2xx_is_an_executor_error(executor, status):
    executor.script([Step(status=status, body={"error": "tool backend down"})])
    err = failure(http_config(executor))
    assert err.code == "tool_executor_error"
    assert f"HTTP {status}" in err.message and "tool backend down" in err.message


def test_http_redirect_is_not_followed(executor):
    executor.script([Step(status=302, body=b"", headers={"Location": executor.url("/elsewhere")})])
    err = failure(http_config(executor))
    assert err.code == "tool_executor_error" and "HTTP 302" in err.message and "not followed" in err.message
    assert [r["path"] for r in executor.received] == ["/tools"]


GARBAGE = [
    (b"<html>oops</html>", "not JSON"),
    (b"", "not JSON"),
    ([{"tool_call_id": "call_1", "content": "x"}], 'expected {"results"'),
    ({"result": []}, 'expected {"results"'),
    ({"results": "done"}, 'expected {"results"'),
    ({"results": ["x", "y"]}, "results[0] must be an object"),
    ({"results": [{"content": "x"}]}, "results[0].tool_call_id must be a string"),
    (
        {"results": [{"tool_call_id": "call_1"}, {"tool_call_id": "call_2", "content": "b"}]},
        "results[0] has no content",
    ),
    ({"results": [{"tool_call_id": "call_1", "content": "a"}]}, "no result for tool call(s) call_2"),
    ({"results": []}, "no result for tool call(s) call_1, call_2"),
    (
        {"results": [{"tool_call_id": "call_1", "content": "a"}, {"tool_call_id": "call_9", "content": "b"}]},
        "'call_9' matches no tool call",
    ),
    (
        {
            "results": [
                {"tool_call_id": "call_1", "content": "a"},
                {"tool_call_id": "call_1", "content": "a"},
                {"tool_call_id": "call_2", "content": "b"},
            ]
        },
        "answers tool call 'call_1' a second time",
    ),
]


@pytest.mark.parametrize("body,fragment", GARBAGE)
def test_http_garbage_answers_are_bad_responses(executor, body, fragment):
    executor.script([Step(body=body)])
    err = failure(http_config(executor))
    assert err.code == "tool_executor_bad_response"
    assert fragment in err.message, err.message


def test_http_answer_size_is_capped(executor):
    executor.script([Step(size=executors.MAX_ANSWER_BYTES + 10)])
    err = failure(http_config(executor))
    assert err.code == "tool_executor_bad_response" and "larger than 1048576 bytes" in err.message


def test_http_compressed_answer_is_refused(executor):
    payload = gzip.compress(json.dumps({"results": [{"tool_call_id": "call_1", "content": "a"}]}).encode())
    executor.script([Step(body=payload, headers={"Content-Encoding": "gzip"})])
    err = failure(http_config(executor), calls=CALLS[:1])
    assert err.code == "tool_executor_bad_response" and "Content-Encoding gzip" in err.message
    assert executor.received[-1]["headers"]["Accept-Encoding"] == "identity"


def test_http_timeout_is_a_total_deadline(executor):
    executor.script([Step(delay=3)])
    started = time.monotonic()
    err = failure(http_config(executor, timeout_ms=300))
    elapsed = time.monotonic() - started
    assert err.code == "tool_executor_timeout" and "timeout_ms=300" in err.message
    assert 0.25 < elapsed < 1.5, elapsed


def test_item_deadline_cuts_the_executor_timeout(executor):
    executor.script([Step(delay=3)])
    started = time.monotonic()
    err = failure(http_config(executor, timeout_ms=60_000), deadline=time.monotonic() + 0.3)
    assert err.code == "tool_executor_timeout" and "item's deadline" in err.message
    assert time.monotonic() - started < 1.5
    err = failure(http_config(executor), deadline=time.monotonic() - 1)
    assert err.code == "tool_executor_timeout" and "before the tool executor could be called" in err.message


def test_cancel_stops_a_running_round(executor):
    executor.script([Step(delay=3)])
    started = time.monotonic()
    err = failure(http_config(executor), cancel=lambda: time.monotonic() - started > 0.3)
    assert err.code == "cancelled"
    assert time.monotonic() - started < 1.5


def test_http_executor_on_loopback_is_blocked_without_the_test_setting(settings, executor):
    settings.RELAY_TOOL_EXECUTOR_TEST_LOOPBACK_CA = ""
    err = failure(http_config(executor))
    assert err.code == "tool_executor_blocked"
    assert "localhost resolves to 127.0.0.1, which is a loopback address" in err.message
    assert executor.received == []


def test_connection_refused_is_an_executor_error(trust_test_ca, executor):
    # A loopback port nothing listens on (the executor's port + nothing): bind-and-close to find one.
    import socket

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    err = failure(parse_tool_config({"url": f"https://127.0.0.1:{port}/tools"}))
    assert err.code == "tool_executor_error" and "could not connect" in err.message


# --- mcp ------------------------------------------------------------------------------------


def mcp_config(server, path="/mcp", **extra):
    return parse_tool_config({"url": server.url(path), "type": "mcp", **extra})


def test_mcp_round_trip(mcp_server):
    config = mcp_config(mcp_server, authorization="Bearer mcp-secret", context={"tenant": "acme"})
    messages = executors.execute(config, CALLS, custom_id="rec-7")
    assert messages == [
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny in Paris"},
    ]
    calls = mcp_server.requests_with_method("tools/call")
    assert [(c["params"]["name"], c["params"]["arguments"]) for c in calls] == [
        ("add", {"a": 2, "b": 3}),
        ("get_weather", {"city": "Paris"}),
    ]
    assert calls[0]["params"]["_meta"] == {"openrelay/custom_id": "rec-7", "openrelay/context": {"tenant": "acme"}}
    assert mcp_server.requests_with_method("initialize"), "a real MCP session was opened"
    assert {r["headers"].get("authorization") for r in mcp_server.received} == {"Bearer mcp-secret"}
    assert {r["headers"].get("host") for r in mcp_server.received} == {f"localhost:{mcp_server.port}"}


def test_mcp_tool_errors_and_bad_arguments_go_back_to_the_model(mcp_server):
    calls = [
        {"id": "a", "type": "function", "function": {"name": "fail", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "add", "arguments": "{not json"}},
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "[1, 2]"}},
        {"id": "d", "type": "function", "function": {"name": "no_such_tool", "arguments": ""}},
    ]
    messages = executors.execute(mcp_config(mcp_server), calls, custom_id="rec-1")
    content = {m["tool_call_id"]: m["content"] for m in messages}
    assert content["a"].startswith("error: ") and "fail" in content["a"]
    assert content["b"].startswith("error: the tool call's arguments are not valid JSON")
    assert content["c"] == "error: the tool call's arguments must be a JSON object; the tool was not called"
    assert content["d"].startswith("error: ") and "no_such_tool" in content["d"]
    names = [c["params"]["name"] for c in mcp_server.requests_with_method("tools/call")]
    assert names == ["fail", "no_such_tool"], "calls with unusable arguments never reach the server"


def test_mcp_timeout(mcp_server):
    calls = [{"id": "s", "type": "function", "function": {"name": "slow", "arguments": '{"seconds": 5}'}}]
    started = time.monotonic()
    err = failure(mcp_config(mcp_server, timeout_ms=400), calls=calls)
    assert err.code == "tool_executor_timeout" and "timeout_ms=400" in err.message
    assert time.monotonic() - started < 2


def test_mcp_server_error(mcp_server):
    err = failure(mcp_config(mcp_server, path="/mcp-broken"))
    assert err.code == "tool_executor_error" and "MCP server error" in err.message


def test_mcp_redirect_is_not_followed(mcp_server):
    err = failure(mcp_config(mcp_server, path="/mcp-redirect"))
    assert err.code == "tool_executor_error" and "not followed" in err.message
    assert [r["path"] for r in mcp_server.received] == ["/mcp-redirect"]


def test_mcp_result_size_is_capped(mcp_server):
    calls = [{"id": "big", "type": "function", "function": {"name": "big", "arguments": '{"size": 1100000}'}}]
    err = failure(mcp_config(mcp_server), calls=calls)
    assert err.code == "tool_executor_bad_response" and "larger than 1048576 bytes" in err.message


def test_mcp_byte_budget_stops_a_flood(mcp_server):
    calls = [{"id": "big", "type": "function", "function": {"name": "big", "arguments": '{"size": 4000000}'}}]
    err = failure(mcp_config(mcp_server), calls=calls)
    assert err.code == "tool_executor_bad_response" and "byte cap" in err.message


def test_mcp_executor_on_loopback_is_blocked_without_the_test_setting(settings, mcp_server):
    settings.RELAY_TOOL_EXECUTOR_TEST_LOOPBACK_CA = ""
    err = failure(mcp_config(mcp_server))
    assert err.code == "tool_executor_blocked" and "loopback" in err.message
    assert mcp_server.received == []
