"""`body.openrelay.tool_config`: validation, defaults and clamps, the moved spelling, stripping."""

import copy

import pytest

from batches.tools import config
from batches.tools.config import ToolConfig, ToolError, extract, parse_tool_config, strip_openrelay

URL = "https://tools.example.com/run"


def body_with(tool_config, **extra) -> dict:
    return {
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": "hi"}],
        "openrelay": {"tool_config": tool_config},
        **extra,
    }


def invalid(raw) -> ToolError:
    with pytest.raises(ToolError) as info:
        parse_tool_config(raw)
    assert info.value.code == "invalid_tool_config"
    return info.value


# --- defaults and clamps -------------------------------------------------------------


def test_minimal_config_takes_every_default():
    cfg = parse_tool_config({"url": URL})
    assert cfg == ToolConfig(url=URL, type="http", authorization=None, context={}, max_rounds=8, timeout_ms=30_000)
    assert cfg.timeout_seconds == 30.0


def test_full_config():
    raw = {
        "url": URL,
        "type": "mcp",
        "authorization": "Bearer sk-tools",
        "context": {"tenant": "acme", "nested": {"a": [1, 2]}},
        "max_rounds": 3,
        "timeout_ms": 1500,
    }
    cfg = parse_tool_config(raw)
    assert (cfg.type, cfg.authorization, cfg.context, cfg.max_rounds, cfg.timeout_ms) == (
        "mcp",
        "Bearer sk-tools",
        {"tenant": "acme", "nested": {"a": [1, 2]}},
        3,
        1500,
    )


@pytest.mark.parametrize(
    "value,expected",
    [(None, 8), (0, 8), (1, 1), (8, 8), (16, 16), (17, 16), (1000, 16), (5.0, 5)],
)
def test_max_rounds_default_and_clamp(value, expected):
    raw = {"url": URL} if value is None else {"url": URL, "max_rounds": value}
    assert parse_tool_config(raw).max_rounds == expected


@pytest.mark.parametrize(
    "value,expected",
    [(None, 30_000), (0, 30_000), (1, 1), (30_000, 30_000), (120_000, 120_000), (120_001, 120_000), (10**9, 120_000)],
)
def test_timeout_ms_default_and_clamp(value, expected):
    raw = {"url": URL} if value is None else {"url": URL, "timeout_ms": value}
    assert parse_tool_config(raw).timeout_ms == expected


# --- malformed values, field by field ------------------------------------------------------


@pytest.mark.parametrize(
    "raw,fragment",
    [
        ("https://x.example", "must be an object, got a string"),
        ([URL], "must be an object, got an array"),
        ({}, "url is required"),
        ({"url": ""}, "url is required"),
        ({"url": 42}, "url must be a string, got a number"),
        ({"url": "http://tools.example.com/run"}, "must use https"),
        ({"url": "ftp://tools.example.com/run"}, "must use https"),
        ({"url": "tools.example.com/run"}, "must use https"),
        ({"url": "https://"}, "has no host"),
        ({"url": "https://user:pw@tools.example.com/"}, "must not contain user info"),
        ({"url": "https://tools.example.com:99999/"}, "invalid port 99999"),
        ({"url": "https://" + "a" * 2100 + ".example/"}, "longer than 2048"),
        ({"url": URL, "type": "grpc"}, "type must be one of http, mcp"),
        ({"url": URL, "type": 1}, "type must be one of http, mcp"),
        ({"url": URL, "authorization": 123}, "authorization must be a string, got a number"),
        ({"url": URL, "authorization": "Bearer a\r\nX-Evil: 1"}, "must not contain CR, LF"),
        ({"url": URL, "authorization": "Bearer ü"}, "must be ASCII"),
        ({"url": URL, "authorization": "x" * 9000}, "longer than 8192"),
        ({"url": URL, "context": "tenant=acme"}, "context must be a JSON object, got a string"),
        ({"url": URL, "context": [1, 2]}, "context must be a JSON object, got an array"),
        ({"url": URL, "max_rounds": -1}, "max_rounds must be a non-negative integer, got -1"),
        ({"url": URL, "max_rounds": 2.5}, "max_rounds must be a non-negative integer, got 2.5"),
        ({"url": URL, "max_rounds": "3"}, "max_rounds must be a non-negative integer, got a string"),
        ({"url": URL, "max_rounds": True}, "max_rounds must be a non-negative integer, got a boolean"),
        ({"url": URL, "timeout_ms": -5}, "timeout_ms must be a non-negative integer, got -5"),
        ({"url": URL, "timeout_ms": 0.5}, "timeout_ms must be a non-negative integer, got 0.5"),
        ({"url": URL, "timeout_ms": "1000"}, "timeout_ms must be a non-negative integer, got a string"),
        ({"url": URL, "timeout_ms": [1]}, "timeout_ms must be a non-negative integer, got an array"),
        ({"url": URL, "max_round": 3}, "unknown field(s) max_round"),
    ],
)
def test_malformed_tool_config(raw, fragment):
    err = invalid(raw)
    assert fragment in err.message, err.message
    assert err.message.startswith("openrelay.tool_config: ")


def test_empty_authorization_sends_no_header():
    assert parse_tool_config({"url": URL, "authorization": ""}).authorization is None


def test_null_context_is_empty():
    assert parse_tool_config({"url": URL, "context": None}).context == {}


# --- extract: the moved spelling, the openrelay namespace, stripping -----------------------------


def test_extract_without_extension_is_the_body_itself():
    body = {"model": "gpt-4o", "messages": []}
    stripped, cfg = extract(body)
    assert stripped == body and cfg is None


def test_extract_returns_config_and_a_stripped_copy():
    body = body_with({"url": URL, "max_rounds": 2})
    before = copy.deepcopy(body)
    stripped, cfg = extract(body)
    assert cfg.max_rounds == 2 and cfg.url == URL
    assert "openrelay" not in stripped and stripped["messages"] == body["messages"]
    assert body == before, "the caller's body must not be mutated"


@pytest.mark.parametrize(
    "body",
    [
        {"model": "gpt-4o", "messages": [], "tool_config": {"url": URL}},
        {"model": "gpt-4o", "messages": [], "tool_config": None},
        {"model": "gpt-4o", "messages": [], "tool_config": {"url": URL}, "openrelay": {"tool_config": {"url": URL}}},
    ],
    ids=["bare", "bare-null", "bare-next-to-the-new-spelling"],
)
def test_bare_tool_config_is_moved(body):
    with pytest.raises(ToolError) as info:
        extract(body)
    assert info.value.code == "tool_config_moved"
    assert "body.openrelay.tool_config" in info.value.message


@pytest.mark.parametrize(
    "openrelay,fragment",
    [("tools", "openrelay must be an object, got a string"), ([1], "openrelay must be an object, got an array")],
)
def test_openrelay_must_be_an_object(openrelay, fragment):
    with pytest.raises(ToolError) as info:
        extract({"model": "gpt-4o", "messages": [], "openrelay": openrelay})
    assert info.value.code == "invalid_tool_config" and fragment in info.value.message


def test_openrelay_without_tool_config_is_stripped_and_ignored():
    for openrelay in ({}, None, {"tool_config": None}, {"some_future_extension": {"x": 1}}):
        stripped, cfg = extract({"model": "gpt-4o", "messages": [], "openrelay": openrelay})
        assert cfg is None and "openrelay" not in stripped


def test_malformed_nested_config_through_extract():
    with pytest.raises(ToolError) as info:
        extract(body_with({"url": URL, "timeout_ms": -1}))
    assert info.value.code == "invalid_tool_config" and "timeout_ms" in info.value.message


def test_strip_openrelay_copies():
    body = {"model": "m", "openrelay": {"tool_config": {"url": URL}}, "messages": [{"role": "user", "content": "x"}]}
    stripped = strip_openrelay(body)
    assert stripped == {"model": "m", "messages": body["messages"]}
    assert "openrelay" in body, "the original keeps its key"
    assert strip_openrelay({"model": "m"}) == {"model": "m"}


def test_codes_are_the_documented_ones():
    assert {
        config.INVALID_TOOL_CONFIG,
        config.TOOL_CONFIG_MOVED,
        config.TOOL_EXECUTOR_TIMEOUT,
        config.TOOL_EXECUTOR_ERROR,
        config.TOOL_EXECUTOR_BAD_RESPONSE,
        config.TOOL_EXECUTOR_BLOCKED,
        config.TOOL_ROUNDS_EXHAUSTED,
        config.INVALID_TOOL_CALLS,
    } == {
        "invalid_tool_config",
        "tool_config_moved",
        "tool_executor_timeout",
        "tool_executor_error",
        "tool_executor_bad_response",
        "tool_executor_blocked",
        "tool_rounds_exhausted",
        "invalid_tool_calls",
    }
