"""Relay-native batch API (spec 000). Thin: authenticate, call one service or selector, answer."""

from django.http import JsonResponse, StreamingHttpResponse
from rest_framework.views import APIView

from batches import selectors, services
from relay.auth import authenticate


class BatchListView(APIView):
    def post(self, request):
        principal = authenticate(request)
        batch = services.submit_native(principal, request._request)
        return JsonResponse({"id": str(batch.id), "status": "queued", "total_items": batch.total_items}, status=202)


class BatchDetailView(APIView):
    def get(self, request, batch_id):
        batch = selectors.batch_for_owner(batch_id, authenticate(request))
        return JsonResponse(selectors.status_view(batch))


class BatchResultsView(APIView):
    def get(self, request, batch_id):
        batch = selectors.batch_for_owner(batch_id, authenticate(request))
        return StreamingHttpResponse(selectors.iter_results_json(batch), content_type="application/json")


class BatchCancelView(APIView):
    def post(self, request, batch_id):
        batch = selectors.batch_for_owner(batch_id, authenticate(request))
        services.cancel(batch)
        return JsonResponse({"status": "cancelled"})
