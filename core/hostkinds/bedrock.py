"""Amazon Bedrock: Claude through InvokeModel, each call signed with AWS Signature Version 4.

The host's base URL is the Bedrock runtime endpoint of its region (`https://bedrock-runtime.<region>.amazonaws.com`);
the binding's `upstream_name` is the Bedrock model id (or inference profile) and goes in the path,
`/model/{modelId}/invoke`. Bedrock takes Anthropic's Messages body with two differences, which are its envelope and
not another shape (the relay still never translates one): no `model` (it is in the path) and no `stream`, and an
`anthropic_version` of `bedrock-2023-05-31` in the body instead of the `anthropic-version` header.

Credentials: the host key's value is the secret access key (encrypted or read from the environment, and scrubbed
like every host key); the access key id, the signing region and, for temporary credentials, the environment
variable holding the session token are the host's settings. The signature is botocore's own (`SigV4Auth`), over
the exact bytes sent, so it is computed per call and per key, after the body is final.

A call with `stream: true` goes to InvokeModelWithResponseStream (`/model/{modelId}/invoke-with-response-stream`),
which answers in AWS's binary event-stream framing (`application/vnd.amazon.eventstream`), not server-sent events:
each `chunk` event's payload is `{"bytes": base64(one Anthropic streaming event)}`. `stream_reader` decodes the
frames with botocore's decoder and hands the relay's streaming code each event as the Anthropic SSE event it is
(`event: <type>` and the JSON as Bedrock sent it), so usage, estimates and scrubbing work as for Anthropic; an
exception frame (a throttling or model-stream error mid-stream) becomes Anthropic's `error` event."""

import base64
import binascii
import json
import logging
import os
import re
from urllib.parse import quote, urlsplit

from core.hostkinds.base import HostKind, Option, env_problem

log = logging.getLogger(__name__)

BEDROCK_ANTHROPIC_VERSION = "bedrock-2023-05-31"
SIGNING_NAME = "bedrock"
# Bedrock's runtime endpoint names its region: the region a host signs for when its entry gives none.
_ENDPOINT_REGION = re.compile(r"^bedrock-runtime(?:-fips)?\.([a-z0-9-]+)\.amazonaws\.com$")
_REGION = re.compile(r"^[a-z]{2}(-gov|-iso[a-z]*)?-[a-z]+-\d\Z")
_ACCESS_KEY_ID = re.compile(r"^[A-Z0-9]{16,128}\Z")
# The body fields Bedrock refuses (`extraneous key … is not permitted`): the model is the path, streaming the action.
_NOT_IN_BODY = ("model", "stream")


def _region_problem(value: str) -> str:
    return "" if _REGION.match(value) else f"'region' {value!r} is not an AWS region such as us-east-1"


def _access_key_id_problem(value: str) -> str:
    if _ACCESS_KEY_ID.match(value):
        return ""
    return f"'access_key_id' {value!r} is not an AWS access key id (AKIA… or ASIA…, upper-case letters and digits)"


def _session_token_env_problem(value: str) -> str:
    return env_problem(value)  # the same rule as a host key's value_env


_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")
_ROLE_ARN = re.compile(r"^arn:aws(-[a-z-]+)?:iam::\d{12}:role/[\w+=,.@/-]{1,512}\Z")
_PREFIX = re.compile(r"^[A-Za-z0-9!_*'().-]+(/[A-Za-z0-9!_*'().-]+)*\Z")


def _bucket_problem(value: str) -> str:
    return "" if _BUCKET.match(value) else f"'batch_bucket' {value!r} is not an S3 bucket name"


def _role_arn_problem(value: str) -> str:
    if _ROLE_ARN.match(value):
        return ""
    return f"'batch_role_arn' {value!r} is not an IAM role ARN (arn:aws:iam::…:role/…)"


def _prefix_problem(value: str) -> str:
    ok = _PREFIX.match(value.strip("/"))
    return "" if ok else f"'batch_prefix' {value!r}: S3 key segments of letters, digits and -!_*'(). only"


def _url_problem(value: str) -> str:
    return "" if value.startswith(("https://", "http://")) else f"{value!r} is not an http(s) URL"


class BedrockKind(HostKind):
    name = "bedrock"
    label = "bedrock (Amazon Bedrock: SigV4, InvokeModel)"
    adapters = frozenset({"anthropic"})
    # Bedrock has no token-counting endpoint of Anthropic's shape: only messages.
    paths = frozenset({"/v1/messages"})
    stream_wire = "aws-eventstream"
    signs_body = True
    # Batch inference (model invocation jobs), its input and output in the host's S3 bucket: the batch_* settings
    # (gateway.batch_apis.bedrock). Without a bucket and a service role its batch records run in the relay.
    batch_api = "bedrock"
    options = (
        Option("access_key_id", "", "the AWS access key id of the host key's secret", _access_key_id_problem),
        Option("region", "", "the AWS region signed for; default: the one in the base URL", _region_problem),
        Option(
            "session_token_env",
            "",
            "the environment variable holding the session token of temporary credentials",
            _session_token_env_problem,
        ),
        Option("batch_bucket", "", "the S3 bucket batch jobs' input and output go to", _bucket_problem),
        Option("batch_prefix", "relay", "the key prefix of batch jobs' objects in the bucket", _prefix_problem),
        Option(
            "batch_role_arn",
            "",
            "the IAM service role Bedrock runs batch jobs as (it reads and writes the bucket)",
            _role_arn_problem,
        ),
        Option("batch_s3_url", "", "the S3 endpoint; default https://s3.<region>.amazonaws.com", _url_problem),
        Option(
            "batch_control_url",
            "",
            "Bedrock's control plane; default https://bedrock.<region>.amazonaws.com",
            _url_problem,
        ),
    )

    def options_problem(self, options) -> str:
        problem = super().options_problem(options)
        if problem:
            return problem
        if not options.get("access_key_id"):
            return "'access_key_id' is required: the AWS access key id whose secret access key is the host key's value"
        if bool(options.get("batch_bucket")) != bool(options.get("batch_role_arn")):
            return "'batch_bucket' and 'batch_role_arn' go together: batch jobs need the bucket and Bedrock's role"
        return ""

    def region(self, host) -> str:
        given = self.option_values(host.options)["region"]
        if given:
            return given
        match = _ENDPOINT_REGION.match(urlsplit(host.base_url).hostname or "")
        return match.group(1) if match else "us-east-1"

    def url(self, host, binding, path: str, *, streamed: bool = False) -> str:
        action = "invoke-with-response-stream" if streamed else "invoke"
        return f"{host.base_url.rstrip('/')}/model/{quote(binding.upstream_name, safe='')}/{action}"

    def request(self, host, binding, path: str, body: bytes, betas=()) -> tuple[str, bytes]:
        try:
            fields = json.loads(body)
        except ValueError:
            return self.url(host, binding, path), body  # not JSON: Bedrock answers its own 400
        if not isinstance(fields, dict):
            return self.url(host, binding, path), body
        streamed = fields.get("stream") is True
        for name in _NOT_IN_BODY:
            fields.pop(name, None)
        fields.setdefault("anthropic_version", BEDROCK_ANTHROPIC_VERSION)
        if betas:  # Bedrock takes Anthropic's betas in the body, not as the anthropic-beta header
            fields["anthropic_beta"] = list(betas)
        return self.url(host, binding, path, streamed=streamed), json.dumps(fields).encode()

    def stream_reader(self, stream):
        return EventStreamAsSSE(stream)

    def call_headers(self, host, key_value: str, *, key=None, body: bytes = b"", url: str = "") -> dict:
        settings = self.option_values(host.options)
        token = os.environ.get(settings["session_token_env"], "") if settings["session_token_env"] else ""
        return sigv4_headers(settings["access_key_id"], key_value, token or None, self.region(host), body, url)

    def auth_headers(self, key_value: str, *, key=None, body: bytes = b"", url: str = "") -> dict:
        # A signature needs the host's settings (access key id, region): `call_headers` is what a call asks.
        raise NotImplementedError("a bedrock host signs each call with its settings: call_headers()")


def sigv4_headers(
    access_key_id: str, secret: str, token: str | None, region: str, body: bytes, url: str, *, content_type=""
) -> dict:
    """The headers of an AWS SigV4 signature for POSTing `body` to `url` (botocore's signer, as the AWS SDKs)."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    request = AWSRequest(
        method="POST", url=url, data=body, headers={"Content-Type": content_type or "application/json"}
    )
    SigV4Auth(Credentials(access_key_id, secret, token), SIGNING_NAME, region).add_auth(request)
    return {name: value for name, value in request.headers.items() if name.lower() != "content-type"}


# Bedrock's mid-stream exceptions (`:exception-type`) as the Anthropic error types a client of Anthropic handles.
_STREAM_ERRORS = {
    "throttlingException": "rate_limit_error",
    "serviceUnavailableException": "overloaded_error",
    "validationException": "invalid_request_error",
}


class EventStreamAsSSE:
    """An open InvokeModelWithResponseStream answer read as Anthropic's server-sent events.

    `read()` feeds what came off the socket to botocore's event-stream decoder and returns the SSE of the whole
    frames decoded so far (a frame split across reads waits for its end); it reads on until at least one event is
    whole, so b"" still means the end of the stream. Everything else is the underlying stream's."""

    def __init__(self, stream):
        from botocore.eventstream import EventStreamBuffer

        self._stream = stream
        self._frames = EventStreamBuffer()
        self.status = stream.status
        self.headers = {k: v for k, v in stream.headers.items() if k.lower() != "content-type"}
        self.headers["Content-Type"] = "text/event-stream; charset=utf-8"

    def read(self) -> bytes:
        from botocore.eventstream import ParserError  # the decoder's: a bad checksum, a length out of bounds

        while True:
            piece = self._stream.read()
            if not piece:
                return b""
            self._frames.add_data(piece)
            try:
                out = b"".join(_sse(message) for message in self._frames)
            except ParserError as exc:  # a corrupt frame (CRC, lengths): the stream is broken from here on
                from core.upstream_types import UpstreamError

                raise UpstreamError("network", f"the Bedrock event stream is corrupt: {exc}") from exc
            if out:
                return out

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _sse(message) -> bytes:
    """One decoded event-stream frame as Anthropic's SSE event (b"" for a frame that carries none)."""
    headers = message.headers
    if headers.get(":message-type") == "event" and headers.get(":event-type") == "chunk":
        try:
            data = base64.b64decode(json.loads(message.payload)["bytes"])
            kind = json.loads(data).get("type", "")
        except (ValueError, KeyError, TypeError, AttributeError, binascii.Error):
            log.warning("a Bedrock stream chunk that is not an Anthropic event was dropped")
            return b""
        return b"event: %s\ndata: %s\n\n" % (str(kind).encode(), data.strip())
    if headers.get(":message-type") == "exception":
        name = str(headers.get(":exception-type", ""))
        try:
            text = str(json.loads(message.payload).get("message", ""))
        except (ValueError, AttributeError):
            text = ""
        error = {"type": "error", "error": {"type": _STREAM_ERRORS.get(name, "api_error"), "message": text or name}}
        return b"event: error\ndata: %s\n\n" % json.dumps(error, separators=(",", ":")).encode()
    return b""
