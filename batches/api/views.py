"""Batch and file endpoints. Thin: authenticate, call one service or selector, answer.

`/v1/batches` serves two surfaces (decision 0002), each an object of batches/surfaces/registry.py that
these views look up and never name a branch for. POST tells them apart by the body (batches.intake); the
other routes by the id: a native batch is addressed by its UUID, an OpenAI-surface batch by `batch_<hex>`.
Each surface answers errors in its own envelope; before the body has said which surface it speaks, POST
answers in OpenAI's, which carries every field of the native one.
"""

import itertools

from django.http import JsonResponse, StreamingHttpResponse
from django.utils.http import content_disposition_header
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.permissions import BasePermission
from rest_framework.views import APIView

from batches import intake, storage
from batches.errors import OpenAIError
from batches.models import Batch, Surface
from batches.surfaces import common, registry, retry
from batches.surfaces.openai import files, serialize
from batches.surfaces.openai import read as openai_read
from core.authentication import RelayCredentialAuthentication
from core.errors import clipped


class _AnyAccept(BaseContentNegotiation):
    """These views build their own responses; an `Accept: application/binary` (the SDK's, for file
    content) must not be refused with 406 by DRF's negotiation."""

    def select_parser(self, request, parsers):
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class OpenAIBatchAccess(BasePermission):
    """The Batch and Files API needs the credential's policy to grant batch access (404 otherwise, as OpenAI
    answers an organization without it), on the surfaces gated so (`gated`: native batches are not)."""

    def has_permission(self, request, view):
        if view.gated and request.method in view.access_checked_methods:
            common.check_access(request.user)
        return True


def answer(body, status: int = 200):
    """A surface's answer: a dict as JSON, an iterator of bytes streamed as JSON."""
    if isinstance(body, dict):
        return JsonResponse(body, status=status)
    return StreamingHttpResponse(body, content_type="application/json", status=status)


def answer_with_status(status_and_body: tuple[int, dict]):
    status, body = status_and_body
    return answer(body, status)


class _SurfaceView(APIView):
    """Authenticated by relay key or token (request.user is the Principal); errors in the surface's envelope.

    Ownership is queryset scoping in the selectors: anyone but the owner gets the surface's 404.
    """

    content_negotiation_class = _AnyAccept
    authentication_classes = [RelayCredentialAuthentication]
    permission_classes = [OpenAIBatchAccess]
    # The surfaces this route serves, the one an id in no other's form belongs to last (a native batch is
    # addressed by its UUID), and the one that answers before an id or a body has said which.
    served = (Surface.OPENAI, Surface.NATIVE)
    before_known = Surface.OPENAI
    access_checked_methods = ("GET", "POST", "DELETE")

    def initial(self, request, *args, **kwargs):
        # Decided before authentication, so even a 401 comes in the surface's own envelope.
        self.speak(self.surface_of(kwargs))
        super().initial(request, *args, **kwargs)

    def speak(self, name: str) -> None:
        """From now on, answer as the surface `name`."""
        self.surface = registry.get(name)
        self.gated = self.surface.access_gated

    def surface_of(self, kwargs) -> str:
        batch_id = kwargs.get("batch_id")
        if batch_id is None:
            return self.before_known
        surfaces = [registry.get(name) for name in self.served]
        return next((s.name for s in surfaces if s.claims_id(batch_id)), self.served[-1])

    def handle_exception(self, exc):
        if not hasattr(self, "surface"):  # failed before initial(): answer as the route does before it knows
            self.speak(self.before_known)
        return super().handle_exception(self.surface.envelope(exc))

    def base_url(self, request) -> str:
        return request.build_absolute_uri("/v1/batches/")


# --- batches -------------------------------------------------------------------------------------


class BatchListView(_SurfaceView):
    access_checked_methods = ("GET",)  # create checks it once the body has said which surface it is

    def post(self, request):
        read = intake.receive(request._request, request.user, on_native=lambda: self.speak(Surface.NATIVE))
        if isinstance(read, Batch):  # native, stored as its body was read
            return answer_with_status(registry.get(read.surface).answer_created(read, self.base_url(request)))
        with read as submission:
            self.speak(intake.surface_of(submission.top))
            batch = self.surface.create(
                request.user, submission, idempotency_key=request.headers.get("Idempotency-Key", "").strip()
            )
        return answer_with_status(self.surface.answer_created(batch, self.base_url(request)))

    def get(self, request):
        return answer(self.surface.answer_page(request.user, request.GET, self.base_url(request)))


class BatchDetailView(_SurfaceView):
    def get(self, request, batch_id):
        return answer(self.surface.answer_detail(batch_id, request.user, self.base_url(request)))


class BatchResultsView(_SurfaceView):
    served = (Surface.NATIVE,)  # OpenAI-surface results are files

    def get(self, request, batch_id):
        return answer(self.surface.answer_results(batch_id, request.user))


class BatchCancelView(_SurfaceView):
    def post(self, request, batch_id):
        return answer(self.surface.answer_cancel(batch_id, request.user, self.base_url(request)))


class BatchRetryFailedView(_SurfaceView):
    """A new batch of the same surface re-running the batch's failed and expired records
    (docs/api/native.md and openai.md, "Re-run what failed")."""

    def post(self, request, batch_id):
        retried = retry.retry_failed(self.surface.find(batch_id, request.user), request.user)
        return answer_with_status(self.surface.answer_retried(retried, self.base_url(request)))


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
