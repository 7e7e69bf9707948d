"""What every host kind has in common: the `HostKind` interface the pipeline and `relay apply` ask.

A host kind is how a host is reached: its URL scheme, its auth, the binding adapters (request shapes) and the
endpoints it serves live, its streaming wire, its own settings, and — where the provider has one — the name of
its batch API in the provider-batch registry (gateway.batch_apis.REGISTRY). Nothing outside this package
compares kind names: callers ask the kind. Imports nothing of the relay: the kinds sit below the catalog models."""

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

# The relay's inbound endpoints each adapter answers (gateway.adapters.PATH_ADAPTER maps them back).
OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
RESPONSES_PATHS = frozenset({"/v1/responses"})
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


# Secrets a kind makes or reads on its own (a minted access token, the lines of a service account's private key):
# each is handed to every sink before a call carries it. The scrubber registers itself here from the core app's
# ready(); it sits above the kinds (it reads the catalog's models), so the kinds cannot import it.
_secret_sinks: list = []


def on_secret(sink) -> None:
    """Register `sink(value)`, called with each secret a kind makes (core.apps: the scrubber's `remember`)."""
    if sink not in _secret_sinks:
        _secret_sinks.append(sink)


def remember_secret(value: str) -> None:
    for sink in _secret_sinks:
        sink(value)


# How a kind reaches a URL of its own that is not the provider's API (Vertex's OAuth2 token endpoint): through the
# relay's one HTTP choke point, which the gateway registers from its ready() (it sits above the kinds).
_transport = None


def use_transport(post) -> None:
    """Register `post(url, headers, body, timeout) -> UpstreamResponse` (gateway.apps: gateway.upstream.call)."""
    global _transport
    _transport = post


def post(url: str, headers: dict, body: bytes, timeout: float):
    """POST through the registered choke point; UpstreamError on no answer."""
    if _transport is None:
        raise RuntimeError("no HTTP transport registered for the host kinds (the gateway app is not loaded)")
    return _transport(url, headers, body, timeout)


@dataclass(frozen=True)
class Option:
    """A host setting a kind takes (written flat on the host's catalog entry, stored in `Host.options`)."""

    name: str
    default: str
    help: str
    # Whether a value is acceptable ("" when it is, else why not).
    check: object = None

    def problem(self, value) -> str:
        if not isinstance(value, str) or not value or len(value) > 200:
            return f"'{self.name}' must be a non-empty string ({self.help})"
        return self.check(value) if self.check is not None else ""


class HostKind:
    """One way of reaching a provider. Subclasses set the class attributes and override what differs."""

    name: str = ""
    label: str = ""
    # The binding adapters (request shapes) this kind serves live, and of those the inbound paths it answers.
    adapters: frozenset = frozenset()
    paths: frozenset = frozenset()
    # The streaming wire of its answers: "sse" (server-sent events, relayed as they come). A kind whose provider
    # streams another framing (AWS event streams) names it here and turns it back into SSE in `stream_reader`.
    stream_wire: str = "sse"
    # Whether `headers` needs the request's body and URL (a signature over them, as SigV4 is).
    signs_body: bool = False
    # The key of this kind's batch API in the provider-batch registry; None: its batch records run in the relay.
    batch_api: str | None = None
    # The base URL a host of this kind gets when its catalog entry gives none ("" : it must give one).
    default_base_url: str = ""
    options: tuple = ()

    # --- what a live call asks ---------------------------------------------------------------------------

    def serves(self, adapter: str, path: str) -> bool:
        return adapter in self.adapters and path in self.paths

    def url(self, host, binding, path: str) -> str:
        """The provider URL of relay path `path` (`/v1/chat/completions`) for `binding` on `host`."""
        raise NotImplementedError

    def request(self, host, binding, path: str, body: bytes, betas=()) -> tuple[str, bytes]:
        """The URL and the bytes sent for one call: `url()` and the body as the pipeline made it. A kind whose
        provider takes the same shape in another envelope (Bedrock: the model in the path, not the body) says so.
        `betas`: the call's Anthropic betas (already allowed by its binding); a kind whose provider takes them in the
        body rather than the `anthropic-beta` header (Bedrock's `anthropic_beta`) puts them there."""
        return self.url(host, binding, path), body

    def auth_headers(self, key_value: str, *, key=None, body: bytes = b"", url: str = "") -> dict:
        """The credential headers of one call (a signing kind signs `body` sent to `url`)."""
        raise NotImplementedError

    def call_headers(self, host, key_value: str, *, key=None, body: bytes = b"", url: str = "") -> dict:
        """The credential headers of one live call to `host`: `auth_headers`, unless the kind's signature needs the
        host's own settings (Bedrock: the access key id and the region)."""
        return self.auth_headers(key_value, key=key, body=body, url=url)

    def stream_reader(self, stream):
        """The open upstream stream (`read()`, `more_waiting()`, `close()`, `status`, `headers`) as one whose
        `read()` gives server-sent events in the provider's own shape. Default: as it is (the provider's are SSE)."""
        return stream

    def forwarded_headers(self, inbound_headers, binding) -> dict:
        """The caller's headers that reach this provider (none unless a kind says so)."""
        return {}

    def learnable_headers(self, headers: dict) -> dict:
        """The answer's headers as the provider-quota pacing reads them (policies.provider_limits): a kind whose
        provider leaves something out that the pacing needs fills it in here. Default: as they came."""
        return headers

    # --- the catalog -------------------------------------------------------------------------------------

    def option_values(self, options) -> dict:
        """The host's settings with this kind's defaults for those not given."""
        given = options if isinstance(options, dict) else {}
        return {o.name: given.get(o.name, o.default) for o in self.options}

    def options_problem(self, options) -> str:
        """Why `options` are not this kind's settings ("" when they are)."""
        if not isinstance(options, dict):
            return "must be a mapping of setting → value"
        names = [o.name for o in self.options]
        unknown = sorted(set(options) - set(names))
        if unknown:
            takes = f"it takes: {', '.join(names)}" if names else "it takes none"
            return f"{', '.join(unknown)} is not a setting of a {self.name} host ({takes})"
        for option in self.options:
            if option.name in options:
                problem = option.problem(options[option.name])
                if problem:
                    return problem
        return ""

    def adapter_problem(self, adapter: str) -> str:
        if adapter in self.adapters:
            return ""
        return f"a {self.name} host serves adapter {' or '.join(sorted(self.adapters))}, not {adapter}"

    def batch_mode_problem(self, batch_mode: str) -> str:
        if batch_mode == "relay" or self.batch_api is not None:
            return ""
        return (
            f"a {self.name} host has no batch API the relay speaks: its batch records run in the relay "
            "(batch_mode: relay)"
        )


def base_of(base_url: str) -> str:
    """The base URL without its trailing slash and a trailing `/v1` (the relay's paths carry `/v1`)."""
    base = base_url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def endpoint_of(path: str) -> str:
    """`/v1/chat/completions` → `chat/completions`: the endpoint under a provider's own prefix."""
    return path.removeprefix("/v1/")


# Never a provider secret's variable, whatever the prefix is set to.
_RELAY_OWN_SECRETS = frozenset(
    {"RELAY_MASTER_KEY", "RELAY_ADMIN_TOKEN", "SECRET_KEY", "DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL"}
)


def env_problem(name: str) -> str:
    """Why the relay may not read environment variable `name` as a provider secret ("" when it may): a host key's
    value_env and a kind's secret settings (a Bedrock host's session token) alike. Only the operator-declared
    prefix (RELAY_HOSTKEY_ENV_PREFIX), never the relay's own secrets."""
    from django.conf import settings

    if not name:
        return ""
    prefix = settings.RELAY_HOSTKEY_ENV_PREFIX
    if not name.startswith(prefix) or len(name) == len(prefix):
        return f"environment variable {name} does not start with {prefix} (RELAY_HOSTKEY_ENV_PREFIX)"
    if name in _RELAY_OWN_SECRETS:
        return f"environment variable {name} holds one of the relay's own secrets"
    return ""
