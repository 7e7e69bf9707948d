"""DRF authentication classes: who is calling, decided once per request before the view runs.

- `RelayCredentialAuthentication`: a relay key or an inference token (core.auth);
  `request.user` is the `Principal`. A missing or bad credential raises the
  product's 401 (AuthError), which each surface answers in its own envelope.
  `LiveCredentialAuthentication`: the same for the live routes, from the held catalog snapshot.
- `AdminTokenAuthentication`: `Authorization: Bearer <RELAY_ADMIN_TOKEN>`; `request.user` is `OPERATOR`.
- `StaffSessionAuthentication`: a staff user's admin session; anyone else's session is ignored.
"""

import hmac

from django.conf import settings
from rest_framework.authentication import BaseAuthentication, SessionAuthentication

from core import auth, catalog
from core.errors import AuthError


class Operator:
    """The relay's operator: sees every tenant's data on the control-plane APIs."""

    is_operator = True

    def __repr__(self) -> str:
        return "<operator>"


OPERATOR = Operator()


class RelayCredentialAuthentication(BaseAuthentication):
    def authenticate(self, request):
        return auth.authenticate(request), None

    def authenticate_header(self, request):
        return "Bearer"


class LiveCredentialAuthentication(RelayCredentialAuthentication):
    """The live routes': a relay key's row from the catalog snapshot this process holds, with no
    round trip. `request.auth` is that snapshot; the pipeline's key pick confirms its generation
    and authenticates again when it is stale (gateway.pipeline)."""

    def authenticate(self, request):
        snapshot = catalog.held()
        try:
            return auth.authenticate(request, snapshot), snapshot
        except AuthError:
            # A refusal from a held snapshot is confirmed against the current one (a key re-enabled
            # elsewhere a moment ago is not refused from a stale cache).
            fresh = catalog.current()
            if fresh is None or fresh is snapshot:
                raise
            return auth.authenticate(request, fresh), fresh


class AdminTokenAuthentication(BaseAuthentication):
    def authenticate(self, request):
        return (OPERATOR, None) if has_admin_token(request) else None


class StaffSessionAuthentication(SessionAuthentication):
    def authenticate(self, request):
        result = super().authenticate(request)
        if result is None or not (result[0].is_active and result[0].is_staff):
            return None
        return OPERATOR, None


def has_admin_token(request) -> bool:
    presented = auth.authorization_bearer(request.headers)
    # Bytes, because compare_digest refuses non-ASCII str and a header may carry any.
    return bool(presented and settings.RELAY_ADMIN_TOKEN) and hmac.compare_digest(
        presented.encode(), settings.RELAY_ADMIN_TOKEN.encode()
    )
