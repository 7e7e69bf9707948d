"""The product's error envelope: {"error": {"type", "code", "message"}}.

Every relay-minted error goes through RelayError so status, code, message and
headers (`X-WR-Origin`, `Retry-After`) are set in one place.
"""

from django.http import JsonResponse
from rest_framework.views import exception_handler


class RelayError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        type: str | None = None,
        headers: dict | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.param = param  # the offending field (e.g. "messages[0].content"), when there is one
        self.status = status
        self.code = code
        self.message = message
        self.type = type or _default_type(status)
        self.headers = headers or {}

    def body(self) -> dict:
        err = {"type": self.type, "message": self.message}
        if self.code:
            err["code"] = self.code
        if self.param:
            err["param"] = self.param
        return {"error": err}

    def response(self) -> JsonResponse:
        resp = JsonResponse(self.body(), status=self.status)
        resp["X-WR-Origin"] = "relay"
        for name, value in self.headers.items():
            resp[name] = str(value)
        return resp


def _default_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


class AuthError(RelayError):
    """401 with the product's messages (`missing relay key`, `api key revoked`, …)."""

    def __init__(self, message: str, code: str = "unauthenticated"):
        super().__init__(401, code, message)


def bad_request(message: str, code: str = "invalid_request") -> RelayError:
    return RelayError(400, code, message)


def drf_exception_handler(exc, context):
    if isinstance(exc, RelayError):
        return exc.response()
    response = exception_handler(exc, context)
    if response is not None:
        detail = response.data.get("detail") if isinstance(response.data, dict) else response.data
        response.data = {"error": {"type": _default_type(response.status_code), "message": str(detail)}}
    return response
