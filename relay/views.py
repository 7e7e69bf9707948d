"""Gateway-level views: health."""

import logging

from django.db import connection
from rest_framework.response import Response
from rest_framework.views import APIView

from core.authentication import has_admin_token
from core.redis import get_redis

log = logging.getLogger(__name__)


class HealthView(APIView):
    """Database and Redis reachability: `{"status": "ok" | "error"}` (503 on "error") to anyone.

    Which check failed and why (an exception's text names internal hosts, ports and users) only with the
    admin token, as /metrics: `Authorization: Bearer <RELAY_ADMIN_TOKEN>`. A failure is logged either way."""

    def get(self, request):
        checks = {"database": _check(_db_ping), "redis": _check(lambda: get_redis().ping())}
        healthy = all(c["ok"] for c in checks.values())
        body = {"status": "ok" if healthy else "error"}
        if has_admin_token(request):
            body.update(checks)
        return Response(body, status=200 if healthy else 503)


def _db_ping():
    with connection.cursor() as cur:
        cur.execute("SELECT 1")


def _check(fn) -> dict:
    try:
        fn()
    except Exception as exc:  # any failure means "not reachable"; say why (to the operator only)
        log.warning("health check %s failed: %s", getattr(fn, "__name__", "check"), exc)
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"ok": True}
