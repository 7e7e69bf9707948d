"""`body.openrelay.tool_config`: parse, validate, clamp; and strip the relay-owned keys.

A chat record may carry OpenRelay request extensions under the reserved top-level
`openrelay` key (decision 0005). The relay owns that whole namespace: it is removed
from the body before every model invocation and never reaches a provider. The
one extension today is `tool_config`, which tells the worker where to execute
the model's tool calls between turns.

Everything here is pure (no I/O, no settings): a malformed value is a
`ToolError` with a code and a message precise enough to fix the record from it.
Address policy (which hosts an executor may live on) is checked when the
executor is called, by `netguard`, because DNS answers change after submit.
"""

from dataclasses import dataclass, field

from batches.outcomes import Code
from batches.tools import netguard
from core.errors import clipped, quoted

# Failure codes a record can end with (docs/tool-calling.md lists them with
# their meaning): members of the one set of item failure codes, batches.outcomes.Code.
INVALID_TOOL_CONFIG = Code.INVALID_TOOL_CONFIG
TOOL_CONFIG_MOVED = Code.TOOL_CONFIG_MOVED
TOOL_EXECUTOR_TIMEOUT = Code.TOOL_EXECUTOR_TIMEOUT
TOOL_EXECUTOR_ERROR = Code.TOOL_EXECUTOR_ERROR
TOOL_EXECUTOR_BAD_RESPONSE = Code.TOOL_EXECUTOR_BAD_RESPONSE
TOOL_EXECUTOR_BLOCKED = Code.TOOL_EXECUTOR_BLOCKED
TOOL_ROUNDS_EXHAUSTED = Code.TOOL_ROUNDS_EXHAUSTED
INVALID_TOOL_CALLS = Code.INVALID_TOOL_CALLS  # the model ended with "tool_calls" but sent none usable
TOOL_LOOP_CANCELLED = "cancelled"

OPENRELAY_KEY = "openrelay"

DEFAULT_MAX_ROUNDS = 8
MAX_MAX_ROUNDS = 16
DEFAULT_TIMEOUT_MS = 30_000
MAX_TIMEOUT_MS = 120_000
EXECUTOR_TYPES = ("http", "mcp")
_KNOWN_FIELDS = ("url", "type", "authorization", "context", "max_rounds", "timeout_ms")
MAX_URL_LENGTH = 2048
# The value goes out verbatim as a header: bound it, and refuse what would split headers.
MAX_AUTHORIZATION_LENGTH = 8192


class ToolError(Exception):
    """A record-level failure of the tool loop: `code` is machine-readable, `message` is for people."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"ToolError({self.code!r}, {self.message!r})"


@dataclass(frozen=True)
class ToolConfig:
    url: str
    type: str = "http"
    authorization: str | None = None
    context: dict = field(default_factory=dict)
    max_rounds: int = DEFAULT_MAX_ROUNDS
    timeout_ms: int = DEFAULT_TIMEOUT_MS

    @property
    def timeout_seconds(self) -> float:
        return self.timeout_ms / 1000.0


def _invalid(message: str) -> ToolError:
    return ToolError(INVALID_TOOL_CONFIG, f"openrelay.tool_config: {message}")


def _limit(raw: dict, name: str, default: int, ceiling: int) -> int:
    """0 or absent → the default; above the ceiling → the ceiling; negative or not an integer → invalid."""
    value = raw.get(name)
    if value is None:
        return default
    # JSON has one number type: 8.0 is accepted as 8, 8.5 is not an integer. bool is an int in Python.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid(f"{name} must be a non-negative integer, got {_kind(value)}")
    if isinstance(value, float):
        if not value.is_integer():
            raise _invalid(f"{name} must be a non-negative integer, got {value!r}")
        value = int(value)
    if value < 0:
        raise _invalid(f"{name} must be a non-negative integer, got {value}")
    if value == 0:
        return default
    return min(value, ceiling)


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def parse_tool_config(raw) -> ToolConfig:
    """Validate one `tool_config` value and apply defaults and clamps. Raises ToolError(invalid_tool_config)."""
    if not isinstance(raw, dict):
        raise _invalid(f"must be an object, got {_kind(raw)}")
    unknown = sorted(set(raw) - set(_KNOWN_FIELDS))
    if unknown:
        raise _invalid(f"unknown field(s) {clipped(', '.join(unknown))}; allowed: {', '.join(_KNOWN_FIELDS)}")

    url = raw.get("url")
    if url is None or url == "":
        raise _invalid("url is required")
    if not isinstance(url, str):
        raise _invalid(f"url must be a string, got {_kind(url)}")
    if len(url) > MAX_URL_LENGTH:
        raise _invalid(f"url is longer than {MAX_URL_LENGTH} characters")
    try:
        netguard.parse_url(url)
    except netguard.Blocked as exc:
        raise _invalid(f"url {exc.message}") from exc

    kind = raw.get("type")
    if kind is None:
        kind = "http"
    if not isinstance(kind, str) or kind not in EXECUTOR_TYPES:
        raise _invalid(f"type must be one of {', '.join(EXECUTOR_TYPES)}, got {quoted(kind)}")

    authorization = raw.get("authorization")
    if authorization is not None:
        if not isinstance(authorization, str):
            raise _invalid(f"authorization must be a string, got {_kind(authorization)}")
        if len(authorization) > MAX_AUTHORIZATION_LENGTH:
            raise _invalid(f"authorization is longer than {MAX_AUTHORIZATION_LENGTH} characters")
        if any(ch in authorization for ch in "\r\n\0"):
            raise _invalid("authorization must not contain CR, LF or NUL characters")
        if not authorization.isascii():
            raise _invalid("authorization must be ASCII (it is sent verbatim as an HTTP header)")
        if authorization == "":
            authorization = None

    context = raw.get("context")
    if context is None:
        context = {}
    if not isinstance(context, dict):
        raise _invalid(f"context must be a JSON object, got {_kind(context)}")

    return ToolConfig(
        url=url,
        type=kind,
        authorization=authorization,
        context=context,
        max_rounds=_limit(raw, "max_rounds", DEFAULT_MAX_ROUNDS, MAX_MAX_ROUNDS),
        timeout_ms=_limit(raw, "timeout_ms", DEFAULT_TIMEOUT_MS, MAX_TIMEOUT_MS),
    )


def strip_openrelay(body: dict) -> dict:
    """A shallow copy of `body` without the relay-owned `openrelay` key. The caller's dict is not touched."""
    return {k: v for k, v in body.items() if k != OPENRELAY_KEY}


def extract(body: dict) -> tuple[dict, ToolConfig | None]:
    """Split a chat record body into (the body a model may see, its tool config or None).

    Raises ToolError: `tool_config_moved` for the retired bare top-level
    `tool_config` (whatever its value, and even next to a valid
    `openrelay.tool_config`, so the retired spelling never silently wins or
    loses); `invalid_tool_config` for a malformed `openrelay` or `tool_config`.
    Unknown keys under `openrelay` are ignored: the namespace is additive, and
    they are stripped with the rest of it.
    """
    if not isinstance(body, dict):
        raise ToolError(INVALID_TOOL_CONFIG, f"the record body must be a JSON object, got {_kind(body)}")
    if "tool_config" in body:
        raise ToolError(
            TOOL_CONFIG_MOVED,
            "a bare top-level tool_config is the retired spelling of the tool-calling extension: "
            "move it to body.openrelay.tool_config",
        )
    stripped = strip_openrelay(body)
    if OPENRELAY_KEY not in body or body[OPENRELAY_KEY] is None:
        return stripped, None
    openrelay = body[OPENRELAY_KEY]
    if not isinstance(openrelay, dict):
        raise ToolError(INVALID_TOOL_CONFIG, f"openrelay must be an object, got {_kind(openrelay)}")
    raw = openrelay.get("tool_config")
    if raw is None:
        return stripped, None
    return stripped, parse_tool_config(raw)
