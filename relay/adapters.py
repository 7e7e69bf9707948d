"""Upstream adapters: which paths a binding's adapter serves, and its auth headers.

The relay does not translate between shapes: a request is sent to a binding
whose adapter speaks the request's shape, byte for byte apart from `model`.
"""

from relay.errors import RelayError, quoted
from relay.models import Adapter, beta_price_problem

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

# Caller headers that reach an Anthropic provider (docs/api/live.md#headers-that-reach-a-provider). Everything
# else stays at the relay: the caller's credentials, X-WR-*, and the provider-account headers. OpenAI-Organization
# and OpenAI-Project choose which organization and project the operator's key bills, so they come from the host key
# (HostKey.openai_organization / openai_project), never from the caller; anthropic-beta turns on features that
# bill the operator's account, so a value passes only when the binding lists it (HostBinding.allowed_betas).
_FORWARDED = {"anthropic-version"}
BETA_HEADER = "anthropic-beta"


def upstream_url(base_url: str, path: str) -> str:
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    return base + path


def upstream_headers(adapter: str, key_value: str, inbound_headers=None, *, key=None, binding=None) -> dict:
    """The headers of one call to a provider: the key's auth and account headers, and of the caller's only
    `anthropic-version` and the `anthropic-beta` values `binding` allows (`check_betas` refused the others)."""
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    betas: list[str] = []
    for name, value in (inbound_headers or {}).items():
        lowered = name.lower()
        if lowered in _FORWARDED and adapter == Adapter.ANTHROPIC:
            headers[lowered] = value
        elif lowered == BETA_HEADER and binding is not None and adapter == Adapter.ANTHROPIC:
            betas += [b for b in parse_betas(value) if b in (binding.allowed_betas or ())]
    if betas:
        headers[BETA_HEADER] = ",".join(dict.fromkeys(betas))
    if adapter == Adapter.ANTHROPIC:
        headers["x-api-key"] = key_value
        headers.setdefault("anthropic-version", ANTHROPIC_VERSION)
    else:
        headers["Authorization"] = f"Bearer {key_value}"
    headers.update(account_headers(adapter, key))
    return headers


def account_headers(adapter: str, key) -> dict:
    """The provider account a host key bills, as the provider's headers (live calls and provider batch jobs)."""
    if key is None or adapter == Adapter.ANTHROPIC:
        return {}
    headers = {}
    if key.openai_organization:
        headers["OpenAI-Organization"] = key.openai_organization
    if key.openai_project:
        headers["OpenAI-Project"] = key.openai_project
    return headers


def parse_betas(value) -> list[str]:
    """`anthropic-beta: a,b` (repeated headers arrive joined by commas) → ["a", "b"]."""
    return [part.strip() for part in str(value or "").split(",") if part.strip()]


def check_betas(binding, inbound_headers) -> None:
    """Refuse, before a key is picked, a call whose `anthropic-beta` names a beta its binding does not allow.

    Refused rather than dropped: a beta changes what the provider does (a 1M context window, the Files API, MCP
    connectors), and a call run silently without it answers something other than what the caller asked for."""
    if binding.adapter != Adapter.ANTHROPIC:
        return  # no Anthropic provider behind it: the header means nothing there and is not sent
    asked = [b for name, v in (inbound_headers or {}).items() if name.lower() == BETA_HEADER for b in parse_betas(v)]
    if not asked:
        return
    allowed = set(binding.allowed_betas or ())
    pricing = binding.pricing if binding.pricing_id else None
    for beta in asked:
        if beta not in allowed:
            raise RelayError(
                400,
                "beta_not_allowed",
                f"anthropic-beta {quoted(beta)} is not enabled for {binding.model.name} on this relay "
                "(the operator lists the betas a model may use: allowed_betas in the catalog)",
            )
        if beta_price_problem(beta, pricing):
            raise RelayError(
                400,
                "beta_not_allowed",
                f"anthropic-beta {quoted(beta)} changes the price of {binding.model.name}, and its pricing on this "
                "relay has no long-context rates: the operator must price it before it can be used",
            )
