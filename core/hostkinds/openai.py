"""OpenAI itself: `Authorization: Bearer`, `/v1/...` under the host's base URL, the key's organization and project
as OpenAI's account headers, and OpenAI's Files + Batches API."""

import logging

from core.hostkinds.base import OPENAI_PATHS, RESPONSES_PATHS, HostKind, base_of

log = logging.getLogger(__name__)


def account_headers(key) -> dict:
    """The OpenAI account a host key bills (OpenAI-Organization / OpenAI-Project): the operator's choice."""
    if key is None:
        return {}
    headers = {}
    if getattr(key, "openai_organization", ""):
        headers["OpenAI-Organization"] = key.openai_organization
    if getattr(key, "openai_project", ""):
        headers["OpenAI-Project"] = key.openai_project
    return headers


class OpenAIKind(HostKind):
    name = "openai"
    label = "openai (OpenAI: Bearer key, /v1/…)"
    adapters = frozenset({"openai", "openai_responses"})
    paths = OPENAI_PATHS | RESPONSES_PATHS
    batch_api = "openai"
    default_base_url = "https://api.openai.com"

    def url(self, host, binding, path: str) -> str:
        return base_of(host.base_url) + path

    def auth_headers(self, key_value: str, *, key=None, body: bytes = b"", url: str = "") -> dict:
        return {"Authorization": f"Bearer {key_value}", **account_headers(key)}


class OpenAICompatibleKind(OpenAIKind):
    """Any server speaking OpenAI's wire at its own base URL (vLLM, Groq, Together, Fireworks…): bearer auth,
    `/v1/...` under the base URL. Its batch records may go to an OpenAI-style Files + Batches API at the same
    base URL (a provider that has one); by default they run in the relay."""

    name = "openai_compatible"
    label = "openai_compatible (vLLM, Groq, Together…: OpenAI's wire at your base URL)"
    default_base_url = ""
