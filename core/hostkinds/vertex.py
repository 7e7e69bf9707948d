"""Google Vertex AI: Claude through rawPredict / streamRawPredict, OpenAI-shaped models (Gemini, the model garden's
Llama, Qwen, DeepSeek…) through Vertex's OpenAI-compatible endpoint, every call with an OAuth2 access token minted
from a service account.

URLs. The host's base URL is the API root: left out, Google's, `https://aiplatform.googleapis.com`, which the
region turns into the regional endpoint (`https://{region}-aiplatform.googleapis.com`) unless the region is
`global` (the global endpoint has no region in its host). Under it:
- Claude (adapter `anthropic`):
  `/v1/projects/{project}/locations/{region}/publishers/anthropic/models/{model}:rawPredict`
  (`:streamRawPredict` for a call with `stream: true`), the binding's `upstream_name` being Vertex's model id
  (`claude-sonnet-4@20250514`); token counting at `.../models/count-tokens:rawPredict` with the model in the body.
  Vertex takes Anthropic's Messages body in its own envelope, as Bedrock does: no `model` (it is in the path) and
  `anthropic_version: vertex-2023-10-16` in the body; `stream` stays. Betas the binding allows go as the
  `anthropic-beta` header. Answers (and the stream's server-sent events) are Anthropic's own.
- OpenAI-shaped models (adapter `openai`): `/v1/projects/{project}/locations/{region}/endpoints/openapi/
  chat/completions` (and `embeddings`), the model in the body as the binding's `upstream_name`, which Vertex
  wants publisher-qualified (`google/gemini-2.0-flash-001`).
Errors Vertex makes itself (auth, quota, a model not enabled) are Google's (`{"error": {"code", "message",
"status"}}`, sometimes inside a one-element array); a quota answer is 429 RESOURCE_EXHAUSTED, without Retry-After,
which the relay handles as every provider's 429 (it reads the status, not the body).

Credentials: the host key's value is the service account's JSON key (encrypted, or read from a RELAY_HOSTKEY_*
variable). Access tokens are minted from it with google-auth (a JWT signed with the key, exchanged at the
account's `token_uri`, or at the host's `token_url` when given) and kept per key in the process until a few
minutes before they expire (google-auth's own margin), one mint at a time per key. A token and the account's
private key are remembered by the scrubber (core.scrub) before a call carries them, and never logged. Minting
fails as a connection would (an UpstreamError, `unreachable`): the key is benched, the next key tried.

Batch: `gcs_bucket` (and `gcs_prefix`) name where the provider batch API (gateway.batch_apis.vertex) puts a
job's input and finds its output; Claude batches need a regional location."""

import hashlib
import json
import logging
import os
import re
import threading
from urllib.parse import quote, urlsplit

from core.hostkinds import base
from core.hostkinds.anthropic import BETA_HEADER, parse_betas
from core.hostkinds.base import ANTHROPIC_PATHS, HostKind, Option, base_of
from core.upstream_types import UpstreamError

log = logging.getLogger(__name__)

VERTEX_ANTHROPIC_VERSION = "vertex-2023-10-16"
SCOPE = "https://www.googleapis.com/auth/cloud-platform"
GOOGLE_API_ROOT = "https://aiplatform.googleapis.com"
DEFAULT_REGION = "us-east5"  # a region serving Claude, online and in batch
DEFAULT_STORAGE_URL = "https://storage.googleapis.com"
OPENAPI_PATHS = frozenset({"/v1/chat/completions", "/v1/embeddings"})
# The token endpoint's whole answer within this many seconds; google-auth retries a 5xx itself.
TOKEN_TIMEOUT = 15.0
_MAX_CACHED = 256

_PROJECT = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]\Z")
_REGION = re.compile(r"^(global|[a-z]+-[a-z]+\d+)\Z")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]\Z")
_PREFIX = re.compile(r"^[A-Za-z0-9._/-]{1,200}\Z")


def _project_problem(value: str) -> str:
    return (
        "" if _PROJECT.match(value) else f"'project' {value!r} is not a Google Cloud project id such as my-project-123"
    )


def _region_problem(value: str) -> str:
    return "" if _REGION.match(value) else f"'region' {value!r} is not a Vertex AI location such as us-east5 or global"


def _bucket_problem(value: str) -> str:
    return "" if _BUCKET.match(value) else f"'gcs_bucket' {value!r} is not a Cloud Storage bucket name"


def _prefix_problem(value: str) -> str:
    if _PREFIX.match(value) and ".." not in value.split("/") and not value.startswith("/"):
        return ""
    return f"'gcs_prefix' {value!r} must be a relative object path (letters, digits, . _ - /)"


def _url_problem(name: str):
    def problem(value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme in ("http", "https") and parts.hostname:
            return ""
        return f"'{name}' {value!r} is not an http(s) URL"

    return problem


class VertexKind(HostKind):
    name = "vertex"
    label = "vertex (Google Vertex AI: service-account OAuth2, rawPredict, its OpenAI endpoint)"
    adapters = frozenset({"anthropic", "openai"})
    paths = ANTHROPIC_PATHS | OPENAPI_PATHS
    batch_api = "vertex"
    default_base_url = GOOGLE_API_ROOT
    options = (
        Option("project", "", "the Google Cloud project id the calls bill", _project_problem),
        Option("region", DEFAULT_REGION, "the Vertex AI location: us-east5, europe-west1…, or global", _region_problem),
        Option("gcs_bucket", "", "the Cloud Storage bucket of provider batch jobs' input and output", _bucket_problem),
        Option("gcs_prefix", "relay", "the object path under the bucket for batch jobs", _prefix_problem),
        Option("storage_url", DEFAULT_STORAGE_URL, "the Cloud Storage JSON API's root", _url_problem("storage_url")),
        Option(
            "token_url",
            "",
            "the OAuth2 token endpoint; default: the service account's token_uri",
            _url_problem("token_url"),
        ),
    )

    def options_problem(self, options) -> str:
        problem = super().options_problem(options)
        if problem or options.get("project"):
            return problem
        return "'project' is required: the Google Cloud project id whose Vertex AI the calls use"

    # --- where calls go ----------------------------------------------------------------------------------

    def settings(self, host) -> dict:
        return self.option_values(host.options)

    def api_root(self, host) -> str:
        """The API root of `host`: its base URL, Google's global one made regional for a regional location."""
        base = base_of(host.base_url)
        region = self.settings(host)["region"]
        if urlsplit(base).hostname == urlsplit(GOOGLE_API_ROOT).hostname and region != "global":
            return f"https://{region}-aiplatform.googleapis.com"
        return base

    def location_url(self, host) -> str:
        """`{root}/v1/projects/{project}/locations/{region}`: what every Vertex resource of the host is under."""
        settings = self.settings(host)
        return f"{self.api_root(host)}/v1/projects/{settings['project']}/locations/{settings['region']}"

    def url(self, host, binding, path: str, *, streamed: bool = False) -> str:
        if path in OPENAPI_PATHS:
            return f"{self.location_url(host)}/endpoints/openapi/{path.removeprefix('/v1/')}"
        if path == "/v1/messages/count_tokens":
            return f"{self.location_url(host)}/publishers/anthropic/models/count-tokens:rawPredict"
        action = "streamRawPredict" if streamed else "rawPredict"
        model = quote(binding.upstream_name, safe="@")
        return f"{self.location_url(host)}/publishers/anthropic/models/{model}:{action}"

    def request(self, host, binding, path: str, body: bytes, betas=()) -> tuple[str, bytes]:
        if path not in ANTHROPIC_PATHS:
            return self.url(host, binding, path), body  # OpenAI's shape as it is: the model in the body
        try:
            fields = json.loads(body)
        except ValueError:
            return self.url(host, binding, path), body  # not JSON: Vertex answers its own 400
        if not isinstance(fields, dict):
            return self.url(host, binding, path), body
        streamed = fields.get("stream") is True
        if path == "/v1/messages":
            fields.pop("model", None)  # the model is the path; count-tokens keeps it (its path names none)
        fields.setdefault("anthropic_version", VERTEX_ANTHROPIC_VERSION)
        return self.url(host, binding, path, streamed=streamed), json.dumps(fields).encode()

    def forwarded_headers(self, inbound_headers, binding) -> dict:
        """The `anthropic-beta` values the binding allows (the version is the body's `anthropic_version`)."""
        if binding is None or binding.adapter != "anthropic":
            return {}
        betas: list[str] = []
        for name, value in (inbound_headers or {}).items():
            if name.lower() == BETA_HEADER:
                betas += [b for b in parse_betas(value) if b in (binding.allowed_betas or ())]
        return {BETA_HEADER: ",".join(dict.fromkeys(betas))} if betas else {}

    # --- credentials -------------------------------------------------------------------------------------

    def call_headers(self, host, key_value: str, *, key=None, body: bytes = b"", url: str = "") -> dict:
        token = access_token(key_value, self.settings(host)["token_url"])
        return {"Authorization": f"Bearer {token}"}

    def auth_headers(self, key_value: str, *, key=None, body: bytes = b"", url: str = "") -> dict:
        return {"Authorization": f"Bearer {access_token(key_value)}"}


# --- access tokens: minted per service account, kept until near their expiry ----------------------------------


class _Account:
    """One service account's credentials (google-auth's), refreshed under its own lock."""

    def __init__(self, credentials, email: str):
        self.credentials = credentials
        self.email = email
        self.lock = threading.Lock()


_accounts: dict[str, _Account] = {}
_accounts_lock = threading.Lock()
_accounts_pid: int | None = None


def access_token(key_value: str, token_url: str = "") -> str:
    """A valid access token of the service account whose JSON key is `key_value`: the one kept, or a new one
    minted at its token endpoint (`token_url`, else the key's `token_uri`). Raises UpstreamError (unreachable)
    when none can be had, naming the account, never the key."""
    account = _account(key_value, token_url)
    with account.lock:
        if not account.credentials.valid:
            _refresh(account)
        token = account.credentials.token
    base.remember_secret(token)  # a provider (or a log line) echoing it gets it scrubbed
    return token


def forget_tokens() -> None:
    """Tests: every kept token and account dropped (the next call mints again)."""
    with _accounts_lock:
        _accounts.clear()


def _account(key_value: str, token_url: str) -> _Account:
    global _accounts_pid
    ident = hashlib.sha256(f"{token_url}\n{key_value}".encode()).hexdigest()
    with _accounts_lock:
        if _accounts_pid != os.getpid():  # a forked child: a lock held at the fork would never be released
            _accounts.clear()
            _accounts_pid = os.getpid()
        account = _accounts.get(ident)
        if account is not None:
            return account
    account = _new_account(key_value, token_url)
    with _accounts_lock:
        if len(_accounts) >= _MAX_CACHED:
            _accounts.pop(next(iter(_accounts)))
        return _accounts.setdefault(ident, account)


def _new_account(key_value: str, token_url: str) -> _Account:
    from google.oauth2 import service_account

    try:
        info = json.loads(key_value)
    except ValueError:
        info = None
    if not isinstance(info, dict) or not isinstance(info.get("private_key"), str):
        raise UpstreamError("unreachable", "the host key's value is not a Google service-account key (its JSON)")
    _remember_private_key(info["private_key"])
    email = str(info.get("client_email") or "")
    try:
        credentials = service_account.Credentials.from_service_account_info(info, scopes=[SCOPE])
    except (ValueError, TypeError, KeyError) as exc:
        # The library's words name missing fields or a key it cannot load, never the key's bytes.
        raise UpstreamError(
            "unreachable",
            f"the service-account key of {email or 'an unnamed account'} cannot be used: {type(exc).__name__}",
        ) from None
    if token_url:
        credentials = credentials.with_token_uri(token_url)
    return _Account(credentials, email)


def _remember_private_key(pem: str) -> None:
    """Each line of the private key's base64 body: every way of quoting the key (the PEM as written, escaped
    in JSON, unwrapped, in part) holds them, so none of it is left. (The whole key is longer than each line,
    and the scrubber's matcher grows with the length of what it knows.)"""
    for line in pem.splitlines():
        if line.strip() and not line.startswith("-----"):
            base.remember_secret(line.strip())


def _refresh(account: _Account) -> None:
    from google.auth import exceptions

    try:
        account.credentials.refresh(_TokenRequest())
    except exceptions.RefreshError as exc:
        # RFC 6749's error and description (`invalid_grant: Invalid JWT Signature.`): the endpoint's words.
        reason = str(exc.args[0] if exc.args else exc)[:200]
        raise UpstreamError(
            "unreachable",
            f"no access token for {account.email}: {reason}",  # scrubbed where it leaves (events, logs)
        ) from None
    except exceptions.TransportError as exc:
        raise UpstreamError("unreachable", f"the token endpoint of {account.email} is unreachable: {exc}") from None
    log.info("minted a Vertex AI access token for %s (valid until %s UTC)", account.email, account.credentials.expiry)


# --- the token endpoint's transport -----------------------------------------------------------------------------
# google-auth posts the signed assertion through a callable it is handed: here, the relay's one HTTP choke point
# (gateway.upstream, lent to the kinds through base.post), with its timeouts and keep-alive pool.


class _TokenResponse:
    def __init__(self, resp):
        self.status = resp.status
        self.headers = resp.headers
        self.data = resp.body


class _TokenRequest:
    """google.auth.transport.Request over the relay's choke point (POST only: the JWT-bearer exchange)."""

    def __call__(self, url, method="POST", body=None, headers=None, timeout=None, **kwargs):
        from google.auth import exceptions

        if isinstance(body, str):
            body = body.encode()
        try:
            resp = base.post(url, dict(headers or {}), body or b"", TOKEN_TIMEOUT)
        except UpstreamError as exc:
            raise exceptions.TransportError(f"{exc.kind} reaching {urlsplit(url).netloc}") from None
        return _TokenResponse(resp)
