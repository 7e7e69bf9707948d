"""Anthropic itself: `x-api-key` and `anthropic-version`, `/v1/messages` under the host's base URL, the caller's
`anthropic-version` and the `anthropic-beta` values its binding allows, and Anthropic's Message Batches API."""

import logging

from core.hostkinds.base import ANTHROPIC_PATHS, HostKind, base_of

log = logging.getLogger(__name__)

ANTHROPIC_VERSION = "2023-06-01"
BETA_HEADER = "anthropic-beta"


def parse_betas(value) -> list[str]:
    """`anthropic-beta: a,b` (repeated headers arrive joined by commas) → ["a", "b"]."""
    return [part.strip() for part in str(value or "").split(",") if part.strip()]


class AnthropicKind(HostKind):
    name = "anthropic"
    label = "anthropic (Anthropic: x-api-key, /v1/messages)"
    adapters = frozenset({"anthropic"})
    paths = ANTHROPIC_PATHS
    batch_api = "anthropic"
    default_base_url = "https://api.anthropic.com"

    def url(self, host, binding, path: str) -> str:
        return base_of(host.base_url) + path

    def auth_headers(self, key_value: str, *, key=None, body: bytes = b"", url: str = "") -> dict:
        return {"x-api-key": key_value, "anthropic-version": ANTHROPIC_VERSION}

    def forwarded_headers(self, inbound_headers, binding) -> dict:
        """The caller's `anthropic-version`, and of its `anthropic-beta` values those `binding` allows (the others
        were refused before a key was picked: gateway.adapters.check_betas)."""
        headers: dict = {}
        betas: list[str] = []
        for name, value in (inbound_headers or {}).items():
            lowered = name.lower()
            if lowered == "anthropic-version":
                headers[lowered] = value
            elif lowered == BETA_HEADER and binding is not None:
                betas += [b for b in parse_betas(value) if b in (binding.allowed_betas or ())]
        if betas:
            headers[BETA_HEADER] = ",".join(dict.fromkeys(betas))
        return headers
