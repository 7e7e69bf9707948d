"""OpenAI itself: `Authorization: Bearer`, `/v1/...` under the host's base URL, the key's organization and project
as OpenAI's account headers, and OpenAI's Files + Batches API."""

import logging

from core.hostkinds.base import OPENAI_PATHS, RESPONSES_PATHS, HostKind, Option, base_of

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


def _count_problem(value: str) -> str:
    if value.isascii() and value.isdigit() and 0 < int(value) < 10**12:
        return ""
    return f"{value!r} is not a positive whole number"


class OpenAICompatibleKind(OpenAIKind):
    """Any server speaking OpenAI's wire at its own base URL (vLLM, Groq, Together, Fireworks…): bearer auth,
    `/v1/...` under the base URL. A binding in batch_mode provider or auto sends its batch records to an
    OpenAI-style Files + Batches API at the same base URL; a server without one (404/405 there) gets none:
    they run in the relay. Its limits per job are the host's settings (OpenAI's when not given)."""

    name = "openai_compatible"
    label = "openai_compatible (vLLM, Groq, Together…: OpenAI's wire at your base URL)"
    default_base_url = ""
    batch_api = "openai_compatible"
    options = (
        Option("batch_max_requests", "", "the most requests its Batch API takes in one job", _count_problem),
        Option("batch_max_bytes", "", "the largest input file (bytes) its Batch API takes", _count_problem),
    )
