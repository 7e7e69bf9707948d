"""Live inference endpoints, answered whole or streamed. Thin: authenticate, read, dispatch, record, answer."""

import json
import logging
import time

import uuid6
from django.conf import settings
from django.http import HttpResponse, StreamingHttpResponse
from django.utils import timezone
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.views import APIView

from core import auth
from core.authentication import LiveCredentialAuthentication
from core.errors import AnthropicError, RelayError, is_anthropic_path
from core.http import parse_json_object, read_body
from gateway import pipeline, streaming
from gateway.edge import stamp_request_id
from usage import budgets
from usage.services import record_event

logger = logging.getLogger(__name__)


class _NoNegotiation(BaseContentNegotiation):
    """The view answers the provider's bytes as they are (JSON), whatever the Accept header: DRF's
    negotiation would parse Accept on every request for a renderer that is never used."""

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


# Routes the providers do not bill: a spent budget does not refuse them.
_FREE_PATHS = frozenset({"/v1/messages/count_tokens"})


class InferenceView(APIView):
    authentication_classes = [LiveCredentialAuthentication]
    content_negotiation_class = _NoNegotiation
    upstream_path = ""  # set per route: /v1/chat/completions, /v1/messages, …

    def post(self, request, *args, **kwargs):
        principal = request.user
        body = parse_json_object(read_body(request._request, settings.RELAY_MAX_REQUEST_BYTES))
        # A spent budget refuses the call before it costs anything: 429 budget_exceeded, in the route's
        # envelope (a RelayError; core.errors picks Anthropic's on /v1/messages). No query without budgets.
        if self.upstream_path not in _FREE_PATHS:
            try:
                budgets.check(principal, None)
            except budgets.BudgetExceeded as exc:
                _record_refusal(request, principal, body, exc)
                raise
        streamed = body.get("stream") is True
        client_counts_usage = True
        cancel = None
        if streamed:
            if self.upstream_path not in streaming.STREAMED_PATHS:
                message = f'{self.upstream_path} does not stream: send the request without "stream": true'
                raise RelayError(400, "streaming_unsupported", message)
            body, client_counts_usage = streaming.upstream_body(self.upstream_path, body)
            sock = request._request.META.get("gunicorn.socket")
            if sock is not None:
                # A client that hangs up while the provider is silent is noticed by the upstream watchdog.
                cancel = lambda: streaming.client_gone(sock)  # noqa: E731
        # The edge's id for this request (gateway.edge), so the log line, the answer and the usage event agree.
        request_id = getattr(request._request, "relay_request_id", None) or str(uuid6.uuid7())
        call = pipeline.Call(
            path=self.upstream_path,
            body=body,
            principal=principal,
            source="live",
            request_id=request_id,
            deadline=time.monotonic() + settings.RELAY_UPSTREAM_DEADLINE,
            inbound_headers=dict(request.headers),
            cancel=cancel,
            credential_snapshot=request.auth,
            reauthenticate=lambda snapshot: auth.authenticate(request._request, snapshot),
        )
        outcome = pipeline.dispatch_stream(call) if streamed else pipeline.dispatch(call)
        if outcome.stream is not None:
            return self._streamed(request, outcome, client_counts_usage)
        body, status = outcome.body, outcome.status
        if outcome.origin == "relay" and outcome.error is not None and is_anthropic_path(request.path):
            # The relay's own refusal on an Anthropic route: in Anthropic's envelope (and status), with the code.
            err = AnthropicError.of(outcome.error, with_code=True)
            body, status = json.dumps(err.body()).encode(), err.status
        response = HttpResponse(body, status=status, content_type="application/json")
        # The usage event is written once the answer has been sent (the WSGI server closes the
        # response after its last byte), so the caller does not wait for the INSERT.
        response._resource_closers.append(lambda: _record(outcome.event))
        for name, value in outcome.headers.items():
            response[name] = str(value)
        response["X-WR-Origin"] = outcome.origin
        stamp_request_id(request._request, response)
        return response

    def _streamed(self, request, outcome: pipeline.Outcome, client_counts_usage: bool) -> StreamingHttpResponse:
        held = outcome.stream
        events = streaming.Events(held.adapter, held.path, strip_usage_chunk=not client_counts_usage)
        # The usage event is queued when the stream ends (or the client hangs up), for the writer thread.
        response = StreamingHttpResponse(
            streaming.relay(outcome, events, streaming.record_later), status=outcome.status
        )
        for name, value in outcome.headers.items():
            response[name] = str(value)
        response["Cache-Control"] = "no-cache"
        # nginx (the full stack's proxy) would buffer the events otherwise.
        response["X-Accel-Buffering"] = "no"
        response["X-WR-Origin"] = outcome.origin
        stamp_request_id(request._request, response)
        return response


def _record(event: dict) -> None:
    try:
        record_event(**event, fetch=False)
    except Exception:
        # HttpResponse.close() swallows a closer's exception: say it, never lose it silently.
        logger.exception("usage event %s could not be recorded", event.get("request_id"))
    charge_budgets(event)


def _record_refusal(request, principal, body: dict, exc: RelayError) -> None:
    """A request refused before any call still leaves its usage event (status 0, the refusal's kind), as the
    pipeline's own refusals do: the operator sees budget refusals in the usage API."""
    request_id = getattr(request._request, "relay_request_id", None) or str(uuid6.uuid7())
    _record(
        {
            "request_id": request_id,
            "source": "live",
            "ts": timezone.now(),
            "error_kind": exc.code,
            "error_message": exc.message,
            "model": str(body.get("model", ""))[:200],
            **principal.usage_attribution(),
        }
    )


def charge_budgets(event: dict) -> None:
    """A live call's billed cost to the budgets governing its caller, once it is answered (usage.budgets)."""
    try:
        budgets.charge_event(event)
    except Exception:
        logger.exception("request %s: its cost could not be charged to its budgets", event.get("request_id"))


def inference_urls():
    from django.urls import path

    routes = []
    for upstream_path in pipeline.adapters.PATH_ADAPTER:
        view = InferenceView.as_view(upstream_path=upstream_path)
        name = upstream_path.strip("/").replace("/", "-")
        for prefix in pipeline.adapters.LIVE_PREFIXES:
            routes.append(path(prefix + upstream_path.lstrip("/"), view, name=f"{prefix}{name}"))
    return routes
