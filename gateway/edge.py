"""The edge: what every request passes before any view reads it (decision 0008).

EdgeMiddleware (first in settings.MIDDLEWARE):

- gives the request an id (`request.relay_request_id`, answered as
  `X-Request-ID` on every response, `Request-ID` too on the Anthropic routes) used in the log line of an unexpected
  exception;
- refuses a URL longer than RELAY_MAX_URL_CHARS (414), a path or query
  parameter holding a NUL character or a lone surrogate (400, naming the
  parameter), a malformed Content-Length (400) and a declared Content-Length
  over the route's limit (413) — before a byte of the body is read;
- reads a chunked body (`Transfer-Encoding: chunked`, no Content-Length) into a
  spool, within the same limit, when the server has de-chunked it (gunicorn
  does); otherwise answers 411;
- bounds how long a body may take to arrive (RELAY_BODY_READ_SECONDS plus
  1 s per RELAY_BODY_MIN_RATE bytes declared, at most RELAY_BODY_IDLE_SECONDS
  between two reads): a client that sends headers and a few bytes cannot hold
  a server thread for longer (408);
- answers any error of an API path (everything but /admin/) as JSON in the
  product's envelope: the envelope of the routes an app registered
  (`register_routes`: the batches app registers each batch surface, so OpenAI's
  shape on `/v1/batches` and `/v1/files`, Anthropic's on `/v1/messages/batches`),
  Anthropic's on the live Anthropic routes, the relay's elsewhere. An unexpected
  exception is logged with the request id and answered 500 without internals.

JSON bodies are checked once, where they are parsed: core.http.parse_json_object
(live routes) and batches.ingest (POST /v1/batches), both through core.jsonguard.
"""

import logging
import tempfile
import time
from typing import Protocol

import uuid6
from django.conf import settings
from django.contrib.auth import middleware as auth_middleware
from django.contrib.messages import middleware as message_middleware
from django.contrib.sessions import middleware as session_middleware
from django.core.handlers.wsgi import LimitedStream
from django.http import HttpResponse
from django.middleware import csrf as csrf_middleware
from django.views import defaults

from core.errors import AnthropicError, RelayError, clipped, is_anthropic_path, quoted
from core.http import ascii_int
from gateway.adapters import LIVE_PATHS

log = logging.getLogger("gateway.edge")

_CHUNK = 64 * 1024
_SPOOL_MEMORY = 1024 * 1024


class Routes(Protocol):
    """What an app above the edge tells it about the routes it serves, so that the edge names none of them
    (the batches app registers each batch surface: batches/surfaces/registry.py). Each answers None for a
    path that is not its own."""

    def edge_error(self, path: str, status: int, code: str, message: str, param: str | None) -> RelayError | None:
        """A refusal in the envelope of its routes."""

    def edge_body_limit(self, path: str) -> int | None:
        """The body limit of its routes that have their own."""

    def edge_too_large(self, path: str, method: str, limit: int) -> RelayError | None:
        """Its own answer to a body over the limit, where it is not the envelope's 413."""


_ROUTES: list[Routes] = []


def register_routes(routes: Routes) -> None:
    """Called by an app's ready(); registering the same object again is a no-op."""
    if routes not in _ROUTES:
        _ROUTES.append(routes)


_REASONS = {
    400: ("invalid_request", "bad request"),
    401: ("unauthenticated", "authentication required"),
    403: ("forbidden", "forbidden"),
    404: ("not_found", "not found"),
    405: ("method_not_allowed", "method not allowed"),
    408: ("request_timeout", "the request body did not arrive in time"),
    411: ("length_required", "length required"),
    413: ("request_too_large", "request body too large"),
    414: ("uri_too_long", "request URL too long"),
    415: ("unsupported_media_type", "unsupported media type"),
    500: ("internal_error", "internal server error"),
}


def is_api_path(path: str) -> bool:
    return not path.startswith("/admin/") and not path.startswith("/static/")


def error_response(request, status: int, code: str, message: str, *, param: str | None = None) -> HttpResponse:
    """An error in the envelope of the surface the path belongs to."""
    path = getattr(request, "path", "") or ""
    for routes in _ROUTES:
        err = routes.edge_error(path, status, code, message, param)
        if err is not None:
            break
    else:
        if is_anthropic_path(path):  # the live Anthropic routes: the relay's code beside Anthropic's type
            err = AnthropicError(status, f"{param}: {message}" if param else message, code=code)
        else:
            err = RelayError(status, code, message, param=param)
    return _finish(request, err.response())


def _finish(request, response: HttpResponse) -> HttpResponse:
    # Answered before CommonMiddleware: say where the body ends, so the connection need not close
    # (a server that drains an unread body before closing would otherwise hold the answer back).
    response["Content-Length"] = str(len(response.content))
    stamp_request_id(request, response)
    return response


def stamp_request_id(request, response) -> None:
    """Every answer carries the relay's own id for the request — the one in its log lines and on its
    usage event — as `x-request-id` (what the openai SDK reads into `_request_id`), `request-id` on
    the Anthropic routes (the anthropic SDK's), and `X-Relay-Request-ID`."""
    rid = getattr(request, "relay_request_id", None)
    if not rid:
        return
    response["X-Request-ID"] = rid
    response["X-Relay-Request-ID"] = rid
    if is_anthropic_path(getattr(request, "path", "") or ""):
        response["Request-ID"] = rid


def _bad_text(text: str) -> str | None:
    if "\x00" in text:
        return "a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "a lone surrogate"
    return None


def body_limit(path: str) -> int:
    for routes in _ROUTES:
        limit = routes.edge_body_limit(path)
        if limit is not None:
            return limit
    return settings.RELAY_MAX_REQUEST_BYTES


class BodyTimeout(RelayError):
    """408 naming the limit that fired: the whole body's deadline, or the idle limit between two reads."""

    def __init__(self, message: str):
        super().__init__(408, "request_timeout", message)

    @classmethod
    def deadline(cls, budget: float) -> "BodyTimeout":
        return cls(
            f"the request body did not arrive within {budget:g} seconds (RELAY_BODY_READ_SECONDS plus one second "
            "per RELAY_BODY_MIN_RATE bytes declared)"
        )

    @classmethod
    def idle(cls, seconds: float) -> "BodyTimeout":
        return cls(f"no byte of the request body arrived for {seconds:g} seconds (RELAY_BODY_IDLE_SECONDS)")


class _DeadlineInput:
    """wsgi.input with a deadline for the whole body and an idle limit between reads."""

    def __init__(self, raw, sock, budget: float):
        self.raw, self.sock, self.budget = raw, sock, budget
        self.deadline = time.monotonic() + budget
        self.idle_armed = False  # whether the socket timeout armed last is the idle limit (else the deadline)

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise BodyTimeout.deadline(self.budget)
        idle = settings.RELAY_BODY_IDLE_SECONDS
        self.idle_armed = idle < left
        self.sock.settimeout(min(left, idle))

    def _timeout(self) -> BodyTimeout:
        # The socket timeout is whichever limit comes first; the answer names that one.
        if self.idle_armed:
            return BodyTimeout.idle(settings.RELAY_BODY_IDLE_SECONDS)
        return BodyTimeout.deadline(self.budget)

    def read(self, *args):
        self._arm()
        try:
            return self.raw.read(*args)
        except TimeoutError as exc:
            raise self._timeout() from exc

    def readline(self, *args):
        self._arm()
        try:
            return self.raw.readline(*args)
        except TimeoutError as exc:
            raise self._timeout() from exc


class EdgeMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        request.relay_request_id = str(uuid6.uuid7())
        theirs = request.META.get("HTTP_X_REQUEST_ID")
        if theirs:
            # A client's own id is never taken as ours (ours is unique and names our log lines); it is
            # logged beside ours so the two can be matched.
            log.info("request %s: the client's x-request-id is %s", request.relay_request_id, quoted(theirs))
        sock = request.META.get("gunicorn.socket")
        try:
            refusal = self._refuse(request, sock)
        except RelayError as exc:
            refusal = error_response(request, exc.status, exc.code, exc.message, param=exc.param)
        if refusal is not None:
            return refusal
        try:
            response = self.get_response(request)
        finally:
            if sock is not None:
                try:
                    sock.settimeout(None)  # the answer is written without our body-read limits
                except OSError:
                    pass
        spool = getattr(request, "_relay_spool", None)
        if spool is not None:
            response._resource_closers.append(spool.close)
        if response.status_code >= 400 and is_api_path(request.path) and not _is_json(response):
            code, message = _REASONS.get(response.status_code, ("error", "request failed"))
            response = error_response(request, response.status_code, code, message)
        elif "X-Request-ID" not in response:
            stamp_request_id(request, response)
        return response

    def process_exception(self, request, exception):
        if isinstance(exception, RelayError) and is_api_path(request.path):
            return error_response(request, exception.status, exception.code, exception.message, param=exception.param)
        if not is_api_path(request.path):
            return None  # the admin keeps Django's own handling
        log.error(
            "unhandled %s on %s %s (request id %s)",
            type(exception).__name__,
            request.method,
            request.path[:200],
            request.relay_request_id,
            exc_info=exception,
        )
        return server_error_response(request)

    # --- checks ---------------------------------------------------------------------------

    def _refuse(self, request, sock) -> HttpResponse | None:
        meta = request.META
        raw_path = request.path
        if len(raw_path) + len(meta.get("QUERY_STRING", "")) > settings.RELAY_MAX_URL_CHARS:
            return error_response(
                request, 414, "uri_too_long", f"request URL is longer than {settings.RELAY_MAX_URL_CHARS} characters"
            )
        problem = _bad_text(raw_path)
        if problem:
            return error_response(request, 400, "invalid_path", f"the request path contains {problem}")
        for name, values in request.GET.lists():
            for text in (name, *values):
                problem = _bad_text(text)
                if problem:
                    shown = clipped(name).encode("utf-8", "backslashreplace").decode().replace("\x00", "\\u0000")
                    return error_response(
                        request,
                        400,
                        "invalid_query_parameter",
                        f"query parameter {quoted(shown)} contains {problem}",
                        param=shown,
                    )
        limit = body_limit(raw_path)
        declared = meta.get("CONTENT_LENGTH") or ""
        chunked = "chunked" in meta.get("HTTP_TRANSFER_ENCODING", "").lower()
        if declared:
            if ascii_int(declared.strip()) is None:
                return error_response(request, 400, "invalid_content_length", "Content-Length must be a whole number")
            declared = declared.strip()
            if int(declared) > limit:
                return _too_large(request, limit)
        elif meta.get("HTTP_TRANSFER_ENCODING"):
            if not chunked or not meta.get("wsgi.input_terminated"):
                return error_response(
                    request,
                    411,
                    "length_required",
                    "send the body with a Content-Length header (this server cannot read it otherwise)",
                )
        size = int(declared) if declared else (limit if chunked else 0)
        if sock is not None and size:
            budget = settings.RELAY_BODY_READ_SECONDS + size / settings.RELAY_BODY_MIN_RATE
            # A chunked body may run one byte past the limit, so the spool below can tell "too large".
            request._stream = LimitedStream(_DeadlineInput(meta["wsgi.input"], sock, budget), size + (not declared))
            meta["wsgi.input"] = request._stream
        if chunked and not declared:
            return self._spool_chunked(request, limit)
        return None

    def _spool_chunked(self, request, limit: int) -> HttpResponse | None:
        """Read a de-chunked body (gunicorn sets wsgi.input_terminated) into a spool, within `limit`."""
        source = request._stream if request.META.get("gunicorn.socket") else request.META["wsgi.input"]
        spool = tempfile.SpooledTemporaryFile(max_size=_SPOOL_MEMORY)  # noqa: SIM115 - closed with the response
        size = 0
        try:
            while chunk := source.read(_CHUNK):
                size += len(chunk)
                if size > limit:
                    spool.close()
                    return _too_large(request, limit)
                spool.write(chunk)
        except BaseException:
            spool.close()
            raise
        spool.seek(0)
        request._stream = LimitedStream(spool, size)
        request.META["wsgi.input"] = spool
        request.META["CONTENT_LENGTH"] = str(size)
        request._relay_spool = spool
        return None


def _too_large(request, limit: int) -> HttpResponse:
    for routes in _ROUTES:
        err = routes.edge_too_large(request.path, request.method, limit)
        if err is not None:
            return _finish(request, err.response())
    return error_response(request, 413, "request_too_large", f"request body exceeds {limit} bytes")


def _is_json(response) -> bool:
    return response.get("Content-Type", "").startswith("application/json")


def server_error_response(request) -> HttpResponse:
    rid = getattr(request, "relay_request_id", "") or ""
    return error_response(
        request, 500, "internal_error", f"internal server error; quote request id {rid} to the operator".strip()
    )


# --- handlers (relay.urls: handler400/403/404/500) ----------------------------------------------


def bad_request(request, exception=None):
    if not is_api_path(request.path):
        return defaults.bad_request(request, exception)
    return error_response(request, 400, "invalid_request", "bad request")


def permission_denied(request, exception=None):
    if not is_api_path(request.path):
        return defaults.permission_denied(request, exception)
    return error_response(request, 403, "forbidden", "forbidden")


def page_not_found(request, exception=None):
    if not is_api_path(request.path):
        return defaults.page_not_found(request, exception)
    return error_response(request, 404, "not_found", f"no route for {clipped(request.method)} {clipped(request.path)}")


def server_error(request):
    if not is_api_path(request.path):
        return defaults.server_error(request)
    if not hasattr(request, "relay_request_id"):
        request.relay_request_id = str(uuid6.uuid7())
    log.error("internal server error on %s (request id %s)", request.path[:200], request.relay_request_id)
    return server_error_response(request)


# --- the live routes skip the browser-session middleware ------------------------------------------


class _SkippedOnLiveRoutes:
    """Django's middleware, except on the live inference routes. Those authenticate a relay key or a
    token only (no session, no CSRF cookie, no messages, no Django user), yet paid each of these
    on every request. Every other path (the admin, the operator pages, the control-plane APIs a
    staff session may call) runs them as before. Subclasses of Django's own classes, so the
    admin's system checks still find them."""

    def __call__(self, request):
        if request.path_info in LIVE_PATHS:
            return self.get_response(request)
        return super().__call__(request)


class SessionMiddleware(_SkippedOnLiveRoutes, session_middleware.SessionMiddleware):
    pass


class CsrfViewMiddleware(_SkippedOnLiveRoutes, csrf_middleware.CsrfViewMiddleware):
    pass


class AuthenticationMiddleware(_SkippedOnLiveRoutes, auth_middleware.AuthenticationMiddleware):
    pass


class MessageMiddleware(_SkippedOnLiveRoutes, message_middleware.MessageMiddleware):
    pass
