"""DEMO / TEST fakes of the clouds' OpenAI-wire endpoints, mounted by the demo upstream (relay.demo_upstream).

Each checks a call the way its provider does — its path scheme, its auth header, its refusals in its own error
shape — and hands what passes to the demo upstream as the OpenAI call it is, so the canned answers, streams,
scripted replies and rate limiting of the demo upstream serve the clouds too:

- Azure OpenAI: `/openai/deployments/{deployment}/{chat/completions|completions|embeddings}?api-version=…` and
  the v1 API `/openai/v1/{responses|chat/completions|embeddings}` (the deployment as the body's `model`);
  401 without `api-key` (or a bearer token), 404 without an api-version on the deployments path, 404
  `DeploymentNotFound` for a deployment the resource does not have; its answers carry Azure's quota headers
  (`x-ratelimit-remaining-requests`, `-tokens`, without the reset times Azure leaves out).
- Gemini API: `/v1beta/openai/{chat/completions|embeddings}`; 403 `PERMISSION_DENIED` without `x-goog-api-key`
  (or a bearer key), 404 for an endpoint its OpenAI-compatible surface does not have.
"""

import json
import logging
import re
import threading
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

AZURE_PREFIX = "/openai/"
GEMINI_PREFIX = "/v1beta/openai/"
# The deployments a fresh fake resource has (the demo catalog's and the tests' Azure bindings name these).
DEMO_DEPLOYMENTS = ("gpt-4o-mini", "gpt-4.1-mini", "text-embedding-3-small")
_DEPLOYMENT_PATH = re.compile(r"^/openai/deployments/([^/]+)/(chat/completions|completions|embeddings)\Z")
_AZURE_V1 = {"/openai/v1/responses", "/openai/v1/chat/completions", "/openai/v1/embeddings"}
_GEMINI_ENDPOINTS = {"chat/completions", "embeddings"}
# Azure's quota per key in the fake: requests per 10-second window, tokens per minute (counted down, never reset:
# the fake only says what is left, as Azure does).
AZURE_REQUESTS = 1000
AZURE_TOKENS = 1_000_000


@dataclass
class Admission:
    """What the fake made of a cloud call: the OpenAI path it asks for and the key it used, or its refusal."""

    path: str = ""
    key: str = ""
    refusal: tuple[int, dict] | None = None
    headers: dict = field(default_factory=dict)  # sent with the answer


def _azure_error(status: int, code: str, message: str) -> tuple[int, dict]:
    return status, {"error": {"code": code, "message": message}}


def _google_error(status: int, state: str, message: str) -> tuple[int, dict]:
    return status, {"error": {"code": status, "message": message, "status": state}}


class Clouds:
    def __init__(self):
        self.lock = threading.Lock()
        self.azure_deployments: set[str] = set(DEMO_DEPLOYMENTS)
        self.azure_used: dict[str, int] = {}

    def reset(self) -> None:
        with self.lock:
            self.azure_deployments = set(DEMO_DEPLOYMENTS)
            self.azure_used.clear()

    def handles(self, raw_path: str) -> bool:
        path = urlsplit(raw_path).path
        return path.startswith(AZURE_PREFIX) or path.startswith(GEMINI_PREFIX)

    def admit(self, raw_path: str, headers, body: dict) -> Admission:
        url = urlsplit(raw_path)
        if url.path.startswith(GEMINI_PREFIX):
            return self._gemini(url.path, headers)
        return self._azure(url.path, parse_qs(url.query), headers, body)

    def _azure(self, path: str, query: dict, headers, body: dict) -> Admission:
        key = headers.get("api-key") or headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not key:
            return Admission(
                refusal=_azure_error(
                    401,
                    "401",
                    "Access denied due to invalid subscription key or wrong API endpoint. Make sure to provide a "
                    "valid key for an active subscription and use a correct regional API endpoint for your resource.",
                )
            )
        match = _DEPLOYMENT_PATH.match(path)
        if match:
            if not query.get("api-version"):
                return Admission(key=key, refusal=_azure_error(404, "404", "Resource not found"))
            deployment, endpoint = match.groups()
        elif path in _AZURE_V1:
            deployment, endpoint = str(body.get("model") or ""), path.removeprefix("/openai/v1/")
        else:
            return Admission(key=key, refusal=_azure_error(404, "404", "Resource not found"))
        with self.lock:
            known = deployment in self.azure_deployments
            used = self.azure_used[key] = self.azure_used.get(key, 0) + 1
        if not known:
            return Admission(
                key=key,
                refusal=_azure_error(
                    404,
                    "DeploymentNotFound",
                    "The API deployment for this resource does not exist. If you created the deployment within "
                    "the last 5 minutes, please wait a moment and try again.",
                ),
            )
        quota = {
            "x-ratelimit-remaining-requests": max(0, AZURE_REQUESTS - used),
            "x-ratelimit-remaining-tokens": max(0, AZURE_TOKENS - 100 * used),
        }
        return Admission(path=f"/v1/{endpoint}", key=key, headers=quota)

    def _gemini(self, path: str, headers) -> Admission:
        key = headers.get("x-goog-api-key") or headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not key:
            return Admission(
                refusal=_google_error(
                    403,
                    "PERMISSION_DENIED",
                    "Method doesn't allow unregistered callers (callers without established identity). Please use "
                    "API Key or other form of API consumer identity to call this API.",
                )
            )
        endpoint = path.removeprefix(GEMINI_PREFIX)
        if endpoint not in _GEMINI_ENDPOINTS:
            return Admission(key=key, refusal=_google_error(404, "NOT_FOUND", f"no such method: {endpoint}"))
        return Admission(path=f"/v1/{endpoint}", key=key)

    @staticmethod
    def refuse(handler, refusal: tuple[int, dict]) -> None:
        status, answer = refusal
        payload = json.dumps(answer).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)
