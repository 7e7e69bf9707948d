"""Live (non-streaming) inference endpoints. Thin: authenticate, read, dispatch, record, answer."""

import json
import logging
import time

import uuid6
from django.conf import settings
from django.http import HttpResponse
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.views import APIView

from relay import auth, pipeline
from relay.api.authentication import LiveCredentialAuthentication
from relay.edge import stamp_request_id
from relay.errors import AnthropicError, RelayError, is_anthropic_path
from relay.http import parse_json_object, read_body
from usage.services import record_event

logger = logging.getLogger(__name__)


class _NoNegotiation(BaseContentNegotiation):
    """The view answers the provider's bytes as they are (JSON), whatever the Accept header: DRF's
    negotiation would parse Accept on every request for a renderer that is never used."""

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class InferenceView(APIView):
    authentication_classes = [LiveCredentialAuthentication]
    content_negotiation_class = _NoNegotiation
    upstream_path = ""  # set per route: /v1/chat/completions, /v1/messages, …

    def post(self, request, *args, **kwargs):
        principal = request.user
        body = parse_json_object(read_body(request._request, settings.RELAY_MAX_REQUEST_BYTES))
        if body.get("stream") is True:
            raise RelayError(
                400, "streaming_unsupported", 'streaming is not supported yet: send the request without "stream": true'
            )
        # The edge's id for this request (relay.edge), so the log line, the answer and the usage event agree.
        request_id = getattr(request._request, "relay_request_id", None) or str(uuid6.uuid7())
        outcome = pipeline.dispatch(
            pipeline.Call(
                path=self.upstream_path,
                body=body,
                principal=principal,
                source="live",
                request_id=request_id,
                deadline=time.monotonic() + settings.RELAY_UPSTREAM_DEADLINE,
                inbound_headers=dict(request.headers),
                credential_snapshot=request.auth,
                reauthenticate=lambda snapshot: auth.authenticate(request._request, snapshot),
            )
        )
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


def _record(event: dict) -> None:
    try:
        record_event(**event, fetch=False)
    except Exception:
        # HttpResponse.close() swallows a closer's exception: say it, never lose it silently.
        logger.exception("usage event %s could not be recorded", event.get("request_id"))


def inference_urls():
    from django.urls import path

    routes = []
    for upstream_path in pipeline.adapters.PATH_ADAPTER:
        view = InferenceView.as_view(upstream_path=upstream_path)
        name = upstream_path.strip("/").replace("/", "-")
        for prefix in pipeline.adapters.LIVE_PREFIXES:
            routes.append(path(prefix + upstream_path.lstrip("/"), view, name=f"{prefix}{name}"))
    return routes
