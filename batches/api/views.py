"""Batch and file endpoints. Thin: authenticate, call one service or selector, answer.

`/v1/batches` serves both surfaces (design.md §2). POST tells them apart by the
body (batches.intake); the other routes by the id: a native batch is addressed
by its UUID, an OpenAI-surface batch by `batch_<hex>`. Each surface answers
errors in its own envelope; before the body has said which surface it speaks,
POST answers in OpenAI's, which carries every field of the native one.
"""

import itertools

from django.http import JsonResponse, StreamingHttpResponse
from django.utils.http import content_disposition_header
from rest_framework.exceptions import APIException
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.views import APIView

from batches import files, intake, openai_batches, selectors, services, storage
from batches.api import serializers
from batches.errors import OpenAIError, invalid
from batches.models import Surface
from relay.auth import authenticate
from relay.errors import RelayError


class _AnyAccept(BaseContentNegotiation):
    """These views build their own responses; an `Accept: application/binary` (the SDK's, for file
    content) must not be refused with 406 by DRF's negotiation."""

    def select_parser(self, request, parsers):
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class _SurfaceView(APIView):
    content_negotiation_class = _AnyAccept
    openai_errors = True  # set per request by views that also serve the native surface

    def handle_exception(self, exc):
        if self.openai_errors:
            if isinstance(exc, RelayError):
                exc = OpenAIError.of(exc)
            elif isinstance(exc, APIException):  # DRF's own, e.g. 405 for a method this route lacks
                exc = OpenAIError(exc.status_code, exc.default_code, str(exc.detail))
        return super().handle_exception(exc)


# --- batches -------------------------------------------------------------------------------------


class BatchListView(_SurfaceView):
    def post(self, request):
        principal = authenticate(request)
        with intake.read(request._request) as submission:
            if intake.surface_of(submission.top) == Surface.NATIVE:
                self.openai_errors = False
                batch = services.store_native(principal, submission)
                return JsonResponse(
                    {"id": str(batch.id), "status": "queued", "total_items": batch.total_items}, status=202
                )
            batch = openai_batches.create(
                principal, submission, idempotency_key=request.headers.get("Idempotency-Key", "").strip()
            )
        return JsonResponse(serializers.batch(batch))

    def get(self, request):
        principal = authenticate(request)
        openai_batches.check_access(principal)
        rows, has_more = selectors.openai_batches_page(principal, request.GET.get("after"), request.GET.get("limit"))
        return JsonResponse(serializers.page(rows, serializers.batch, has_more))


class BatchDetailView(_SurfaceView):
    def get(self, request, batch_id):
        self.openai_errors = selectors.is_openai_batch_id(batch_id)
        principal = authenticate(request)
        if not self.openai_errors:
            batch = selectors.batch_for_owner(batch_id, principal)
            return StreamingHttpResponse(selectors.iter_status_json(batch), content_type="application/json")
        openai_batches.check_access(principal)
        return JsonResponse(serializers.batch(selectors.openai_batch_for_owner(batch_id, principal)))


class BatchResultsView(_SurfaceView):
    openai_errors = False  # native only: OpenAI-surface results are files

    def get(self, request, batch_id):
        batch = selectors.batch_for_owner(batch_id, authenticate(request))
        return StreamingHttpResponse(selectors.iter_results_json(batch), content_type="application/json")


class BatchCancelView(_SurfaceView):
    def post(self, request, batch_id):
        self.openai_errors = selectors.is_openai_batch_id(batch_id)
        principal = authenticate(request)
        if not self.openai_errors:
            services.cancel(selectors.batch_for_owner(batch_id, principal))
            return JsonResponse({"status": "cancelled"})
        openai_batches.check_access(principal)
        batch = selectors.openai_batch_for_owner(batch_id, principal)
        if not openai_batches.cancel(batch):
            raise invalid(f"Cannot cancel a batch with status '{batch.status}'.", code="batch_not_cancellable")
        return JsonResponse(serializers.batch(batch))


# --- files ----------------------------------------------------------------------------------------


class FileListView(_SurfaceView):
    def post(self, request):
        principal = authenticate(request)
        openai_batches.check_access(principal)
        return JsonResponse(serializers.file(files.upload(principal, request._request)))

    def get(self, request):
        principal = authenticate(request)
        openai_batches.check_access(principal)
        rows, has_more = selectors.files_page(principal, request.GET)
        return JsonResponse(serializers.page(rows, serializers.file, has_more))


class FileDetailView(_SurfaceView):
    def get(self, request, file_id):
        principal = authenticate(request)
        openai_batches.check_access(principal)
        return JsonResponse(serializers.file(selectors.file_for_owner(file_id, principal)))

    def delete(self, request, file_id):
        principal = authenticate(request)
        openai_batches.check_access(principal)
        file = selectors.file_for_owner(file_id, principal)
        files.delete(file)
        return JsonResponse({"id": file.public_id, "object": "file", "deleted": True})


class FileContentView(_SurfaceView):
    def get(self, request, file_id):
        principal = authenticate(request)
        openai_batches.check_access(principal)
        file = selectors.file_for_owner(file_id, principal)
        chunks = storage.iter_file(file.ref)
        try:
            first = next(chunks, b"")  # a missing payload is an error answer, not a cut-off download
        except storage.PayloadMissing as exc:
            raise OpenAIError(500, "file_content_unavailable", f"The file's content could not be read: {exc}") from exc
        response = StreamingHttpResponse(itertools.chain([first], chunks), content_type="application/octet-stream")
        response["Content-Length"] = str(file.bytes)
        response["Content-Disposition"] = content_disposition_header(True, file.filename)
        return response
