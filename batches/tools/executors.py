"""Tool executors: run one round of a model's tool calls where the record's `tool_config` says.

`execute(config, tool_calls, custom_id=...)` returns one `tool` message per
call, in the model's order, or raises ToolError with the record's failure code.

- `http`: one `POST url` with `{custom_id, context, tool_calls}` (the calls as
  the model returned them) and `authorization` verbatim as the Authorization
  header; the answer must be `{results: [{tool_call_id, content}]}` covering
  every call exactly once.
- `mcp`: a Model Context Protocol server over Streamable HTTP, through the
  maintained `mcp` client (ClientSession): initialize, then one `tools/call`
  per tool call (name = function.name, arguments = the parsed
  function.arguments, `_meta` = {openrelay/custom_id, openrelay/context}), one
  after the other, in the model's order. The text content of each result
  becomes the tool message.

Both connect through `netguard` (public addresses only, DNS resolved once per
round and pinned, no redirects, no proxies, size caps). `timeout_ms` is a total
deadline for the round, resolution included; the item's own deadline and its
cancel flag cut it shorter. Each round runs in its own short event loop
(`anyio.run`), so callers stay synchronous, like the rest of the item runner.
"""

import json
import time
from collections.abc import Callable

import anyio
import httpx2
from mcp import types as mcp_types
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from batches.tools import netguard
from batches.tools.config import (
    TOOL_EXECUTOR_BAD_RESPONSE,
    TOOL_EXECUTOR_BLOCKED,
    TOOL_EXECUTOR_ERROR,
    TOOL_EXECUTOR_TIMEOUT,
    TOOL_LOOP_CANCELLED,
    ToolConfig,
    ToolError,
)
from core.errors import quoted

MiB = 1024 * 1024
# The largest answer an executor may send for one round (http), or per tool call (mcp).
MAX_ANSWER_BYTES = 1 * MiB
# MCP reads more than the tool results: initialize, tools/list, SSE framing, and results that carry
# their text twice (content and structured_content). So the wire allowance is wider than the text cap.
MCP_SESSION_ALLOWANCE_BYTES = 1 * MiB
MCP_WIRE_BYTES_PER_CALL = 2 * MAX_ANSWER_BYTES
_ERROR_SNIPPET = 300
_CANCEL_POLL_SECONDS = 0.2
_MCP_CLIENT_INFO = mcp_types.Implementation(name="relay-batch-tool-loop", version="1")


def execute(
    config: ToolConfig,
    tool_calls: list[dict],
    *,
    custom_id: str,
    deadline: float | None = None,
    cancel: Callable[[], bool] | None = None,
) -> list[dict]:
    """Run one round of `tool_calls`; return `[{"role": "tool", "tool_call_id", "content"}]` in call order.

    `deadline` is a time.monotonic() value (the item's), `cancel` a callback
    polled while waiting. Raises ToolError.
    """
    timeout = config.timeout_seconds
    cut_by_item = False
    if deadline is not None:
        left = deadline - time.monotonic()
        if left < timeout:
            timeout, cut_by_item = left, True
    if timeout <= 0:
        raise ToolError(TOOL_EXECUTOR_TIMEOUT, "the item's deadline passed before the tool executor could be called")
    round_fn = _http_round if config.type == "http" else _mcp_round
    return anyio.run(_guarded, round_fn, config, tool_calls, custom_id, timeout, cut_by_item, cancel)


async def _guarded(round_fn, config, tool_calls, custom_id, timeout, cut_by_item, cancel) -> list[dict]:
    """Run `round_fn` under the total deadline and the cancel flag; turn every failure into a ToolError."""
    box: dict = {}
    state = {"cancelled": False, "cut_by_item": cut_by_item}
    try:
        with anyio.fail_after(timeout):
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    try:
                        box["result"] = await round_fn(config, tool_calls, custom_id, timeout, state)
                    except Exception as exc:  # reported below, after the task group has closed
                        box["error"] = exc
                    finally:
                        tg.cancel_scope.cancel()  # stops the cancel watcher

                tg.start_soon(run)
                if cancel is not None:
                    tg.start_soon(_watch_cancel, cancel, tg.cancel_scope, state)
    except TimeoutError:
        raise _timeout_error(config, cut_by_item) from None
    if state["cancelled"]:
        raise ToolError(TOOL_LOOP_CANCELLED, "cancelled while the tool executor was running")
    if "error" in box:
        raise _as_tool_error(box["error"], config, state) from box["error"]
    return box["result"]


async def _watch_cancel(cancel: Callable[[], bool], scope: anyio.CancelScope, state: dict) -> None:
    while True:
        await anyio.sleep(_CANCEL_POLL_SECONDS)
        if cancel():
            state["cancelled"] = True
            scope.cancel()
            return


def _timeout_error(config: ToolConfig, cut_by_item: bool) -> ToolError:
    if cut_by_item:
        return ToolError(TOOL_EXECUTOR_TIMEOUT, "the item's deadline passed while the tool executor was running")
    return ToolError(TOOL_EXECUTOR_TIMEOUT, f"the tool executor did not finish within timeout_ms={config.timeout_ms}")


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        out = []
        for inner in exc.exceptions:
            out.extend(_leaves(inner))
        return out
    return [exc]


def _as_tool_error(exc: BaseException, config: ToolConfig, state: dict) -> ToolError:
    """The one most telling failure among `exc` and, for exception groups, its leaves."""
    leaves = _leaves(exc)
    budget = state.get("budget")
    for leaf in leaves:
        if isinstance(leaf, ToolError):
            return leaf
    for leaf in leaves:
        if isinstance(leaf, netguard.Blocked):
            return ToolError(TOOL_EXECUTOR_BLOCKED, f"tool executor url refused: {leaf.message}")
        if isinstance(leaf, netguard.Unresolvable):
            return ToolError(TOOL_EXECUTOR_ERROR, f"tool executor {leaf.message}")
    if budget is not None and budget.exceeded:
        return ToolError(TOOL_EXECUTOR_BAD_RESPONSE, f"the tool executor's answer exceeds the {budget.limit}-byte cap")
    for leaf in leaves:
        if isinstance(leaf, netguard.CompressedAnswer):
            return ToolError(TOOL_EXECUTOR_BAD_RESPONSE, str(leaf))
    for leaf in leaves:
        if isinstance(leaf, httpx2.TimeoutException | TimeoutError):
            return _timeout_error(config, state["cut_by_item"])
    for leaf in leaves:
        if isinstance(leaf, MCPError):
            return ToolError(TOOL_EXECUTOR_ERROR, f"MCP server error {leaf.code}: {leaf.message}"[:_ERROR_SNIPPET])
    first = leaves[0] if leaves else exc
    return ToolError(TOOL_EXECUTOR_ERROR, f"tool executor call failed: {_describe(first)}"[: _ERROR_SNIPPET * 2])


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _bad(message: str) -> ToolError:
    return ToolError(TOOL_EXECUTOR_BAD_RESPONSE, f"tool executor answer: {message}")


def _content_text(value) -> str:
    """Tool message content: a string as is, any other JSON value as its JSON text."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _call_ids(tool_calls: list[dict]) -> list[str]:
    return [call["id"] for call in tool_calls]


async def _resolve(config: ToolConfig) -> netguard.Pin:
    # getaddrinfo blocks; run it off the loop so the round's deadline also bounds a slow resolver.
    return await anyio.to_thread.run_sync(netguard.resolve, config.url, abandon_on_cancel=True)


# --- http ---------------------------------------------------------------------------


async def _http_round(config: ToolConfig, tool_calls: list[dict], custom_id: str, timeout: float, state: dict):
    pin = await _resolve(config)
    payload = json.dumps({"custom_id": custom_id, "context": config.context, "tool_calls": tool_calls}).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if config.authorization is not None:
        headers["Authorization"] = config.authorization
    client, budget = netguard.pinned_client(
        pin, timeout=timeout, max_bytes=MAX_ANSWER_BYTES + netguard.MAX_HEADER_BYTES, headers=headers
    )
    state["budget"] = budget
    async with client:
        async with client.stream("POST", config.url, content=payload) as response:
            chunks, size = [], 0
            async for chunk in response.aiter_raw():
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:
                    raise _bad(f"larger than {MAX_ANSWER_BYTES} bytes")
                chunks.append(chunk)
            status = response.status_code
    raw = b"".join(chunks)
    if not 200 <= status < 300:
        snippet = raw[:_ERROR_SNIPPET].decode("utf-8", errors="replace").strip()
        redirect = " (redirects are not followed)" if 300 <= status < 400 else ""
        raise ToolError(
            TOOL_EXECUTOR_ERROR,
            f"the tool executor answered HTTP {status}{redirect}" + (f": {snippet}" if snippet else ""),
        )
    return parse_http_answer(raw, tool_calls)


def parse_http_answer(raw: bytes, tool_calls: list[dict]) -> list[dict]:
    """`{results: [{tool_call_id, content}]}` → tool messages in call order; every call answered exactly once."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise _bad(f"not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise _bad('expected {"results": [{"tool_call_id": ..., "content": ...}, ...]}')
    wanted = _call_ids(tool_calls)
    contents: dict[str, str] = {}
    for i, result in enumerate(data["results"]):
        if not isinstance(result, dict):
            raise _bad(f"results[{i}] must be an object")
        call_id = result.get("tool_call_id")
        if not isinstance(call_id, str):
            raise _bad(f"results[{i}].tool_call_id must be a string")
        if call_id not in wanted:
            raise _bad(f"results[{i}].tool_call_id {quoted(call_id)} matches no tool call of this round")
        if call_id in contents:
            raise _bad(f"results[{i}] answers tool call {quoted(call_id)} a second time")
        if "content" not in result:
            raise _bad(f"results[{i}] has no content")
        contents[call_id] = _content_text(result["content"])
    missing = [call_id for call_id in wanted if call_id not in contents]
    if missing:
        raise _bad(f"no result for tool call(s) {', '.join(missing)}")
    return [{"role": "tool", "tool_call_id": call_id, "content": contents[call_id]} for call_id in wanted]


# --- mcp ------------------------------------------------------------------------------


def _mcp_arguments(call: dict) -> tuple[dict | None, str]:
    """(arguments, "") or (None, a message for the model) when function.arguments is not a JSON object."""
    raw = call["function"].get("arguments")
    if raw is None or raw == "":
        return {}, ""
    if isinstance(raw, dict):
        return raw, ""
    if not isinstance(raw, str):
        return None, "error: the tool call's arguments must be a JSON object"
    try:
        parsed = json.loads(raw)
    except ValueError as exc:
        return None, f"error: the tool call's arguments are not valid JSON ({exc}); the tool was not called"
    if not isinstance(parsed, dict):
        return None, "error: the tool call's arguments must be a JSON object; the tool was not called"
    return parsed, ""


def mcp_result_text(result) -> str:
    """The text of a CallToolResult: its text blocks joined; structured content if it has no text."""
    texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
    if texts:
        text = "\n".join(texts)
    elif result.structured_content is not None:
        text = json.dumps(result.structured_content, ensure_ascii=False, separators=(",", ":"))
    else:
        text = ""
    if len(text.encode()) > MAX_ANSWER_BYTES:
        raise _bad(f"an MCP tool result is larger than {MAX_ANSWER_BYTES} bytes")
    # A tool-level failure goes back to the model, which can read it and correct itself (MCP's intent for isError).
    return f"error: {text}" if result.is_error else text


async def _mcp_round(config: ToolConfig, tool_calls: list[dict], custom_id: str, timeout: float, state: dict):
    pin = await _resolve(config)
    headers = {}
    if config.authorization is not None:
        headers["Authorization"] = config.authorization
    client, budget = netguard.pinned_client(
        pin,
        timeout=timeout,
        max_bytes=MCP_SESSION_ALLOWANCE_BYTES + MCP_WIRE_BYTES_PER_CALL * len(tool_calls),
        headers=headers,
    )
    state["budget"] = budget
    # The http contract's custom_id and context, carried where MCP allows caller metadata.
    meta = {"openrelay/custom_id": custom_id, "openrelay/context": config.context}
    messages = []
    async with client:
        # No SSE event limit of its own: the round's byte budget bounds what is read, and names the failure.
        async with streamable_http_client(config.url, http_client=client, max_sse_event_size=None) as (
            read_stream,
            write_stream,
        ):
            async with ClientSession(
                read_stream, write_stream, read_timeout_seconds=timeout, client_info=_MCP_CLIENT_INFO
            ) as session:
                await session.initialize()
                for call in tool_calls:
                    arguments, problem = _mcp_arguments(call)
                    if arguments is None:
                        content = problem
                    else:
                        result = await session.call_tool(call["function"]["name"], arguments, meta=meta)
                        content = mcp_result_text(result)
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
    return messages
