"""Upstream adapters: which paths a binding's adapter serves; URL and headers of a call, built by the host's kind.

The relay does not translate between shapes: a request is sent to a binding
whose adapter speaks the request's shape, byte for byte apart from `model`.
"""

from core import hostkinds
from core.errors import RelayError, quoted
from core.hostkinds.anthropic import ANTHROPIC_VERSION, BETA_HEADER, parse_betas
from core.hostkinds.base import base_of
from core.hostkinds.openai import account_headers as openai_account_headers
from core.models import Adapter, beta_price_problem

__all__ = ["ANTHROPIC_VERSION", "BETA_HEADER", "parse_betas"]

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

# Each inbound path is served bare and under these prefixes: the live routes (gateway.inference,
# and gateway.edge, which lets them skip the browser-session middleware).
LIVE_PREFIXES = ("", "openai/", "anthropic/")
LIVE_PATHS = frozenset(f"/{prefix}{path.lstrip('/')}" for path in PATH_ADAPTER for prefix in LIVE_PREFIXES)

# Caller headers that reach a provider: docs/api/live.md#headers-that-reach-a-provider. Each host kind says which
# (core.hostkinds: Anthropic's take `anthropic-version` and the `anthropic-beta` values the binding allows);
# everything else stays at the relay: the caller's credentials, X-WR-*, and the provider-account headers.
# OpenAI-Organization and OpenAI-Project choose which organization and project the operator's key bills, so they
# come from the host key (HostKey.openai_organization / openai_project), never from the caller; anthropic-beta
# turns on features that bill the operator's account, so a value passes only when the binding lists it
# (HostBinding.allowed_betas).
_BASE_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


def upstream_request(binding, path: str, key_value: str, body: bytes, inbound_headers=None, *, key=None):
    """(URL, headers, body) of one live call of relay path `path` through `binding`: its host's kind builds all three
    (the body in the kind's envelope: core.hostkinds.base.HostKind.request)."""
    kind = hostkinds.of(binding.host, binding.adapter)
    url, body = kind.request(binding.host, binding, path, body, betas=_betas(binding, inbound_headers))
    headers = {**_BASE_HEADERS, **kind.forwarded_headers(inbound_headers, binding)}
    headers.update(kind.call_headers(binding.host, key_value, key=key, body=body, url=url))
    return url, headers, body


def _betas(binding, inbound_headers) -> tuple:
    """The Anthropic betas a call asks for (check_betas has refused any its binding does not allow)."""
    if binding.adapter != Adapter.ANTHROPIC or not inbound_headers:
        return ()
    return tuple(b for name, v in inbound_headers.items() if name.lower() == BETA_HEADER for b in parse_betas(v))


def stream_reader(binding, stream):
    """A streamed answer's body as server-sent events in the provider's own shape (gateway.streaming reads it): as
    it came, unless the binding's host kind streams in another framing (Bedrock's AWS event stream)."""
    return hostkinds.of(binding.host, binding.adapter).stream_reader(stream)


def check_served(binding, path: str) -> None:
    """Refuse, before a key is picked, a call to an endpoint the binding's host kind does not serve live (the
    Gemini API has no Completions endpoint)."""
    kind = hostkinds.of(binding.host, binding.adapter)
    if kind.serves(binding.adapter, path):
        return
    served = ", ".join(sorted(p for p in kind.paths if PATH_ADAPTER.get(p) == binding.adapter)) or "none"
    raise RelayError(
        400,
        "unsupported_endpoint",
        f"model {binding.model.name} is served by a {kind.name} host, which does not serve {path} (it serves {served})",
    )


def learnable_headers(binding, headers: dict) -> dict:
    """An answer's headers as the provider-quota pacing reads them (the kind fills in what its provider omits)."""
    return hostkinds.of(binding.host, binding.adapter).learnable_headers(headers)


def upstream_url(base_url: str, path: str) -> str:
    """The URL of `path` on a host reached the native way (OpenAI's and Anthropic's batch APIs use it)."""
    return base_of(base_url) + path


def upstream_headers(adapter: str, key_value: str, inbound_headers=None, *, key=None, binding=None) -> dict:
    """The headers of one call to a provider reached the native way for `adapter` (or through `binding`'s host
    kind): the key's auth and account headers, and of the caller's only those the kind lets through."""
    kind = hostkinds.of(binding.host, adapter) if binding is not None else hostkinds.get(hostkinds.NATIVE[adapter])
    headers = {**_BASE_HEADERS, **kind.forwarded_headers(inbound_headers, binding)}
    headers.update(kind.auth_headers(key_value, key=key))
    return headers


def account_headers(adapter: str, key) -> dict:
    """The provider account a host key bills, as the provider's headers (live calls and provider batch jobs)."""
    return {} if adapter == Adapter.ANTHROPIC else openai_account_headers(key)


def check_betas(binding, inbound_headers) -> None:
    """Refuse, before a key is picked, a call whose `anthropic-beta` names a beta its binding does not allow.

    Refused rather than dropped: a beta changes what the provider does (a 1M context window, the Files API, MCP
    connectors), and a call run silently without it answers something other than what the caller asked for."""
    # No Anthropic provider behind a binding of another adapter: the header means nothing there and is not sent.
    asked = _betas(binding, inbound_headers)
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
