"""Upstream adapters: which paths a binding's adapter serves, and its auth headers.

The relay does not translate between shapes: a request is sent to a binding
whose adapter speaks the request's shape, byte for byte apart from `model`.
"""

from relay.models import Adapter

ANTHROPIC_VERSION = "2023-06-01"

# Inbound path → the adapter that must serve it.
PATH_ADAPTER = {
    "/v1/chat/completions": Adapter.OPENAI,
    "/v1/completions": Adapter.OPENAI,
    "/v1/embeddings": Adapter.OPENAI,
    "/v1/responses": Adapter.OPENAI_RESPONSES,
    "/v1/messages": Adapter.ANTHROPIC,
    # Anthropic's token counting: forwarded to an `anthropic` binding like a message (free there).
    "/v1/messages/count_tokens": Adapter.ANTHROPIC,
}

# Each inbound path is served bare and under these prefixes: the live routes (relay.api.inference,
# and relay.edge, which lets them skip the browser-session middleware).
LIVE_PREFIXES = ("", "openai/", "anthropic/")
LIVE_PATHS = frozenset(f"/{prefix}{path.lstrip('/')}" for path in PATH_ADAPTER for prefix in LIVE_PREFIXES)

# Headers of the caller that are forwarded (everything else, in particular the
# caller's credentials and X-WR-* headers, stays at the relay).
_FORWARDED = {"anthropic-version", "anthropic-beta", "openai-organization", "openai-project"}


def upstream_url(base_url: str, path: str) -> str:
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    return base + path


def upstream_headers(adapter: str, key_value: str, inbound_headers=None) -> dict:
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    for name, value in (inbound_headers or {}).items():
        if name.lower() in _FORWARDED:
            headers[name.lower()] = value
    if adapter == Adapter.ANTHROPIC:
        headers["x-api-key"] = key_value
        headers.setdefault("anthropic-version", ANTHROPIC_VERSION)
    else:
        headers["Authorization"] = f"Bearer {key_value}"
    return headers
