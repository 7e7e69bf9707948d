"""The Gemini API (Google AI Studio keys) through its OpenAI-compatible endpoint: the key in `x-goog-api-key`,
`chat/completions` and `embeddings` under `https://generativelanguage.googleapis.com/v1beta/openai/`, streamed
as OpenAI's server-sent events. Gemini's Batch API takes only Gemini's own request shape, which the relay does
not speak (it never translates a request), so batch records for a Gemini host run in the relay."""

import logging

from core.hostkinds.base import HostKind

log = logging.getLogger(__name__)


class GeminiKind(HostKind):
    name = "gemini"
    label = "gemini (Gemini API: x-goog-api-key, its OpenAI-compatible endpoint)"
    adapters = frozenset({"openai"})
    paths = frozenset({"/v1/chat/completions", "/v1/embeddings"})
    default_base_url = "https://generativelanguage.googleapis.com/v1beta/openai"

    def url(self, host, binding, path: str) -> str:
        return f"{host.base_url.rstrip('/')}/{path.removeprefix('/v1/')}"

    def auth_headers(self, key_value: str, *, key=None, body: bytes = b"", url: str = "") -> dict:
        return {"x-goog-api-key": key_value}
