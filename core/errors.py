"""The product's error envelope: {"error": {"type", "code", "message"}}.

Every relay-minted error goes through RelayError so status, code, message and
headers (`X-WR-Origin`, `Retry-After`) are set in one place.
"""

from django.http import JsonResponse
from rest_framework.views import exception_handler

# At most this many characters of any one client value are quoted in an error message (decision 0014): a
# 400 about a 1 MiB key name must not be 1 MiB long. Sites that echo a value use quoted()/clipped().
CLIENT_VALUE_CHARS = 100
# A backstop for a site that echoes without them: no message or param is longer than this.
MAX_MESSAGE_CHARS = 1000


def clipped(value, limit: int = CLIENT_VALUE_CHARS) -> str:
    """`value` as text for a message, cut to `limit` characters (an ellipsis says it was cut)."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[:limit] + "…"


def quoted(value, limit: int = CLIENT_VALUE_CHARS) -> str:
    """`value`'s repr for a message (`got 'abc'`), of at most `limit` characters of the value."""
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit])[:-1] + "…" + repr(value[:limit])[-1]
    text = repr(value)
    return text if len(text) <= limit + 2 else text[:limit] + "…"


class RelayError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        type: str | None = None,
        headers: dict | None = None,
        param: str | None = None,
    ):
        message = clipped(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        # The offending field (e.g. "messages[0].content"), when there is one.
        self.param = clipped(param, MAX_MESSAGE_CHARS) if param else param
        self.status = status
        self.code = code
        self.message = message
        self.type = type or _default_type(status)
        self.headers = headers or {}

    def body(self) -> dict:
        err = {"type": self.type, "message": self.message}
        if self.code:
            err["code"] = self.code
        if self.param:
            err["param"] = self.param
        return {"error": err}

    def response(self) -> JsonResponse:
        resp = JsonResponse(self.body(), status=self.status)
        resp["X-WR-Origin"] = "relay"
        for name, value in self.headers.items():
            resp[name] = str(value)
        return resp


def _default_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


class AuthError(RelayError):
    """401 with the product's messages (`missing relay key`, `api key revoked`, …)."""

    def __init__(self, message: str, code: str = "unauthenticated"):
        super().__init__(401, code, message)


def bad_request(message: str, code: str = "invalid_request") -> RelayError:
    return RelayError(400, code, message)


def drf_exception_handler(exc, context):
    request = context.get("request")
    if is_anthropic_path(getattr(request, "path", "") or ""):
        # Every Anthropic route answers in Anthropic's envelope, a 401 of the live routes included.
        if not isinstance(exc, RelayError):
            response = exception_handler(exc, context)
            if response is None:
                return None
            detail = response.data.get("detail") if isinstance(response.data, dict) else response.data
            kept = {k: v for k, v in response.items() if k in ("Allow", "WWW-Authenticate", "Retry-After")}
            exc = RelayError(response.status_code, getattr(exc, "default_code", ""), str(detail), headers=kept)
        return AnthropicError.of(exc, with_code=True).response()
    if isinstance(exc, RelayError):
        return exc.response()
    response = exception_handler(exc, context)
    if response is not None:
        detail = response.data.get("detail") if isinstance(response.data, dict) else response.data
        response.data = {"error": {"type": _default_type(response.status_code), "message": str(detail)}}
    return response


# --- Anthropic's envelope: {"type": "error", "error": {"type", "message"}} -----------------------
# Answered on the Anthropic routes, live and batch (gateway.edge, gateway.inference, batches).


def is_anthropic_path(path: str) -> bool:
    """An Anthropic-shaped route: `/v1/messages…` under any prefix (`/anthropic/`, `/openai/`, none).
    The prefix names no family (every live route is served under each): the path after it does."""
    for prefix in ("/anthropic", "/openai"):
        if path.startswith(prefix + "/"):
            path = path[len(prefix) :]
            break
    return path.startswith("/v1/messages")


_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    # Busy: every key cooling down, the provider's capacity spent (Anthropic says 529 overloaded).
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class AnthropicError(RelayError):
    """Anthropic's envelope: {"type": "error", "error": {"type", "message"}} (the SDK maps the status)."""

    def __init__(self, status: int, message: str, *, code: str = "", headers: dict | None = None):
        super().__init__(status, code, message, type=anthropic_error_type(status), headers=headers)

    def body(self) -> dict:
        error = {"type": self.type, "message": self.message}
        if self.code:
            error["code"] = self.code  # the relay's own code beside Anthropic's type (the SDK ignores it)
        return {"type": "error", "error": error}

    @classmethod
    def of(cls, exc: RelayError, *, with_code: bool = False) -> "AnthropicError":
        """`exc` in Anthropic's envelope; `with_code`: keep the relay's code beside the type (a live
        call's answer, where the code names the cause: upstream_unreachable, no_keys, …)."""
        if isinstance(exc, AnthropicError):
            return exc
        # A batch body over the limit is 400 on the other batch surfaces; Anthropic answers 413.
        status = 413 if exc.code == "request_too_large" else exc.status
        message = f"{exc.param}: {exc.message}" if exc.param and exc.param not in exc.message else exc.message
        return cls(status, message, code=exc.code if with_code else "", headers=exc.headers)
