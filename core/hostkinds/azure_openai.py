"""Azure OpenAI: the resource endpoint (`https://<resource>.openai.azure.com`) as the host's base URL, the host
key's value in the `api-key` header, deployments as the binding's `upstream_name`.

Chat Completions, Completions and Embeddings go to `/openai/deployments/{deployment}/{endpoint}?api-version=…`
(the host's `api_version`, Azure's latest GA data-plane version by default); Responses to Azure's v1 API,
`/openai/v1/responses`, which takes no api-version and the deployment as the body's `model` (the pipeline sends
`upstream_name` there). Azure's quota headers (`x-ratelimit-remaining-requests`, `-tokens`) say how much is left
but not when it comes back: its request quota is counted in 10-second windows and its token quota per minute,
so those are the resets the pacing is told (`learnable_headers`)."""

import logging
import re
from urllib.parse import quote

from core.hostkinds.base import OPENAI_PATHS, RESPONSES_PATHS, HostKind, Option

log = logging.getLogger(__name__)

# Azure OpenAI's latest generally available data-plane inference version (its REST reference's version table).
DEFAULT_API_VERSION = "2024-10-21"
_API_VERSION = re.compile(r"^\d{4}-\d{2}-\d{2}(-preview)?\Z")
# Azure's quota windows: requests are counted per 10 seconds (a sixth of the RPM), tokens per minute.
_RESETS = {"requests": "10s", "tokens": "60s"}


def _version_problem(value: str) -> str:
    if _API_VERSION.match(value):
        return ""
    return f"'api_version' {value!r} is not an Azure api-version such as {DEFAULT_API_VERSION} or 2025-04-01-preview"


class AzureOpenAIKind(HostKind):
    name = "azure_openai"
    label = "azure_openai (Azure OpenAI: api-key, deployments, api-version)"
    adapters = frozenset({"openai", "openai_responses"})
    paths = OPENAI_PATHS | RESPONSES_PATHS
    # Global Batch: OpenAI's Files + Batches on Azure's v1 API, on a Global-Batch deployment (the binding's
    # upstream_name) — gateway.batch_apis.azure.
    batch_api = "azure_openai"
    options = (Option("api_version", DEFAULT_API_VERSION, "Azure's api-version, such as 2024-10-21", _version_problem),)

    def url(self, host, binding, path: str) -> str:
        base = host.base_url.rstrip("/")
        if path in RESPONSES_PATHS:
            return f"{base}/openai/v1/responses"
        version = self.option_values(host.options)["api_version"]
        deployment = quote(binding.upstream_name, safe="")
        return f"{base}/openai/deployments/{deployment}/{path.removeprefix('/v1/')}?api-version={quote(version)}"

    def auth_headers(self, key_value: str, *, key=None, body: bytes = b"", url: str = "") -> dict:
        return {"api-key": key_value}

    def learnable_headers(self, headers: dict) -> dict:
        lower = {str(k).lower() for k in headers}
        for meter, reset in _RESETS.items():
            if f"x-ratelimit-remaining-{meter}" in lower and f"x-ratelimit-reset-{meter}" not in lower:
                headers[f"x-ratelimit-reset-{meter}"] = reset
        return headers
