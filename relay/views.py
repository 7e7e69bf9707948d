"""Gateway-level views: health."""

from django.db import connection
from rest_framework.response import Response
from rest_framework.views import APIView

from relay.redis import get_redis


class HealthView(APIView):
    """Reports database and Redis reachability; 503 when either is down."""

    def get(self, request):
        checks = {"database": _check(_db_ping), "redis": _check(lambda: get_redis().ping())}
        healthy = all(c["ok"] for c in checks.values())
        return Response({"status": "ok" if healthy else "degraded", **checks}, status=200 if healthy else 503)


def _db_ping():
    with connection.cursor() as cur:
        cur.execute("SELECT 1")


def _check(fn) -> dict:
    try:
        fn()
    except Exception as exc:  # any failure means "not reachable"; say why
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"ok": True}
