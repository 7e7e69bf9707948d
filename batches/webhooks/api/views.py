"""Webhook endpoint routes (OpenAI's Webhook Endpoints API, so the `openai` SDK's `client.webhooks` works
unchanged), under /v1/ and /openai/v1/. Thin: authenticate, call one service or selector, answer.
Errors in the OpenAI surface's envelope; another owner's endpoint is a 404, as another owner's batch."""

from django.http import JsonResponse
from rest_framework.exceptions import APIException
from rest_framework.views import APIView

from batches.api.views import OpenAIBatchAccess, _AnyAccept
from batches.errors import OpenAIError
from batches.webhooks import events, selectors, services
from batches.webhooks.api import serialize
from core.authentication import RelayCredentialAuthentication
from core.errors import RelayError
from core.http import parse_json_object, read_body

# A webhook request body is a few fields.
MAX_BODY_BYTES = 64 * 1024


class _WebhookView(APIView):
    content_negotiation_class = _AnyAccept
    authentication_classes = [RelayCredentialAuthentication]
    permission_classes = [OpenAIBatchAccess]  # the batch API's own gate: its policy must grant batch access
    gated = True  # OpenAIBatchAccess checks it
    access_checked_methods = ("GET", "POST", "DELETE")

    def handle_exception(self, exc):
        if isinstance(exc, RelayError):
            exc = OpenAIError.of(exc)
        elif isinstance(exc, APIException):  # DRF's own, e.g. 405 for a method this route lacks
            exc = OpenAIError(exc.status_code, exc.default_code, str(exc.detail))
        return super().handle_exception(exc)

    @staticmethod
    def body(request, *, required: bool = True) -> dict:
        raw = read_body(request._request, MAX_BODY_BYTES)
        if not raw.strip() and not required:
            return {}
        return parse_json_object(raw)


class EndpointListView(_WebhookView):
    def post(self, request):
        endpoint, secret = services.create_endpoint(request.user, self.body(request))
        return JsonResponse(serialize.endpoint(endpoint, secret))

    def get(self, request):
        rows, has_more = selectors.endpoints_page(request.user, request.GET.get("after"), request.GET.get("limit"))
        return JsonResponse(serialize.page(rows, serialize.endpoint, has_more))


class EndpointDetailView(_WebhookView):
    def get(self, request, endpoint_id):
        return JsonResponse(serialize.endpoint(selectors.endpoint_for_owner(endpoint_id, request.user)))

    def post(self, request, endpoint_id):
        endpoint = selectors.endpoint_for_owner(endpoint_id, request.user)
        return JsonResponse(serialize.endpoint(services.update_endpoint(endpoint, self.body(request))))

    def delete(self, request, endpoint_id):
        endpoint = selectors.endpoint_for_owner(endpoint_id, request.user)
        services.delete_endpoint(endpoint)
        return JsonResponse({"id": endpoint_id, "object": "webhook_endpoint.deleted", "deleted": True})


class RotateSecretView(_WebhookView):
    def post(self, request, endpoint_id):
        endpoint = selectors.endpoint_for_owner(endpoint_id, request.user)
        endpoint, secret = services.rotate_secret(endpoint, self.body(request, required=False))
        return JsonResponse(serialize.endpoint(endpoint, secret))


class TestView(_WebhookView):
    def post(self, request, endpoint_id):
        """202 at once: the test delivery is queued on the webhook lane, never sent by a web thread. Its answer is
        read from the delivery it names (GET …/deliveries/{webhook_id})."""
        endpoint = selectors.endpoint_for_owner(endpoint_id, request.user)
        body = self.body(request)
        queued = services.send_test(endpoint, body)
        return JsonResponse(
            serialize.delivery(selectors.delivery_for_endpoint(endpoint, queued.webhook_id)), status=202
        )


class ResumeView(_WebhookView):
    def post(self, request, endpoint_id):
        endpoint = selectors.endpoint_for_owner(endpoint_id, request.user)
        services.resume(endpoint, by_owner=True)
        return JsonResponse(serialize.endpoint(endpoint))


class DeliveryListView(_WebhookView):
    def get(self, request, endpoint_id):
        endpoint = selectors.endpoint_for_owner(endpoint_id, request.user)
        params = request.GET
        rows, has_more = selectors.deliveries_page(endpoint, params.get("after"), params.get("limit"))
        return JsonResponse(serialize.page(rows, serialize.delivery, has_more))


class DeliveryDetailView(_WebhookView):
    def get(self, request, endpoint_id, delivery_id):
        endpoint = selectors.endpoint_for_owner(endpoint_id, request.user)
        return JsonResponse(serialize.delivery(selectors.delivery_for_endpoint(endpoint, delivery_id)))


class ResendView(_WebhookView):
    def post(self, request, endpoint_id, delivery_id):
        endpoint = selectors.endpoint_for_owner(endpoint_id, request.user)
        delivery = services.resend(selectors.delivery_for_endpoint(endpoint, delivery_id))
        return JsonResponse(serialize.delivery(selectors.delivery_for_endpoint(endpoint, delivery.webhook_id)))


class EventTypesView(_WebhookView):
    def get(self, request):
        return JsonResponse({"object": "list", "data": list(events.EVENT_TYPES)})
