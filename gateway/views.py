"""Inference-plane views that are not the pipeline itself."""

from rest_framework.response import Response
from rest_framework.views import APIView

from core.authentication import RelayCredentialAuthentication
from core.grants import granted
from core.models import HostBinding
from policies.models import Policy


class ModelsView(APIView):
    """GET /v1/models: the models the caller's policy grants and that have an enabled binding."""

    authentication_classes = [RelayCredentialAuthentication]

    def get(self, request):
        principal = request.user
        policy = Policy.objects.filter(pk=principal.policy_id).first() if principal.policy_id else None
        seen, data = set(), []
        if policy is not None and policy.enabled:
            bindings = HostBinding.objects.filter(enabled=True).select_related("model", "host").order_by("model__name")
            for b in bindings:
                if b.model.name not in seen and granted(policy.grants, b.model.provider, b.model.name, b.host.name):
                    seen.add(b.model.name)
                    data.append({"id": b.model.name, "object": "model", "owned_by": b.model.provider})
        return Response({"object": "list", "data": data})
