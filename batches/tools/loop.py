"""The tool loop of one chat record: model turn → executor → model turn …, at most max_rounds round trips.

`run_tool_loop(first_body, tool_config, custom_id, invoke)` knows nothing of
items, storage or usage rows: the caller's `invoke(body, round_no)` runs one
model invocation through the pipeline (`gateway.pipeline.dispatch`, with its own
request_id) and returns its Outcome; this module decides what happens between
invocations. So every invocation keeps routing, limits, key pool, breakers and
its own usage event, and the item runner records them all when it finishes the
item.

Rules (decisions 0013 and 0005):
- The relay-owned `openrelay` key is stripped before every invocation; a bare
  top-level `tool_config` fails the record (`tool_config_moved`).
- A turn whose choices[0] ends with finish_reason "tool_calls" sends its calls
  to the executor; the assistant message (as returned) and one `tool` message
  per call are appended and the model is invoked again. After max_rounds round
  trips a further "tool_calls" turn fails the record (`tool_rounds_exhausted`),
  so a record costs at most max_rounds + 1 invocations.
- A failed invocation (non-2xx from the pipeline) ends the loop: the record
  fails with that outcome, as a record without tools would.
- The final answer gets `"openrelay": {"tool_rounds": N}` and, when there was
  more than one invocation, `usage` summed over all of them (what the record
  cost, matching the sum of its usage events).
"""

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from batches.tools import executors
from batches.tools.config import (
    INVALID_TOOL_CALLS,
    INVALID_TOOL_CONFIG,
    OPENRELAY_KEY,
    TOOL_LOOP_CANCELLED,
    TOOL_ROUNDS_EXHAUSTED,
    ToolConfig,
    ToolError,
    extract,
    parse_tool_config,
)
from gateway.pipeline import Outcome

Invoke = Callable[[dict, int], Outcome]

_TOKEN_FIELDS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")


@dataclass
class LoopResult:
    """What a record's tool loop came to.

    - `outcome`: on success the final model answer (its body carries
      `openrelay.tool_rounds`); on failure the last model outcome, which for a
      pass-through failure is the failed invocation itself; None when the
      record failed before any invocation (bad config).
    - `invocations`: every model invocation in order; each `.event` is a usage
      event with its own request_id, to be recorded with the item.
    - `error`: the tool failure (code + message), None otherwise. A failed
      model invocation is not a tool failure: `error` is None, `ok` is False.
    """

    outcome: Outcome | None
    invocations: list[Outcome] = field(default_factory=list)
    tool_rounds: int = 0
    error: ToolError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.outcome is not None and self.outcome.ok

    @property
    def code(self) -> str:
        """The record's failure code ("" on success)."""
        if self.ok:
            return ""
        if self.error is not None:
            return self.error.code
        return (self.outcome.error_kind if self.outcome is not None else "") or "upstream_error"

    @property
    def totals(self) -> dict:
        """Tokens and cost summed over every invocation's usage event (cost None when none was priced)."""
        out = {"invocations": len(self.invocations), "tool_rounds": self.tool_rounds}
        for name in _TOKEN_FIELDS:
            out[name] = sum(int(o.event.get(name) or 0) for o in self.invocations)
        costs = [o.event.get("cost_nano_usd") for o in self.invocations if o.event.get("cost_nano_usd") is not None]
        out["cost_nano_usd"] = sum(costs) if costs else None
        return out


def run_tool_loop(
    first_body: dict,
    tool_config: ToolConfig | dict | None,
    custom_id: str,
    invoke: Invoke,
    *,
    deadline: float | None = None,
    cancel: Callable[[], bool] | None = None,
) -> LoopResult:
    """Run a chat record to its final answer, executing tool calls between turns.

    `first_body` is the record body as submitted (it may still hold
    `openrelay`; it is never mutated). `tool_config` is a parsed ToolConfig, a
    raw tool_config object, or None to read `first_body.openrelay.tool_config`.
    Without any tool config the record is one plain invocation.
    `invoke(body, round_no)` must run one model invocation: round_no is 0 for the
    first and k after k tool rounds. `deadline` (time.monotonic()) and `cancel`
    bound executor calls; the caller's invoke applies them to model calls.
    """
    try:
        body, from_body = extract(first_body)
        if tool_config is None:
            config = from_body
        elif isinstance(tool_config, ToolConfig):
            config = tool_config
        else:
            config = parse_tool_config(tool_config)
        if config is not None and not isinstance(body.get("messages"), list):
            raise ToolError(INVALID_TOOL_CONFIG, "tool_config needs a chat completions body with a messages array")
    except ToolError as exc:
        return LoopResult(outcome=None, error=exc)

    invocations: list[Outcome] = []
    rounds = 0
    while True:
        outcome = invoke(body, rounds)
        invocations.append(outcome)
        if not outcome.ok or config is None:
            return LoopResult(outcome=outcome, invocations=invocations, tool_rounds=rounds)
        answer = _json_object(outcome.body)
        calls = _requested_tool_calls(answer)
        if calls is None:
            final = _finalize(outcome, answer, invocations, rounds)
            return LoopResult(outcome=final, invocations=invocations, tool_rounds=rounds)
        try:
            _check_tool_calls(calls, config)
            if rounds >= config.max_rounds:
                raise ToolError(
                    TOOL_ROUNDS_EXHAUSTED,
                    f"the model asked for tools again after {rounds} tool round(s), the limit "
                    f"(max_rounds={config.max_rounds})",
                )
            if cancel is not None and cancel():
                raise ToolError(TOOL_LOOP_CANCELLED, "cancelled between tool rounds")
            tool_messages = executors.execute(config, calls, custom_id=custom_id, deadline=deadline, cancel=cancel)
        except ToolError as exc:
            return LoopResult(outcome=outcome, invocations=invocations, tool_rounds=rounds, error=exc)
        assistant = answer["choices"][0]["message"]
        body = dict(body, messages=[*body["messages"], assistant, *tool_messages])
        rounds += 1


def _json_object(raw: bytes) -> dict | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _requested_tool_calls(answer: dict | None) -> list | None:
    """The tool calls of choices[0] when its turn ended with finish_reason "tool_calls", else None."""
    if answer is None:
        return None
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    if choice.get("finish_reason") != "tool_calls":
        return None
    message = choice.get("message")
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    return calls if calls is not None else []


def _check_tool_calls(calls, config: ToolConfig) -> None:
    """The model's calls must be usable: each needs an id to answer, and MCP needs a function name."""
    if not isinstance(calls, list) or not calls:
        raise ToolError(INVALID_TOOL_CALLS, 'the model ended its turn with "tool_calls" but sent no tool calls')
    seen = set()
    for i, call in enumerate(calls):
        if not isinstance(call, dict) or not isinstance(call.get("id"), str) or not call["id"]:
            raise ToolError(INVALID_TOOL_CALLS, f"the model's tool_calls[{i}] has no id")
        if call["id"] in seen:
            raise ToolError(INVALID_TOOL_CALLS, f"the model's tool_calls[{i}] repeats id {call['id']!r}")
        seen.add(call["id"])
        if config.type == "mcp":
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
                raise ToolError(INVALID_TOOL_CALLS, f"the model's tool_calls[{i}] has no function name")


def _finalize(outcome: Outcome, answer: dict | None, invocations: list[Outcome], rounds: int) -> Outcome:
    """The final answer with `openrelay.tool_rounds` and, after several invocations, summed `usage`."""
    if answer is None:
        return outcome  # not a JSON object: nothing to annotate, hand it back untouched
    final = dict(answer)
    if len(invocations) > 1:
        total = None
        for previous in invocations:
            usage = (_json_object(previous.body) or {}).get("usage")
            if isinstance(usage, dict):
                total = usage if total is None else _add_usage(total, usage)
        if total is not None:
            final["usage"] = total
    final[OPENRELAY_KEY] = {"tool_rounds": rounds}
    return dataclasses.replace(outcome, body=json.dumps(final).encode())


def _add_usage(a: dict, b: dict) -> dict:
    """Field-wise sum of two usage objects: integers add, nested objects recurse, anything else keeps b's."""
    out = dict(a)
    for key, value in b.items():
        mine = out.get(key)
        if isinstance(value, bool) or isinstance(mine, bool):
            out[key] = value
        elif isinstance(value, int) and isinstance(mine, int):
            out[key] = mine + value
        elif isinstance(value, dict) and isinstance(mine, dict):
            out[key] = _add_usage(mine, value)
        else:
            out[key] = value
    return out
