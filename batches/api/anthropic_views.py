"""The Anthropic Message Batches endpoints, under /v1/messages/batches and /anthropic/v1/messages/batches.

Thin: authenticate (`x-api-key` or `Authorization: Bearer`, a relay key or an
inference token), call batches.surfaces.anthropic, answer. Every error, a 401
included, is in Anthropic's envelope. `anthropic-version` (and `anthropic-beta`)
are accepted and not required: the surface speaks the 2023-06-01 version.
"""

from django.http import JsonResponse, StreamingHttpResponse
from rest_framework.exceptions import APIException
from rest_framework.views import APIView

from batches import errors, intake
from batches.api.views import _AnyAccept
from batches.surfaces import retry
from batches.surfaces.anthropic import create as anthropic_create
from batches.surfaces.anthropic import read as anthropic_read
from relay.api.authentication import RelayCredentialAuthentication
from relay.errors import RelayError


class _AnthropicView(APIView):
    content_negotiation_class = _AnyAccept
    authentication_classes = [RelayCredentialAuthentication]
    permission_classes = []

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)  # authenticates: request.user is the Principal
        anthropic_create.check_access(request.user)

    def handle_exception(self, exc):
        if isinstance(exc, RelayError):
            exc = errors.AnthropicError.of(exc)
        elif isinstance(exc, APIException):  # DRF's own, e.g. 405 for a method this route lacks
            exc = errors.AnthropicError(exc.status_code, str(exc.detail))
        return super().handle_exception(exc)

    def base_url(self, request) -> str:
        """Where the caller reached this surface (with or without the /anthropic prefix), for results_url."""
        prefix = "/anthropic" if request.path.startswith("/anthropic/") else ""
        return request.build_absolute_uri(f"{prefix}/v1/messages/batches/")


class MessageBatchListView(_AnthropicView):
    def post(self, request):
        with intake.read(request._request) as submission:
            batch = anthropic_read.as_created(anthropic_create.create(request.user, submission))
        return JsonResponse(anthropic_read.serialize(batch, self.base_url(request)))

    def get(self, request):
        rows, has_more = anthropic_read.batches_page(request.user, request.GET)
        return JsonResponse(anthropic_read.page(rows, has_more, self.base_url(request)))


class MessageBatchDetailView(_AnthropicView):
    def get(self, request, batch_id):
        batch = anthropic_read.batch_for_owner(batch_id, request.user, counts=True)
        return JsonResponse(anthropic_read.serialize(batch, self.base_url(request)))

    def delete(self, request, batch_id):
        batch = anthropic_read.batch_for_owner(batch_id, request.user)
        anthropic_read.delete(batch)
        return JsonResponse({"id": batch.public_id, "type": "message_batch_deleted"})


class MessageBatchCancelView(_AnthropicView):
    def post(self, request, batch_id):
        batch = anthropic_read.cancel(anthropic_read.batch_for_owner(batch_id, request.user))
        return JsonResponse(anthropic_read.serialize(batch, self.base_url(request)))


class MessageBatchRetryFailedView(_AnthropicView):
    """A new message batch re-running the batch's errored and expired requests
    (docs/api/anthropic.md, "Re-run what failed")."""

    def post(self, request, batch_id):
        parent = anthropic_read.batch_for_owner(batch_id, request.user)
        batch = anthropic_read.as_created(retry.retry_failed(parent, request.user).batch)
        return JsonResponse(anthropic_read.serialize(batch, self.base_url(request)))


class MessageBatchResultsView(_AnthropicView):
    def get(self, request, batch_id):
        batch = anthropic_read.batch_for_owner(batch_id, request.user)
        anthropic_read.check_results(batch)  # still processing (400) or archived by retention (404)
        response = StreamingHttpResponse(anthropic_read.iter_results(batch), content_type="application/binary")
        response["Content-Disposition"] = f'attachment; filename="{batch.public_id}_results.jsonl"'
        return response
