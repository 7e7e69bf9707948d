"""The Anthropic Message Batches endpoints, under /v1/messages/batches and /anthropic/v1/messages/batches.

Thin: authenticate (`x-api-key` or `Authorization: Bearer`, a relay key or an
inference token), call batches.surfaces.anthropic, answer. Every error, a 401
included, is in Anthropic's envelope. `anthropic-version` (and `anthropic-beta`)
are accepted and not required: the surface speaks the 2023-06-01 version.
"""

from django.http import StreamingHttpResponse
from rest_framework.views import APIView

from batches import intake
from batches.api.views import _AnyAccept, answer, answer_with_status
from batches.models import Surface
from batches.surfaces import common, registry, retry
from batches.surfaces.anthropic import read as anthropic_read
from core.authentication import RelayCredentialAuthentication


class _AnthropicView(APIView):
    content_negotiation_class = _AnyAccept
    authentication_classes = [RelayCredentialAuthentication]
    permission_classes = []

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)  # authenticates: request.user is the Principal
        common.check_access(request.user)

    @property
    def surface(self):
        return registry.get(Surface.ANTHROPIC)

    def handle_exception(self, exc):
        return super().handle_exception(self.surface.envelope(exc))

    def base_url(self, request) -> str:
        """Where the caller reached this surface (with or without the /anthropic prefix), for results_url."""
        prefix = "/anthropic" if request.path.startswith("/anthropic/") else ""
        return request.build_absolute_uri(f"{prefix}/v1/messages/batches/")


class MessageBatchListView(_AnthropicView):
    def post(self, request):
        with intake.read(request._request) as submission:
            batch = self.surface.create(request.user, submission)
        return answer_with_status(self.surface.answer_created(batch, self.base_url(request)))

    def get(self, request):
        return answer(self.surface.answer_page(request.user, request.GET, self.base_url(request)))


class MessageBatchDetailView(_AnthropicView):
    def get(self, request, batch_id):
        return answer(self.surface.answer_detail(batch_id, request.user, self.base_url(request)))

    def delete(self, request, batch_id):
        batch = self.surface.find(batch_id, request.user)
        anthropic_read.delete(batch)
        return answer({"id": batch.public_id, "type": "message_batch_deleted"})


class MessageBatchCancelView(_AnthropicView):
    def post(self, request, batch_id):
        return answer(self.surface.answer_cancel(batch_id, request.user, self.base_url(request)))


class MessageBatchRetryFailedView(_AnthropicView):
    """A new message batch re-running the batch's errored and expired requests
    (docs/api/anthropic.md, "Re-run what failed")."""

    def post(self, request, batch_id):
        retried = retry.retry_failed(self.surface.find(batch_id, request.user), request.user)
        return answer_with_status(self.surface.answer_retried(retried, self.base_url(request)))


class MessageBatchResultsView(_AnthropicView):
    def get(self, request, batch_id):
        batch = self.surface.find(batch_id, request.user)
        anthropic_read.check_results(batch)  # still processing (400) or archived by retention (404)
        response = StreamingHttpResponse(anthropic_read.iter_results(batch), content_type="application/binary")
        response["Content-Disposition"] = f'attachment; filename="{batch.public_id}_results.jsonl"'
        return response
