"""DEMO / TEST fake of Google Vertex AI, mounted by the demo upstream (devkit.upstream). Not a model.

One loopback port serves what the relay's `vertex` host kind (core.hostkinds.vertex) and its batch API
(gateway.batch_apis.vertex) call, each checked as Google does and refused in Google's error shape:

- OAuth2 token endpoint, `POST /token` (form `grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer&
  assertion=<JWT>`): the assertion is verified with the public key of the service account it names (its `iss`,
  its `kid`), by google-auth's own `jwt.decode`, for Google's token audience; the answer is an access token
  (`ya29.…`) living `token_lifetime` seconds. A bad signature, an unknown account: 400 `invalid_grant`.
- Claude: `/v1/projects/{p}/locations/{l}/publishers/anthropic/models/{model}:rawPredict` and
  `:streamRawPredict` (and `count-tokens:rawPredict`), answered as the Anthropic Messages call it is by the
  demo upstream (canned replies, scripts, standing answers); the stream's events carry the stray spaces Vertex
  puts inside its JSON. 400 for a body with `model` or without `anthropic_version: vertex-2023-10-16`.
- OpenAI-shaped models: `/v1/projects/{p}/locations/{l}/endpoints/openapi/{chat/completions|embeddings}`, the
  body's model publisher-qualified (`google/gemini-2.0-flash-001`), else 400.
- Every call but the token's needs `Authorization: Bearer <a token issued here and not expired>`: else 401
  UNAUTHENTICATED. The live calls' script key (DemoUpstream.script) is the service account's email.
- `throttle(n)`: the next n live calls answer 429 RESOURCE_EXHAUSTED in the one-element array Vertex sometimes
  wraps its errors in, without Retry-After, as Vertex's quota answers come.
- Cloud Storage JSON API subset: simple upload `POST /upload/storage/v1/b/{b}/o?uploadType=media&name=…`,
  list `GET /storage/v1/b/{b}/o?prefix=&pageToken=&maxResults=`, download `GET …/o/{name}?alt=media` (metadata
  without it), `DELETE …/o/{name}`. Buckets must exist (`buckets`; the demo's is there).
- batchPredictionJobs: create (`POST {location}/batchPredictionJobs`, the job itself as the answer), get
  (`GET /v1/{name}`, the name with the project's number), cancel (`POST /v1/{name}:cancel`), list (`GET
  {location}/batchPredictionJobs?filter=labels.k="v"&pageSize=&pageToken=`). Time as devkit.batches's jobs:
  with T the job's seconds, PENDING until 0.1 T (the input is read from the fake's storage then: missing, the
  job FAILS), RUNNING with records finishing evenly until 0.9 T, then SUCCEEDED (PARTIALLY_SUCCEEDED when some
  record failed); a record that never finishes (the demo upstream's `batches.expire_when`) leaves the job
  RUNNING until T, when it ends EXPIRED. A cancel is CANCELLING for 0.1 T, then CANCELLED. The predictions
  (`{outputUriPrefix}/prediction-model-<time>/predictions.jsonl`) are written when the job ends: one line per
  record run, `{"custom_id", "request", "response", "status"}` (an assumption: Google shows no Claude example;
  `status` is "" on success, the error's text otherwise, with Anthropic's error object as `response`).
  Knobs: `refuse_creates(n)` (429 RESOURCE_EXHAUSTED), `drop_create_answers(n)` (the job is made, the
  connection closed unanswered), `fail_jobs(n, code, message)` (FAILED at validation), `max_running`.
"""

import json
import re
import secrets
import threading
import time
from urllib.parse import parse_qs, unquote, urlsplit

from devkit.batches.anthropic import _anthropic_error_body
from devkit.batches.common import (
    CANCEL_TAKES,
    RECORDS_DONE_AT,
    VALIDATED_AT,
    Answer,
    _dumps,
    _loads,
    _read_body,
    _rfc3339,
    _token,
    default_job_seconds,
)
from devkit.clouds import Admission

TOKEN_AUDIENCE = "https://oauth2.googleapis.com/token"  # the assertion's `aud`, whatever the token_uri is
SCOPE = "https://www.googleapis.com/auth/cloud-platform"
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
VERTEX_ANTHROPIC_VERSION = "vertex-2023-10-16"
PROJECT_NUMBER = "123456789012"  # what a job's resource name carries instead of the project id
DEMO_BUCKET = "relay-demo-batches"
DEMO_PROJECT = "relay-demo"
DEMO_CLIENT_EMAIL = "relay-demo@relay-demo.iam.gserviceaccount.com"
DEMO_KEY_ID = "relaydemo0000000000000000000000000000001"
# The demo catalog's service account (deploy/demo-catalog.yaml holds its JSON key): a key made for the demo,
# known only to this fake. It is no Google credential.
DEMO_PRIVATE_KEY = """-----BEGIN PRIVATE KEY-----
MIIEvgIBADANBgkqhkiG9w0BAQEFAASCBKgwggSkAgEAAoIBAQDbYtmDmX/AZWcI
kCPk59wBTddbjk2iN0zkhog7HadbAMiSFtiYIyj2nJ9FYmwf7x0+czu4xs84CSgq
lvR7U7vo4r37xD2kx5ii3qJjYPYUMtH7ewQ4Jo9E3N+UvOhH0DPWBj0vpBeF4BiT
yKdDzYAaFXVroa2esxFOUpMBtb/+JaMRtjYj1BK/xWsRPW0Xo/shEjbRgPEbQTpX
ecqRWKVgdkHO/qwf6jgJMIo9w6h+JHbu3RyZLtNjzjM9RuU70Hv+Kb1ukZafjbQA
YHdsmDK5lISas0L+IE5yG/2XNfZK5h0htzk9/lDhzVn50pMz9Xam3SNpDFviTwcN
asaR7Q8TAgMBAAECggEAQ70YU0l0iCfnMd4rrxSmOiLaUZM1RlaT3+XoL3SfBXrO
80iplQQaNFc02Fwk7ZFLssoq0QlV10QAinH0yBWZKjXEmnXD4NqeNv/OHShFowP0
ERWxPlMtnoIiaM8RW4ceUkG357tfZf9FJ3BnsQhFOwiQKm0P6jX5LHlTmc4QG3za
EcVx5X13HuBuk4phJGjL3RoMUj8HGnB/fEF8FtefCTqfmwFvc29xVoQ/a0mU3Rk3
Yf4b5a2Cc8WUNtOA2X/IpW80TsuZpP+Tfy5YtIvijZZ00NzgPXflrw3exIP0CnsY
cs/l7YXz0cAo36QIf76QjICz9Zp23Z/94JvjTbV1iQKBgQD2Oumm9afIV42zKCJP
8ojnuobXF0Du2hCuTQFzRlHvXYODD8tCEaCnsOFSL6Szz1tlSbjDxhgX4qZ3H28T
G/l/zaaPq3QBfPix3WKzbZObzJaC4uztWh+0qv5Qd5A1ZOCXCbo3Kx5bGEs+Keq2
yH1XUAgJhSqTLF1HHVsBHCmcSwKBgQDkF0S/kkasSKiy9UH+lsuJB/qkCHeK3GXG
91kyM9JRecPEgGASrt5HlULT/cnWdQhOK9tLgxW3/YO1QSy0/s5mSN4XpE+7ZZq9
RHyjUEY9p3Fqv8FPjrV7tpYvmfyLk0NbS+KB6dYenaQbUj6BlPUeBCx4OztkReVb
qHWwbSuLWQKBgFHVcJQprrKZzqFNZGH3tGJ3jprrwovfc43KUAIUy+Rmyu+DD0WN
ADzbP3eGGBIehzyZjMucCaPekv6iNtM+B+Te301+aRaZhznt3wDNGTK9gwRLEP0t
Z74u2ki6A/aK6U2pUPdG4FbcMx2c5sIKzgV3tsQbOvQg2XtqGTW8O2QTAoGBAI/w
lzQGDY9/suZsnB8b7oolfOizZy08dQYg5ismRN2h6AdDtF1V+XRXH3tEt3EdHgam
6pc2vCgGVm22GY6HFp258l4dFSv/rK0wYS924zzZRFvHcyjPuHu/9/tGQ/eZEXK1
6tVtSfC8LuoG9uczp5QvshiV2J8o9Nro7oxN+KLRAoGBAKJsxLPzpMNdOo+vj9Ad
rVM9vZO5LmJhuwNtkbgyqnimm119j9L9AyJArelOLoMhycd3VWnGUB4n3pNDkUh1
ngQh+zdVSFhKovGe5ZAPFcJtMPSvWpLjbfbDuWuX4synsEJxTZ+P2sY9+oDpli+l
uXE2zTLrccfyIUjXRRwVepSn
-----END PRIVATE KEY-----
"""

_RAW_PREDICT = re.compile(
    r"^/v1/projects/([^/]+)/locations/([^/]+)/publishers/anthropic/models/([^/:]+):(rawPredict|streamRawPredict)\Z"
)
_OPENAPI = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/endpoints/openapi/(chat/completions|embeddings)\Z")
_JOBS = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/batchPredictionJobs\Z")
_JOB = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/batchPredictionJobs/([0-9]+)(:cancel)?\Z")
_BUCKET_OBJECTS = re.compile(r"^/storage/v1/b/([^/]+)/o(?:/(.+))?\Z")
_UPLOAD = re.compile(r"^/upload/storage/v1/b/([^/]+)/o\Z")
_MODEL = re.compile(r"^(projects/[^/]+/locations/[^/]+/)?publishers/anthropic/models/[^/]+\Z")
_LABEL = re.compile(r"^[a-z][a-z0-9_-]{0,62}\Z")
_LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}\Z")
_LABEL_FILTER = re.compile(r'^labels\.([a-z][a-z0-9_-]*)\s*=\s*"?([a-z0-9_-]*)"?\Z')
_UNAUTHENTICATED = (
    "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other valid "
    "authentication credential. See https://developers.google.com/identity/sign-in/web/devconsole-project."
)
_QUOTA = (
    "Quota exceeded for aiplatform.googleapis.com/online_prediction_requests_per_base_model with base model: "
    "anthropic-claude. Please submit a quota increase request. "
    "https://cloud.google.com/vertex-ai/docs/generative-ai/quotas-genai."
)
_STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
}
_RUNNING = ("JOB_STATE_PENDING", "JOB_STATE_RUNNING", "JOB_STATE_CANCELLING")


def google_error(status: int, message: str, state: str | None = None) -> dict:
    return {"error": {"code": status, "message": message, "status": state or _STATUS_NAMES.get(status, "UNKNOWN")}}


def _gcs_error(status: int, message: str, reason: str) -> dict:
    return {
        "error": {
            "code": status,
            "message": message,
            "errors": [{"message": message, "domain": "global", "reason": reason}],
        }
    }


def vertex_event(event: bytes) -> bytes:
    """An Anthropic SSE event as streamRawPredict sends it: the same JSON with stray spaces before its last
    brace (`{"type":"message_stop"          }`), so a reader must parse it, never compare strings."""
    lines = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:") and line.rstrip().endswith(b"}"):
            line = line.rstrip()[:-1] + b"        }"
        lines.append(line)
    return b"\n".join(lines)


def new_service_account(token_uri: str, email: str = "", project: str = DEMO_PROJECT) -> tuple[str, str, str]:
    """A new service account's JSON key pointed at `token_uri`: (the JSON, its key id, its public key PEM)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    key_id = _token(40).lower()
    email = email or f"relay-{_token(8).lower()}@{project}.iam.gserviceaccount.com"
    return _key_json(pem, key_id, email, project, token_uri), key_id, _public_pem(pem)


def demo_service_account(token_uri: str) -> str:
    """The demo catalog's service account's JSON key, pointed at `token_uri`."""
    return _key_json(DEMO_PRIVATE_KEY, DEMO_KEY_ID, DEMO_CLIENT_EMAIL, DEMO_PROJECT, token_uri)


def _key_json(pem: str, key_id: str, email: str, project: str, token_uri: str) -> str:
    return json.dumps(
        {
            "type": "service_account",
            "project_id": project,
            "private_key_id": key_id,
            "private_key": pem,
            "client_email": email,
            "client_id": "100000000000000000001",
            "auth_uri": "https://accounts.google.com/o/oauth2/auth",
            "token_uri": token_uri,
        }
    )


def _public_pem(private_pem: str) -> str:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(private_pem.encode(), password=None)
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


class VertexJob:
    """One batchPredictionJob: its input read at validation, its records run over time."""

    def __init__(self, id: str, email: str, project: str, location: str, spec: dict, created: float, seconds: float):
        self.id, self.email, self.project, self.location = id, email, project, location
        self.spec = spec
        self.created, self.seconds = created, max(seconds, 1e-6)
        self.lock = threading.Lock()
        self.state = "JOB_STATE_PENDING"
        self.started: float | None = None
        self.ended: float | None = None
        self.cancel_at: float | None = None
        self.error: dict | None = None
        self.fail: tuple[int, str] | None = None  # set at create by `fail_jobs`: the failure at validation
        self.records: list[bytes] = []
        self.next = 0
        self.never: list[int] = []
        self.lines: list[dict] = []
        self.succeeded = 0
        self.failed = 0
        self.directory = ""

    @property
    def name(self) -> str:
        return f"projects/{PROJECT_NUMBER}/locations/{self.location}/batchPredictionJobs/{self.id}"

    def at(self, fraction: float) -> float:
        return self.created + fraction * self.seconds

    def object(self) -> dict:
        body = {
            "name": self.name,
            "displayName": self.spec.get("displayName"),
            "model": self.spec.get("model"),
            "inputConfig": self.spec.get("inputConfig"),
            "outputConfig": self.spec.get("outputConfig"),
            "labels": self.spec.get("labels") or {},
            "state": self.state,
            "createTime": _rfc3339(self.created),
            "updateTime": _rfc3339(self.ended or self.started or self.created),
            "completionStats": {
                "successfulCount": str(self.succeeded),
                "failedCount": str(self.failed),
                "incompleteCount": str(len(self.records) - self.succeeded - self.failed if self.ended else 0),
            },
        }
        if self.started is not None:
            body["startTime"] = _rfc3339(self.started)
        if self.ended is not None:
            body["endTime"] = _rfc3339(self.ended)
        if self.directory:
            body["outputInfo"] = {"gcsOutputDirectory": self.directory}
        if self.error is not None:
            body["error"] = self.error
        return body


class Vertex:
    """The fake's state and HTTP routing; `server` is the DemoUpstream (its records answer as its live calls)."""

    def __init__(self, server):
        self.server = server
        self.lock = threading.Lock()
        self.reset()

    # --- test knobs ---------------------------------------------------------------------------------------

    def reset(self) -> None:
        with self.lock:
            # email → (key id, public key PEM)
            self.accounts: dict[str, tuple[str, str]] = {DEMO_CLIENT_EMAIL: (DEMO_KEY_ID, _demo_public_key())}
            self.tokens: dict[str, tuple[str, float]] = {}  # access token → (email, expires at)
            self.mints: list[dict] = []  # every token request: {"email", "status", "token"}
            self.token_lifetime = 3599
            self._refuse_tokens = 0
            self._throttled = 0
            self.buckets: dict[str, dict[str, tuple[bytes, float, str]]] = {DEMO_BUCKET: {}}
            self.jobs: dict[str, VertexJob] = {}
            self.log: list[dict] = []
            self.job_seconds = default_job_seconds()
            self.clock = time.time
            self.max_running: int | None = None
            self._refuse_creates = 0
            self._drop_creates = 0
            self._fail_jobs: list[tuple[int, str]] = []

    def add_service_account(self, email: str = "", project: str = DEMO_PROJECT) -> str:
        """A new service account this fake knows: its JSON key (token_uri: this fake's /token)."""
        key_json, key_id, public = new_service_account(f"{self.server.url}/token", email, project)
        with self.lock:
            self.accounts[json.loads(key_json)["client_email"]] = (key_id, public)
        return key_json

    def refuse_tokens(self, n: int) -> None:
        """The next `n` token requests answer 400 invalid_grant (as for a deleted key)."""
        with self.lock:
            self._refuse_tokens = n

    def expire_tokens(self) -> None:
        """Every token issued so far stops working (a call with one answers 401)."""
        with self.lock:
            self.tokens = {token: (email, 0.0) for token, (email, _) in self.tokens.items()}

    def throttle(self, n: int) -> None:
        """The next `n` live calls answer 429 RESOURCE_EXHAUSTED (an array-wrapped Google error, no Retry-After)."""
        with self.lock:
            self._throttled = n

    def refuse_creates(self, n: int) -> None:
        with self.lock:
            self._refuse_creates = n

    def drop_create_answers(self, n: int) -> None:
        """The next `n` creates make their job, then close the connection without answering."""
        with self.lock:
            self._drop_creates = n

    def fail_jobs(self, n: int = 1, code: int = 3, message: str = "Invalid input") -> None:
        """The next `n` jobs made go FAILED at validation with google.rpc.Status {code, message}."""
        with self.lock:
            self._fail_jobs += [(code, message)] * n

    # --- what tests read -----------------------------------------------------------------------------------

    def requests(self, op: str | None = None) -> list[dict]:
        with self.lock:
            return [e for e in self.log if op is None or e["op"] == op]

    def creates(self) -> int:
        return sum(1 for e in self.requests("create") if e["status"] == 200)

    def object(self, bucket: str, name: str) -> bytes | None:
        with self.lock:
            found = self.buckets.get(bucket, {}).get(name)
        return found[0] if found else None

    def job(self, name_or_id: str) -> VertexJob | None:
        with self.lock:
            return self.jobs.get(name_or_id.rsplit("/", 1)[-1])

    # --- live calls (the demo upstream answers them: DemoUpstream's do_POST) --------------------------------

    @staticmethod
    def handles_live(raw_path: str) -> bool:
        path = urlsplit(raw_path).path
        return bool(_RAW_PREDICT.match(path) or _OPENAPI.match(path))

    def admit(self, raw_path: str, headers, body: dict, raw: bytes = b"") -> Admission:
        path = urlsplit(raw_path).path
        email = self._bearer(headers)
        if email is None:
            return Admission(refusal=(401, google_error(401, _UNAUTHENTICATED)))
        with self.lock:
            throttled = self._throttled > 0
            self._throttled -= 1 if throttled else 0
        if throttled:
            return Admission(key=email, refusal=(429, [google_error(429, _QUOTA)]))
        openapi = _OPENAPI.match(path)
        if openapi:
            model = body.get("model")
            if not isinstance(model, str) or "/" not in model:
                message = f"Model {model!r} is not a publisher model: name it as publisher/model (google/gemini-…)"
                return Admission(key=email, refusal=(400, [google_error(400, message)]))
            return Admission(path=f"/v1/{openapi.group(3)}", key=email)
        model, action = unquote(_RAW_PREDICT.match(path).group(3)), _RAW_PREDICT.match(path).group(4)
        if body.get("anthropic_version") != VERTEX_ANTHROPIC_VERSION:
            return Admission(key=email, refusal=(400, _anthropic_400("anthropic_version: Field required")))
        if model == "count-tokens":
            if not isinstance(body.get("model"), str):
                return Admission(key=email, refusal=(400, _anthropic_400("model: Field required")))
            return Admission(path="/v1/messages/count_tokens", key=email)
        if "model" in body:
            return Admission(key=email, refusal=(400, _anthropic_400("model: Extra inputs are not permitted")))
        if action == "rawPredict":
            return Admission(path="/v1/messages", key=email)
        return Admission(
            path="/v1/messages", key=email, frame=vertex_event, content_type="text/event-stream; charset=utf-8"
        )

    def _bearer(self, headers) -> str | None:
        """The service account whose live token the call carries (None: none, unknown or expired)."""
        token = (headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        with self.lock:
            found = self.tokens.get(token)
        if found is None or found[1] <= time.time():
            return None
        return found[0]

    # --- token, storage, batch jobs (served here) ---------------------------------------------------------

    @staticmethod
    def handles(raw_path: str) -> bool:
        path = urlsplit(raw_path).path
        return (
            path == "/token"
            or path.startswith(("/upload/storage/v1/", "/storage/v1/"))
            or bool(_JOBS.match(path) or _JOB.match(path))
        )

    def serve(self, handler) -> None:
        url = urlsplit(handler.path)
        path, query = url.path, parse_qs(url.query)
        raw = _read_body(handler)
        entry = {"t": self.clock(), "method": handler.command, "path": path, "op": None, "status": None}
        if path == "/token":
            entry["op"] = "token"
            answer = self._token(handler, raw)
        else:
            email = self._bearer(handler.headers)
            if email is None:
                answer = Answer(401, google_error(401, _UNAUTHENTICATED))
            else:
                try:
                    answer = self._route(handler.command, path, query, raw, email, entry, handler)
                except Exception as exc:  # a bug here must show as a 500, never as a hung connection
                    answer = Answer(500, google_error(500, f"fake vertex: {type(exc).__name__}: {exc}"))
        entry["status"] = answer.status
        with self.lock:
            self.log.append(entry)
        _send(handler, answer)

    def _route(self, method, path, query, raw, email, entry, handler) -> Answer:
        upload = _UPLOAD.match(path)
        if upload and method == "POST":
            entry["op"] = "upload"
            return self._upload(unquote(upload.group(1)), query, raw, handler.headers.get("Content-Type", ""))
        objects = _BUCKET_OBJECTS.match(path)
        if objects:
            bucket, name = unquote(objects.group(1)), objects.group(2)
            if name is None and method == "GET":
                entry["op"] = "list_objects"
                return self._list_objects(bucket, query)
            if name is not None and method in ("GET", "DELETE"):
                entry["op"] = "download" if method == "GET" else "delete_object"
                return self._object(method, bucket, unquote(name), query)
        jobs = _JOBS.match(path)
        if jobs:
            project, location = jobs.groups()
            if method == "POST":
                entry["op"] = "create"
                return self._create(email, project, location, raw, entry)
            if method == "GET":
                entry["op"] = "list"
                return self._list(email, project, location, query)
        job = _JOB.match(path)
        if job:
            _, _, id, cancel = job.groups()
            entry["job"] = id
            if cancel and method == "POST":
                entry["op"] = "cancel"
                return self._cancel(email, id)
            if not cancel and method == "GET":
                entry["op"] = "get"
                return self._get(email, id)
        return Answer(404, google_error(404, f"The requested URL {path} was not found on this server ({method})."))

    # --- the token endpoint -------------------------------------------------------------------------------

    def _token(self, handler, raw: bytes) -> Answer:
        from google.auth import jwt

        form = parse_qs(raw.decode("utf-8", "replace"))
        if (form.get("grant_type") or [""])[0] != JWT_BEARER:
            return Answer(400, {"error": "unsupported_grant_type", "error_description": "Invalid grant_type."})
        assertion = (form.get("assertion") or [""])[0]
        try:
            claims = jwt.decode(assertion, verify=False)
            header = json.loads(_b64url(assertion.split(".")[0]))
        except Exception:
            return self._invalid_grant("", "Invalid JWT: could not decode the assertion.")
        email = str(claims.get("iss") or "")
        with self.lock:
            known = self.accounts.get(email)
            refused = self._refuse_tokens > 0
            self._refuse_tokens -= 1 if refused else 0
        if known is None:
            return self._invalid_grant(email, "Invalid grant: account not found")
        key_id, public = known
        try:
            if header.get("kid") != key_id:
                raise ValueError("unknown key id")
            jwt.decode(assertion, certs=public, audience=TOKEN_AUDIENCE, clock_skew_in_seconds=30)
        except Exception:
            return self._invalid_grant(email, "Invalid JWT Signature.")
        if SCOPE not in str(claims.get("scope") or "").split():
            return Answer(400, {"error": "invalid_scope", "error_description": "Invalid OAuth scope."})
        if refused:
            return self._invalid_grant(email, "Invalid JWT Signature.")
        token = f"ya29.fake-{_token(60)}"
        with self.lock:
            lifetime = self.token_lifetime
            self.tokens[token] = (email, time.time() + lifetime)
            self.mints.append({"email": email, "status": 200, "token": token})
        return Answer(200, {"access_token": token, "expires_in": lifetime, "token_type": "Bearer"})

    def _invalid_grant(self, email: str, description: str) -> Answer:
        with self.lock:
            self.mints.append({"email": email, "status": 400, "token": None})
        return Answer(400, {"error": "invalid_grant", "error_description": description})

    # --- Cloud Storage ------------------------------------------------------------------------------------

    def _upload(self, bucket: str, query: dict, raw: bytes, content_type: str) -> Answer:
        if (query.get("uploadType") or [""])[0] != "media":
            return Answer(400, _gcs_error(400, "Upload requests must use uploadType=media here.", "invalid"))
        name = (query.get("name") or [""])[0]
        if not name:
            return Answer(400, _gcs_error(400, "Required parameter: name", "required"))
        with self.lock:
            objects = self.buckets.get(bucket)
            if objects is None:
                return Answer(404, _gcs_error(404, "The specified bucket does not exist.", "notFound"))
            objects[name] = (raw, self.clock(), content_type or "application/octet-stream")
        return Answer(200, _object_resource(bucket, name, raw, self.clock(), content_type))

    def _list_objects(self, bucket: str, query: dict) -> Answer:
        prefix = (query.get("prefix") or [""])[0]
        size = max(1, min(1000, int((query.get("maxResults") or ["1000"])[0])))
        start = int((query.get("pageToken") or ["0"])[0])
        with self.lock:
            objects = self.buckets.get(bucket)
            if objects is None:
                return Answer(404, _gcs_error(404, "The specified bucket does not exist.", "notFound"))
            names = sorted(n for n in objects if n.startswith(prefix))
            page = [(n, *objects[n]) for n in names[start : start + size]]
        body: dict = {"kind": "storage#objects"}
        if page:  # Google leaves `items` out of an empty list
            body["items"] = [_object_resource(bucket, n, data, t, ct) for n, data, t, ct in page]
        if start + size < len(names):
            body["nextPageToken"] = str(start + size)
        return Answer(200, body)

    def _object(self, method: str, bucket: str, name: str, query: dict) -> Answer:
        with self.lock:
            objects = self.buckets.get(bucket)
            found = objects.get(name) if objects is not None else None
            if found is not None and method == "DELETE":
                del objects[name]
        if found is None:
            return Answer(404, _gcs_error(404, f"No such object: {bucket}/{name}", "notFound"))
        if method == "DELETE":
            return Answer(204)
        data, t, content_type = found
        if (query.get("alt") or [""])[0] == "media":
            return Answer(200, chunks=(data,), size=len(data), content_type=content_type)
        return Answer(200, _object_resource(bucket, name, data, t, content_type))

    def _read_uri(self, uri: str) -> bytes | None:
        bucket, _, name = uri.removeprefix("gs://").partition("/")
        return self.object(bucket, name)

    def _write_uri(self, uri: str, data: bytes) -> bool:
        bucket, _, name = uri.removeprefix("gs://").partition("/")
        with self.lock:
            objects = self.buckets.get(bucket)
            if objects is None:
                return False
            objects[name] = (data, self.clock(), "application/jsonl")
        return True

    # --- batchPredictionJobs ------------------------------------------------------------------------------

    def _create(self, email: str, project: str, location: str, raw: bytes, entry: dict) -> Answer:
        try:
            spec = _loads(raw or b"{}")
        except ValueError:
            return Answer(400, google_error(400, "Invalid JSON payload received."))
        problem = _spec_problem(spec, location)
        if problem:
            return Answer(400, google_error(400, problem))
        with self.lock:
            running = sum(1 for j in self.jobs.values() if j.project == project and j.state in _RUNNING)
            if self._refuse_creates > 0 or (self.max_running is not None and running >= self.max_running):
                self._refuse_creates = max(0, self._refuse_creates - 1)
                message = "Quota exceeded for aiplatform.googleapis.com/concurrent batch prediction jobs."
                return Answer(429, google_error(429, message))
            drop = self._drop_creates > 0
            self._drop_creates -= 1 if drop else 0
            job = VertexJob(
                str(secrets.randbelow(9 * 10**18) + 10**18),  # Vertex's job ids: 19 digits
                email,
                project,
                location,
                spec,
                self.clock(),
                self.job_seconds,
            )
            job.fail = self._fail_jobs.pop(0) if self._fail_jobs else None
            self.jobs[job.id] = job
        entry["job"] = job.id
        return Answer(200, job.object(), drop=drop)

    def _own(self, email: str, id: str) -> VertexJob | None:
        with self.lock:
            job = self.jobs.get(id)
        return job if job is not None and job.email == email else None

    def _get(self, email: str, id: str) -> Answer:
        job = self._own(email, id)
        if job is None:
            return Answer(404, google_error(404, f"The BatchPredictionJob {id} does not exist."))
        self._advance(job)
        return Answer(200, job.object())

    def _list(self, email: str, project: str, location: str, query: dict) -> Answer:
        wanted = (query.get("filter") or [""])[0].strip()
        label = _LABEL_FILTER.match(wanted) if wanted else None
        if wanted and label is None:
            return Answer(400, google_error(400, f"Unsupported filter: {wanted}"))
        size = max(1, min(100, int((query.get("pageSize") or ["100"])[0])))
        start = int((query.get("pageToken") or ["0"])[0])
        with self.lock:
            mine = [
                j
                for j in reversed(list(self.jobs.values()))  # newest first
                if j.email == email and j.project == project and j.location == location
            ]
        if label is not None:
            key, value = label.groups()
            mine = [j for j in mine if (j.spec.get("labels") or {}).get(key) == value]
        page = mine[start : start + size]
        for job in page:
            self._advance(job)
        body: dict = {"batchPredictionJobs": [j.object() for j in page]} if page else {}
        if start + size < len(mine):
            body["nextPageToken"] = str(start + size)
        return Answer(200, body)

    def _cancel(self, email: str, id: str) -> Answer:
        job = self._own(email, id)
        if job is None:
            return Answer(404, google_error(404, f"The BatchPredictionJob {id} does not exist."))
        self._advance(job)
        with job.lock:
            if job.ended is not None:
                return Answer(
                    400, google_error(400, f"The job {job.name} is in state {job.state}.", "FAILED_PRECONDITION")
                )
            if job.cancel_at is None:
                job.cancel_at = self.clock()
                job.state = "JOB_STATE_CANCELLING"
        return Answer(200, {})

    def _advance(self, job: VertexJob) -> None:
        now = self.clock()
        with job.lock:
            if job.ended is not None:
                return
            if job.started is None and now >= job.at(VALIDATED_AT):
                self._validate(job)
                if job.ended is not None:
                    return
            if job.started is None:
                return
            if job.cancel_at is not None:
                stop = job.cancel_at + CANCEL_TAKES * job.seconds
                self._run_until(job, min(now, job.cancel_at))
                if now >= stop:
                    self._finish(job, stop, "JOB_STATE_CANCELLED", {"code": 1, "message": "CANCELED"})
                return
            self._run_until(job, now)
            done = job.next >= len(job.records)
            if done and not job.never and now >= job.at(RECORDS_DONE_AT):
                state = "JOB_STATE_PARTIALLY_SUCCEEDED" if job.failed else "JOB_STATE_SUCCEEDED"
                self._finish(job, job.at(RECORDS_DONE_AT), state, None)
            elif now >= job.at(1.0):
                self._finish(job, job.at(1.0), "JOB_STATE_EXPIRED", None)

    def _validate(self, job: VertexJob) -> None:
        """At 0.1 T: the input read from storage (missing: FAILED), the output directory named."""
        if job.fail is not None:
            code, message = job.fail
            self._finish(job, job.at(VALIDATED_AT), "JOB_STATE_FAILED", {"code": code, "message": message})
            return
        lines: list[bytes] = []
        for uri in job.spec["inputConfig"]["gcsSource"]["uris"]:
            data = self._read_uri(uri)
            if data is None:
                error = {"code": 5, "message": f"Failed to read the input {uri}: no such object."}
                self._finish(job, job.at(VALIDATED_AT), "JOB_STATE_FAILED", error)
                return
            lines += [line for line in data.split(b"\n") if line.strip()]
        job.records = lines
        job.started = job.at(VALIDATED_AT)
        job.state = "JOB_STATE_RUNNING"
        prefix = job.spec["outputConfig"]["gcsDestination"]["outputUriPrefix"].rstrip("/")
        stamp = time.strftime("%Y_%m_%dT%H_%M_%S", time.gmtime(job.started))
        job.directory = f"{prefix}/prediction-model-{stamp}_{int(job.started * 1000) % 1000:03d}Z"

    def _run_until(self, job: VertexJob, now: float) -> None:
        span = (RECORDS_DONE_AT - VALIDATED_AT) * job.seconds
        share = min(1.0, max(0.0, (now - job.at(VALIDATED_AT)) / span))
        target = min(len(job.records), int(len(job.records) * share + 1e-9))
        while job.next < target:
            i = job.next
            job.next += 1
            line = self._record(job.records[i])
            if line is None:
                job.never.append(i)
                continue
            job.lines.append(line)
            if line["status"]:
                job.failed += 1
            else:
                job.succeeded += 1

    def _record(self, raw: bytes) -> dict | None:
        """One input line run as the demo upstream's live call (None: it never finishes)."""
        try:
            row = _loads(raw)
        except ValueError:
            return {"custom_id": None, "request": None, "status": "Invalid JSON line in the input."}
        if not isinstance(row, dict) or not isinstance(row.get("request"), dict):
            return {"custom_id": None, "request": None, "status": "The line has no request object."}
        request, custom_id = row["request"], row.get("custom_id")
        problem = None
        if request.get("anthropic_version") != VERTEX_ANTHROPIC_VERSION:
            problem = "anthropic_version: Field required"
        elif "model" in request or "stream" in request:
            problem = f"{'model' if 'model' in request else 'stream'}: Extra inputs are not permitted"
        if problem is not None:
            error = _anthropic_400(problem)
            return {"custom_id": custom_id, "request": request, "response": error, "status": problem}
        result = self.server.batches._run("/v1/messages", request, raw)
        if result is None:
            return None
        status, body = result
        if 200 <= status < 300:
            return {"custom_id": custom_id, "request": request, "response": body, "status": ""}
        error = _anthropic_error_body(status, body)
        return {"custom_id": custom_id, "request": request, "response": error, "status": error["error"]["message"]}

    def _finish(self, job: VertexJob, at: float, state: str, error: dict | None) -> None:
        """End a job (its lock held): its predictions written (when it ran), its state and error set."""
        if job.directory:
            data = b"".join(_dumps(line) + b"\n" for line in job.lines)
            self._write_uri(f"{job.directory}/predictions.jsonl", data)
        job.state, job.ended, job.error = state, at, error


def _spec_problem(spec, location: str) -> str:
    """What Vertex refuses in a create (400 INVALID_ARGUMENT), "" when nothing."""
    if not isinstance(spec, dict):
        return "The request body must be a BatchPredictionJob."
    if location == "global":
        return "Batch prediction of anthropic models is not supported in location global: use a region."
    if not spec.get("displayName"):
        return "BatchPredictionJob.display_name is required."
    if not isinstance(spec.get("model"), str) or not _MODEL.match(spec["model"]):
        return f"Invalid model: {spec.get('model')!r}; expected publishers/anthropic/models/{{model}}."
    source = (spec.get("inputConfig") or {}) if isinstance(spec.get("inputConfig"), dict) else {}
    uris = (source.get("gcsSource") or {}).get("uris") if isinstance(source.get("gcsSource"), dict) else None
    if source.get("instancesFormat") != "jsonl" or not isinstance(uris, list) or not uris:
        return "inputConfig must be jsonl from gcsSource.uris."
    if not all(isinstance(u, str) and u.startswith("gs://") for u in uris):
        return "gcsSource.uris must be gs:// URIs."
    out = spec.get("outputConfig") if isinstance(spec.get("outputConfig"), dict) else {}
    prefix = (
        (out.get("gcsDestination") or {}).get("outputUriPrefix")
        if isinstance(out.get("gcsDestination"), dict)
        else None
    )
    if out.get("predictionsFormat") != "jsonl" or not isinstance(prefix, str) or not prefix.startswith("gs://"):
        return "outputConfig must be jsonl to gcsDestination.outputUriPrefix (a gs:// URI)."
    labels = spec.get("labels") or {}
    if not isinstance(labels, dict) or not all(
        isinstance(v, str) and _LABEL.match(k) and _LABEL_VALUE.match(v) for k, v in labels.items()
    ):
        return "Labels must be lower-case keys and values of letters, digits, _ and - (at most 63 characters)."
    return ""


def _anthropic_400(message: str) -> dict:
    return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}


def _object_resource(bucket: str, name: str, data: bytes, t: float, content_type: str) -> dict:
    generation = str(int(t * 1e6))
    return {
        "kind": "storage#object",
        "id": f"{bucket}/{name}/{generation}",
        "name": name,
        "bucket": bucket,
        "generation": generation,
        "size": str(len(data)),
        "contentType": content_type or "application/octet-stream",
        "timeCreated": _rfc3339(t),
        "updated": _rfc3339(t),
    }


def _b64url(part: str) -> bytes:
    import base64

    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


_demo_public: str | None = None


def _demo_public_key() -> str:
    global _demo_public
    if _demo_public is None:
        _demo_public = _public_pem(DEMO_PRIVATE_KEY)
    return _demo_public


def _send(handler, answer: Answer) -> None:
    if answer.drop:
        handler.close_connection = True
        return
    if answer.status == 204:
        chunks, size = (), 0
    elif answer.chunks is None:
        payload = _dumps(answer.obj)
        chunks, size = (payload,), len(payload)
    else:
        chunks, size = answer.chunks, answer.size
    try:
        handler.send_response(answer.status)
        handler.send_header("Content-Type", answer.content_type if answer.status != 204 else "application/json")
        handler.send_header("Content-Length", str(size))
        for name, value in answer.headers.items():
            handler.send_header(name, str(value))
        handler.end_headers()
        for chunk in chunks:
            handler.wfile.write(chunk)
    except (BrokenPipeError, ConnectionResetError):
        handler.close_connection = True
