"""Batch and file endpoints. Thin: authenticate, call one service or selector, answer.

`/v1/batches` serves both surfaces (decision 0002). POST tells them apart by the
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
from rest_framework.permissions import BasePermission
from rest_framework.views import APIView

from batches import intake, storage
from batches.errors import OpenAIError, invalid
from batches.lifecycle import stop
from batches.models import Batch, Surface
from batches.surfaces import retry
from batches.surfaces.native import read as native_read
from batches.surfaces.native import submit
from batches.surfaces.openai import create as openai_create
from batches.surfaces.openai import files, serialize
from batches.surfaces.openai import read as openai_read
from relay.api.authentication import RelayCredentialAuthentication
from relay.errors import RelayError, clipped


class _AnyAccept(BaseContentNegotiation):
    """These views build their own responses; an `Accept: application/binary` (the SDK's, for file
    content) must not be refused with 406 by DRF's negotiation."""

    def select_parser(self, request, parsers):
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class OpenAIBatchAccess(BasePermission):
    """The OpenAI surface's Batch and Files API needs the credential's policy to grant batch access
    (404 otherwise, as OpenAI answers an organization without it). Native batches are not gated."""

    def has_permission(self, request, view):
        if view.openai_errors and request.method in view.access_checked_methods:
            openai_create.check_access(request.user)
        return True


class _SurfaceView(APIView):
    """Authenticated by relay key or token (request.user is the Principal); errors in the surface's envelope.

    Ownership is queryset scoping in the selectors: anyone but the owner gets the surface's 404.
    """

    content_negotiation_class = _AnyAccept
    authentication_classes = [RelayCredentialAuthentication]
    permission_classes = [OpenAIBatchAccess]
    openai_errors = True  # per request: which surface's envelope answers
    access_checked_methods = ("GET", "POST", "DELETE")

    def initial(self, request, *args, **kwargs):
        # Decided before authentication, so even a 401 comes in the surface's own envelope: a native
        # batch is addressed by its UUID, an OpenAI one by batch_<hex>.
        self.openai_errors = self.answers_as_openai(kwargs)
        super().initial(request, *args, **kwargs)

    def answers_as_openai(self, kwargs) -> bool:
        batch_id = kwargs.get("batch_id")
        return openai_read.is_openai_batch_id(batch_id) if batch_id is not None else True

    def handle_exception(self, exc):
        if self.openai_errors:
            if isinstance(exc, RelayError):
                exc = OpenAIError.of(exc)
            elif isinstance(exc, APIException):  # DRF's own, e.g. 405 for a method this route lacks
                exc = OpenAIError(exc.status_code, exc.default_code, str(exc.detail))
        return super().handle_exception(exc)


# --- batches -------------------------------------------------------------------------------------


class BatchListView(_SurfaceView):
    access_checked_methods = ("GET",)  # create checks it once the body has said which surface it is

    def post(self, request):
        read = intake.receive(request._request, request.user, on_native=self._answer_as_native)
        if isinstance(read, Batch):  # native, stored as its body was read
            return self._queued(read)
        with read as submission:
            if intake.surface_of(submission.top) == Surface.NATIVE:
                self._answer_as_native()
                return self._queued(submit.store_native(request.user, submission))
            batch = openai_create.create(
                request.user, submission, idempotency_key=request.headers.get("Idempotency-Key", "").strip()
            )
        return JsonResponse(serialize.batch(batch))

    def _answer_as_native(self) -> None:
        self.openai_errors = False

    @staticmethod
    def _queued(batch: Batch) -> JsonResponse:
        return JsonResponse({"id": str(batch.id), "status": "queued", "total_items": batch.total_items}, status=202)

    def get(self, request):
        params = request.GET
        rows, has_more = openai_read.openai_batches_page(request.user, params.get("after"), params.get("limit"))
        return JsonResponse(serialize.page(rows, serialize.batch, has_more))


class BatchDetailView(_SurfaceView):
    def get(self, request, batch_id):
        if not self.openai_errors:
            batch = native_read.batch_for_owner(batch_id, request.user)
            return StreamingHttpResponse(native_read.iter_status_json(batch), content_type="application/json")
        batch = openai_read.openai_batch_for_owner(batch_id, request.user, progress=True)
        return JsonResponse(serialize.batch(batch))


class BatchResultsView(_SurfaceView):
    def answers_as_openai(self, kwargs) -> bool:
        return False  # native only: OpenAI-surface results are files

    def get(self, request, batch_id):
        batch = native_read.batch_for_owner(batch_id, request.user)
        return StreamingHttpResponse(native_read.iter_results_json(batch), content_type="application/json")


class BatchCancelView(_SurfaceView):
    def post(self, request, batch_id):
        if not self.openai_errors:
            batch = native_read.batch_for_owner(batch_id, request.user)
            stop.cancel(batch)
            batch.refresh_from_db(fields=["status"])  # a finished batch keeps (and answers) its own status
            return JsonResponse({"status": batch.status})
        batch = openai_read.openai_batch_for_owner(batch_id, request.user)
        if not stop.cancel(batch):
            raise invalid(f"Cannot cancel a batch with status '{batch.status}'.", code="batch_not_cancellable")
        return JsonResponse(serialize.batch(batch))


class BatchRetryFailedView(_SurfaceView):
    """A new batch of the same surface re-running the batch's failed and expired records
    (docs/api/native.md and openai.md, "Re-run what failed")."""

    def post(self, request, batch_id):
        if not self.openai_errors:
            parent = native_read.batch_for_owner(batch_id, request.user)
            retried = retry.retry_failed(parent, request.user)
            batch = retried.batch
            return JsonResponse(
                {
                    "id": str(batch.id),
                    "status": "queued",
                    "total_items": batch.total_items,
                    "retry_of": batch.retry_of_public_id,
                    # Item i of the new batch re-runs item parent_idx[i] of the parent.
                    "parent_idx": retried.parent_idx,
                },
                status=202,
            )
        parent = openai_read.openai_batch_for_owner(batch_id, request.user)
        return JsonResponse(serialize.batch(retry.retry_failed(parent, request.user).batch))


# --- files ----------------------------------------------------------------------------------------


class FileListView(_SurfaceView):
    def post(self, request):
        return JsonResponse(serialize.file(files.upload(request.user, request._request)))

    def get(self, request):
        rows, has_more = openai_read.files_page(request.user, request.GET)
        return JsonResponse(serialize.page(rows, serialize.file, has_more))


class FileDetailView(_SurfaceView):
    def get(self, request, file_id):
        return JsonResponse(serialize.file(openai_read.file_for_owner(file_id, request.user)))

    def delete(self, request, file_id):
        file = openai_read.file_for_owner(file_id, request.user)
        files.delete(file)
        return JsonResponse({"id": file.public_id, "object": "file", "deleted": True})


class FileContentView(_SurfaceView):
    def get(self, request, file_id):
        file = openai_read.file_for_owner(file_id, request.user)
        chunks = storage.iter_file(file.ref)
        try:
            first = next(chunks, b"")  # a missing payload is an error answer, not a cut-off download
        except storage.PayloadMissing as exc:  # deleted while we read it: gone, like a deleted file (decision 0009)
            raise OpenAIError(404, None, f"No such File object: {clipped(file_id)}") from exc
        response = StreamingHttpResponse(itertools.chain([first], chunks), content_type="application/octet-stream")
        response["Content-Length"] = str(file.bytes)
        response["Content-Disposition"] = content_disposition_header(True, file.filename)
        return response
