"""DEMO / TEST fakes of the clouds' OpenAI-wire endpoints, mounted by the demo upstream (devkit.upstream).

Each checks a call the way its provider does — its path scheme, its auth header, its refusals in its own error
shape — and hands what passes to the demo upstream as the OpenAI call it is, so the canned answers, streams,
scripted replies and rate limiting of the demo upstream serve the clouds too:

- Azure OpenAI: `/openai/deployments/{deployment}/{chat/completions|completions|embeddings}?api-version=…` and
  the v1 API `/openai/v1/{responses|chat/completions|embeddings}` (the deployment as the body's `model`);
  401 without `api-key` (or a bearer token), 404 without an api-version on the deployments path, 404
  `DeploymentNotFound` for a deployment the resource does not have; its answers carry Azure's quota headers
  (`x-ratelimit-remaining-requests`, `-tokens`, without the reset times Azure leaves out).
- Gemini API: `/v1beta/openai/{chat/completions|embeddings}`; 403 `PERMISSION_DENIED` without `x-goog-api-key`
  (or a bearer key), 404 for an endpoint its OpenAI-compatible surface does not have.
- Amazon Bedrock runtime: `/model/{modelId}/invoke` and `/invoke-with-response-stream`, answered as the Anthropic
  Messages call it is, the stream in AWS's event-stream framing (each Anthropic event a `chunk` frame whose
  payload is `{"bytes": base64(event)}`: `bedrock_chunk`). The SigV4
  signature is verified with botocore's own signer (the request re-signed with the secret of the access key id it
  names, at its date, over the bytes received): 403 without one, for an access key id the fake does not know, or
  when the signatures differ; 400 `ValidationException` for a body with `model` or `stream` in it or without
  `anthropic_version: bedrock-2023-05-31`, Bedrock's `{"message": …}` error shape throughout.
"""

import base64
import binascii
import hmac
import json
import logging
import re
import struct
import threading
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

AZURE_PREFIX = "/openai/"
BEDROCK_PREFIX = "/model/"
# The AWS credentials a fresh fake Bedrock knows: access key id → secret access key (the demo catalog's).
DEMO_BEDROCK_KEYS = {"AKIARELAYDEMO0000001": "demo-upstream-key"}
_BEDROCK_INVOKE = re.compile(r"^/model/([^/]+)/(invoke|invoke-with-response-stream)\Z")
_SIGV4 = re.compile(
    r"^AWS4-HMAC-SHA256 Credential=([^/]+)/(\d{8})/([^/]+)/([^/]+)/aws4_request, ?"
    r"SignedHeaders=([^,]+), ?Signature=([0-9a-f]{64})\Z"
)
GEMINI_PREFIX = "/v1beta/openai/"
# The deployments a fresh fake resource has (the demo catalog's and the tests' Azure bindings name these).
DEMO_DEPLOYMENTS = ("gpt-4o-mini", "gpt-4.1-mini", "text-embedding-3-small")
_DEPLOYMENT_PATH = re.compile(r"^/openai/deployments/([^/]+)/(chat/completions|completions|embeddings)\Z")
_AZURE_V1 = {"/openai/v1/responses", "/openai/v1/chat/completions", "/openai/v1/embeddings"}
_GEMINI_ENDPOINTS = {"chat/completions", "embeddings"}
# Azure's quota per key in the fake: requests per 10-second window, tokens per minute (counted down, never reset:
# the fake only says what is left, as Azure does).
AZURE_REQUESTS = 1000
AZURE_TOKENS = 1_000_000


@dataclass
class Admission:
    """What the fake made of a cloud call: the OpenAI path it asks for and the key it used, or its refusal."""

    path: str = ""
    key: str = ""
    refusal: tuple[int, dict] | None = None
    headers: dict = field(default_factory=dict)  # sent with the answer
    # A streamed answer's framing: each SSE event the demo upstream makes → the bytes sent (None: SSE as it is).
    frame: object = None
    content_type: str = ""


def _azure_error(status: int, code: str, message: str) -> tuple[int, dict]:
    return status, {"error": {"code": code, "message": message}}


def _aws_error(status: int, message: str) -> tuple[int, dict]:
    return status, {"message": message}


def _google_error(status: int, state: str, message: str) -> tuple[int, dict]:
    return status, {"error": {"code": status, "message": message, "status": state}}


class Clouds:
    def __init__(self):
        self.lock = threading.Lock()
        self.azure_deployments: set[str] = set(DEMO_DEPLOYMENTS)
        self.azure_used: dict[str, int] = {}
        self.bedrock_keys: dict[str, str] = dict(DEMO_BEDROCK_KEYS)

    def reset(self) -> None:
        with self.lock:
            self.azure_deployments = set(DEMO_DEPLOYMENTS)
            self.azure_used.clear()
            self.bedrock_keys = dict(DEMO_BEDROCK_KEYS)

    def handles(self, raw_path: str) -> bool:
        path = urlsplit(raw_path).path
        return path.startswith((AZURE_PREFIX, GEMINI_PREFIX, BEDROCK_PREFIX))

    def admit(self, raw_path: str, headers, body: dict, raw: bytes = b"") -> Admission:
        url = urlsplit(raw_path)
        if url.path.startswith(GEMINI_PREFIX):
            return self._gemini(url.path, headers)
        if url.path.startswith(BEDROCK_PREFIX):
            return self._bedrock(raw_path, headers, body, raw)
        return self._azure(url.path, parse_qs(url.query), headers, body)

    def _bedrock(self, raw_path: str, headers, body: dict, raw: bytes) -> Admission:
        signed = _SIGV4.match(headers.get("Authorization", ""))
        if not signed:
            return Admission(refusal=_aws_error(403, "Missing Authentication Token"))
        access_key_id, service, signature = signed.group(1, 4, 6)
        with self.lock:
            secret = self.bedrock_keys.get(access_key_id)
        if secret is None or service != "bedrock":
            return Admission(refusal=_aws_error(403, "The security token included in the request is invalid."))
        if not hmac.compare_digest(signature, _sigv4_signature(raw_path, headers, raw, signed, secret)):
            return Admission(
                key=secret,
                refusal=_aws_error(
                    403,
                    "The request signature we calculated does not match the signature you provided. Check your AWS "
                    "Secret Access Key and signing method. Consult the service documentation for details.",
                ),
            )
        action = _BEDROCK_INVOKE.match(urlsplit(raw_path).path)
        if not action:
            return Admission(key=secret, refusal=_aws_error(404, "Unknown operation"))
        extraneous = [name for name in ("model", "stream") if name in body]
        if extraneous:
            return Admission(
                key=secret,
                refusal=_aws_error(
                    400,
                    f"Malformed input request: #: extraneous key [{extraneous[0]}] is not permitted, please reformat "
                    "your input and try again.",
                ),
            )
        if body.get("anthropic_version") != "bedrock-2023-05-31":
            missing = "Malformed input request: #: required key [anthropic_version] not found"
            return Admission(key=secret, refusal=_aws_error(400, missing))
        if action.group(2) == "invoke":
            return Admission(path="/v1/messages", key=secret)
        return Admission(
            path="/v1/messages", key=secret, frame=bedrock_chunk, content_type="application/vnd.amazon.eventstream"
        )

    def _azure(self, path: str, query: dict, headers, body: dict) -> Admission:
        key = headers.get("api-key") or headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not key:
            return Admission(
                refusal=_azure_error(
                    401,
                    "401",
                    "Access denied due to invalid subscription key or wrong API endpoint. Make sure to provide a "
                    "valid key for an active subscription and use a correct regional API endpoint for your resource.",
                )
            )
        match = _DEPLOYMENT_PATH.match(path)
        if match:
            if not query.get("api-version"):
                return Admission(key=key, refusal=_azure_error(404, "404", "Resource not found"))
            deployment, endpoint = match.groups()
        elif path in _AZURE_V1:
            deployment, endpoint = str(body.get("model") or ""), path.removeprefix("/openai/v1/")
        else:
            return Admission(key=key, refusal=_azure_error(404, "404", "Resource not found"))
        with self.lock:
            known = deployment in self.azure_deployments
            used = self.azure_used[key] = self.azure_used.get(key, 0) + 1
        if not known:
            return Admission(
                key=key,
                refusal=_azure_error(
                    404,
                    "DeploymentNotFound",
                    "The API deployment for this resource does not exist. If you created the deployment within "
                    "the last 5 minutes, please wait a moment and try again.",
                ),
            )
        quota = {
            "x-ratelimit-remaining-requests": max(0, AZURE_REQUESTS - used),
            "x-ratelimit-remaining-tokens": max(0, AZURE_TOKENS - 100 * used),
        }
        return Admission(path=f"/v1/{endpoint}", key=key, headers=quota)

    def _gemini(self, path: str, headers) -> Admission:
        key = headers.get("x-goog-api-key") or headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not key:
            return Admission(
                refusal=_google_error(
                    403,
                    "PERMISSION_DENIED",
                    "Method doesn't allow unregistered callers (callers without established identity). Please use "
                    "API Key or other form of API consumer identity to call this API.",
                )
            )
        endpoint = path.removeprefix(GEMINI_PREFIX)
        if endpoint not in _GEMINI_ENDPOINTS:
            return Admission(key=key, refusal=_google_error(404, "NOT_FOUND", f"no such method: {endpoint}"))
        return Admission(path=f"/v1/{endpoint}", key=key)

    @staticmethod
    def refuse(handler, refusal: tuple[int, dict]) -> None:
        status, answer = refusal
        payload = json.dumps(answer).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)


def _sigv4_signature(raw_path: str, headers, raw: bytes, signed: re.Match, secret: str) -> str:
    """The SigV4 signature botocore computes for the request received, re-signed with `secret` at its own date over
    the headers it says it signed: equal to the one sent only when the sender held the secret and signed these bytes."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    access_key_id, _, region, service, signed_headers, _ = signed.groups()
    names = signed_headers.split(";")
    request = AWSRequest(
        method="POST",
        url=f"http://{headers.get('Host', '')}{raw_path}",
        data=raw,
        headers={name: headers.get(name, "") for name in names if name != "host"},
    )
    request.context["timestamp"] = headers.get("X-Amz-Date", "")
    signer = SigV4Auth(Credentials(access_key_id, secret), service, region)
    return signer.signature(signer.string_to_sign(request, signer.canonical_request(request)), request)


def eventstream_frame(headers: dict[str, str], payload: bytes) -> bytes:
    """One message of AWS's event-stream framing: prelude (total and headers length, CRC32), string headers,
    payload, CRC32 of it all (botocore.eventstream decodes it)."""
    encoded = b"".join(
        bytes([len(name)]) + name.encode() + b"\x07" + struct.pack(">H", len(value.encode())) + value.encode()
        for name, value in headers.items()
    )
    prelude = struct.pack(">II", 12 + len(encoded) + len(payload) + 4, len(encoded))
    message = prelude + struct.pack(">I", binascii.crc32(prelude)) + encoded + payload
    return message + struct.pack(">I", binascii.crc32(message))


def bedrock_chunk(event: bytes) -> bytes:
    """An Anthropic SSE event (`event: …` / `data: {…}`) as the `chunk` frame InvokeModelWithResponseStream sends."""
    data = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
    payload = json.dumps({"bytes": base64.b64encode(data).decode()}).encode()
    headers = {":event-type": "chunk", ":content-type": "application/json", ":message-type": "event"}
    return eventstream_frame(headers, payload)


def bedrock_exception(name: str, message: str) -> bytes:
    """The frame Bedrock sends when a stream fails midway (`throttlingException`, `modelStreamErrorException`…)."""
    payload = json.dumps({"message": message}).encode()
    return eventstream_frame(
        {":exception-type": name, ":content-type": "application/json", ":message-type": "exception"}, payload
    )
