"""ProviderBatches (devkit.batches): the fake providers' batch APIs' state, test knobs and HTTP routing;
the operations themselves are in devkit.batches.openai and devkit.batches.anthropic."""

import re
import threading
import time
from urllib.parse import parse_qs

from devkit.batches.anthropic import AnthropicBatches
from devkit.batches.azure import AZURE_PATHS, AZURE_PREFIX, AzureBatches
from devkit.batches.bedrock import BedrockBatches
from devkit.batches.common import (
    Answer,
    Job,
    StoredFile,
    _dumps,
    _loads,
    _read_body,
    _token,
    anthropic_error,
    default_job_seconds,
    openai_error,
)
from devkit.batches.openai import OpenAIBatches

ROUTES = [
    # (method, pattern, provider, operation)
    ("POST", r"/v1/files", "openai", "upload"),
    ("GET", r"/v1/files", "openai", "files"),
    ("GET", r"/v1/files/(?P<id>[^/]+)", "openai", "file"),
    ("GET", r"/v1/files/(?P<id>[^/]+)/content", "openai", "content"),
    ("DELETE", r"/v1/files/(?P<id>[^/]+)", "openai", "delete_file"),
    ("POST", r"/v1/batches", "openai", "create"),
    ("GET", r"/v1/batches", "openai", "list"),
    ("GET", r"/v1/batches/(?P<id>[^/]+)", "openai", "retrieve"),
    ("POST", r"/v1/batches/(?P<id>[^/]+)/cancel", "openai", "cancel"),
    ("POST", r"/v1/messages/batches", "anthropic", "create"),
    ("GET", r"/v1/messages/batches", "anthropic", "list"),
    ("GET", r"/v1/messages/batches/(?P<id>[^/]+)", "anthropic", "retrieve"),
    ("GET", r"/v1/messages/batches/(?P<id>[^/]+)/results", "anthropic", "results"),
    ("POST", r"/v1/messages/batches/(?P<id>[^/]+)/cancel", "anthropic", "cancel"),
    ("DELETE", r"/v1/messages/batches/(?P<id>[^/]+)", "anthropic", "delete"),
]
# Azure OpenAI's Global Batch: OpenAI's operations under the resource's v1 API (devkit.batches.azure).
ROUTES += [(m, AZURE_PREFIX + p, "azure", op) for m, p, provider, op in ROUTES if provider == "openai"]
ROUTES = [(m, re.compile(p + "/?"), provider, op) for m, p, provider, op in ROUTES]
PREFIXES = ("/v1/files", "/v1/batches", "/v1/messages/batches", *AZURE_PATHS)


class ProviderBatches(OpenAIBatches, AnthropicBatches, AzureBatches):
    """In-memory OpenAI Files + Batches, Anthropic Message Batches and Azure OpenAI's Global Batch for a
    DemoUpstream; Bedrock's batch inference and its S3 in `self.bedrock` (devkit.batches.bedrock).

    `canned(path, body)` answers a record no standing answer covers; `known_paths` are the paths the live
    server answers (a record for another gets the live server's 404)."""

    def __init__(self, server, canned, known_paths, job_seconds: float | None = None):
        self.server = server
        self.canned = canned
        self.known_paths = tuple(known_paths)
        self._default_seconds = job_seconds
        self.lock = threading.Lock()
        self.bedrock = BedrockBatches(self)
        self.reset()

    # --- test knobs ---------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every file, job and logged request; knobs off; job_seconds and clock to their defaults."""
        with self.lock:
            self.job_seconds = self._default_seconds if self._default_seconds is not None else default_job_seconds()
            self.clock = time.time
            self.files: dict[str, StoredFile] = {}
            self.jobs: dict[str, Job] = {}  # both providers', in creation order
            self.log: list[dict] = []
            self._refuse: dict[str, int] = {}
            self._retry_after = 1
            self._token_limit = 0
            self._fail_messages: list[str] = []
            self._expire_texts: list[bytes] = []
            self._polls_fail_until = 0.0
            self._hold: threading.Event | None = None
            self._drop: dict[str, int] = {}
            self._absent: set[str] = set()
        self.bedrock.reset()

    def no_batch_api(self, key: str) -> None:
        """Calls with API key `key` find no batch API at all: 404 on every Files and Batches path, as an
        OpenAI-compatible server without one (vLLM, llama.cpp) answers."""
        with self.lock:
            self._absent.add(key)

    def refuse_creates(self, n: int, provider: str | None = None, retry_after: int = 1) -> None:
        """The next `n` batch creates (of `provider`, "openai" or "anthropic", or either) answer 429 with
        Retry-After, as a provider at its enqueued-token or rate limit does."""
        with self.lock:
            self._refuse[provider or "*"] = n
            self._retry_after = retry_after

    def fail_token_limit(self, n: int) -> None:
        """The next `n` OpenAI batches go to `failed` when validated (0.1 T after create) with
        errors.data[0].code == "token_limit_exceeded", as OpenAI does past an enqueued-token limit."""
        with self.lock:
            self._token_limit = n

    def fail_jobs(self, message: str, n: int = 1) -> None:
        """The next `n` OpenAI batches go to `failed` when validated with errors.data[0].message == `message`
        (code `invalid_request`): the provider's own words about a job, which may quote anything it holds."""
        with self.lock:
            self._fail_messages += [message] * n

    def expire_when(self, text: str) -> None:
        """Records whose raw line contains `text` never finish: they end expired at the job's window (T)."""
        with self.lock:
            self._expire_texts.append(text.encode())

    def fail_polls_until(self, t: float) -> None:
        """Retrieves and lists of batch objects (both providers) answer 500 until `clock()` reaches `t`."""
        with self.lock:
            self._polls_fail_until = t

    def fail_polls(self, seconds: float) -> None:
        self.fail_polls_until(self.clock() + seconds)

    def hold_creates(self, event: threading.Event | None) -> None:
        """Creates make their job at once, then hold their answer until `event` is set (None: no more)."""
        with self.lock:
            self._hold = event

    def drop_create_answers(self, n: int, provider: str | None = None) -> None:
        """The next `n` creates make their job, then close the connection without answering: the caller
        cannot know the job exists (it must find it by listing)."""
        with self.lock:
            self._drop[provider or "*"] = n

    # --- what tests read ---------------------------------------------------------------------------------

    def requests(self, op=None, job=None, key=None, provider=None, method=None) -> list[dict]:
        """Logged batch-API requests matching every given field. Each is {"t" (clock()), "method", "path",
        "provider", "op", "key", "headers" (lower-cased names), "job" (a batch id or None), "file" (a file id or
        None), "status"}. ops:
        upload, files, file, content, delete_file, create, list, retrieve, cancel, results, delete."""
        want = {"op": op, "job": job, "key": key, "provider": provider, "method": method}
        with self.lock:
            return [e for e in self.log if all(v is None or e[k] == v for k, v in want.items())]

    def polls(self, job: str) -> list[dict]:
        """The retrieves of one job (its polls)."""
        return self.requests(op="retrieve", job=job)

    def max_per_minute(self, job: str, op: str | None = None, window: float = 60.0) -> int:
        """The most requests about `job` (of `op`, or any) in any `window` seconds."""
        times = sorted(e["t"] for e in self.requests(op=op, job=job))
        best, lo = 0, 0
        for hi, t in enumerate(times):
            while t - times[lo] >= window:
                lo += 1
            best = max(best, hi - lo + 1)
        return best

    def creates(self, provider: str | None = None) -> int:
        """Jobs created (their answer sent, held or dropped; a refused create made none)."""
        return sum(1 for e in self.requests(op="create", provider=provider) if e["status"] == 200)

    def uploads(self) -> int:
        return len(self.requests(op="upload", method="POST"))

    def job(self, id: str) -> Job | None:
        with self.lock:
            return self.jobs.get(id)

    # --- HTTP ----------------------------------------------------------------------------------------------

    def handles(self, path: str) -> bool:
        path = path.split("?", 1)[0]
        return any(path == p or path.startswith(p + "/") for p in PREFIXES) or self.bedrock.handles(path)

    def serve(self, handler) -> None:
        """Answer one request of a batch path on `handler` (a BaseHTTPRequestHandler)."""
        method = handler.command
        path, _, query = handler.path.partition("?")
        raw = _read_body(handler)
        if self.bedrock.handles(path):  # Bedrock's control plane or the S3 stand-in: SigV4, not a key header
            return self._send(handler, self.bedrock.serve(handler, raw), "bedrock")
        key = (
            handler.headers.get("x-api-key")
            or handler.headers.get("api-key")
            or handler.headers.get("Authorization", "").removeprefix("Bearer ")
        )
        route = next(
            (
                (prov, op, m.groupdict())
                for meth, pat, prov, op in ROUTES
                if meth == method and (m := pat.fullmatch(path))
            ),
            None,
        )
        provider = route[0] if route else ("anthropic" if path.startswith("/v1/messages/") else "openai")
        op, ids = (route[1], route[2]) if route else (None, {})
        entry = {"t": self.clock(), "method": method, "path": path, "provider": provider, "op": op, "key": key}
        entry["headers"] = {name.lower(): value for name, value in handler.headers.items()}  # what reached it
        entry.update(job=None, file=None, status=None)
        error = anthropic_error if provider == "anthropic" else openai_error
        if route is None:
            answer = error(404, f"Invalid URL ({method} {path})", type="invalid_request_error")
        elif key in self._absent:
            answer = Answer(404, {"detail": "Not Found"})  # FastAPI's (vLLM's) answer to a path it lacks
        elif not key:
            answer = error(401, "You didn't provide an API key.", type="authentication_error")
        else:
            host = handler.headers.get("Host") or "{}:{}".format(*handler.server.server_address[:2])
            context = {"key": key, "raw": raw, "query": parse_qs(query), "entry": entry, "base_url": f"http://{host}"}
            context["content_type"] = handler.headers.get("Content-Type", "")
            context["headers"] = entry["headers"]
            try:
                if provider == "azure":
                    answer = self._azure(op, context, ids)
                else:
                    answer = getattr(self, f"_{provider}_{op}")(context, **ids)
            except Exception as exc:  # a bug here must show as a 500, never as a hung connection
                answer = error(500, f"demo upstream: {type(exc).__name__}: {exc}", type="api_error")
        entry["status"] = answer.status
        with self.lock:
            self.log.append(entry)
        self._send(handler, answer, provider)

    def _send(self, handler, answer: Answer, provider: str) -> None:
        if answer.hold is not None:
            hold = getattr(handler, "_hold", None)  # DemoUpstream's: notices a caller that gives up
            if hold is not None:
                if not hold(answer.hold, 120):
                    return
            else:
                answer.hold.wait(120)
        if answer.drop:
            handler.close_connection = True
            return
        if answer.chunks is None:
            payload = _dumps(answer.obj)
            chunks, size = (payload,), len(payload)
        else:
            chunks, size = answer.chunks, answer.size
        try:
            handler.send_response(answer.status)
            handler.send_header("Content-Type", answer.content_type)
            handler.send_header("Content-Length", str(size))
            handler.send_header("request-id" if provider == "anthropic" else "x-request-id", f"req_{_token(24)}")
            for name, value in answer.headers.items():
                handler.send_header(name, str(value))
            handler.end_headers()
            for chunk in chunks:
                handler.wfile.write(chunk)
        except (BrokenPipeError, ConnectionResetError):
            handler.close_connection = True

    # --- records: the same replies as live calls -----------------------------------------------------------

    def _never_finishes(self, raw: bytes) -> bool:
        return any(text in raw for text in self._expire_texts)

    def _run(self, path: str, body, raw: bytes) -> tuple[int, dict] | None:
        """(status, body) of one record, as the live server would answer it; None: it never finishes."""
        if self._never_finishes(raw):
            return None
        reply = self.server.rule_for(raw)
        if reply is not None:
            if getattr(reply, "hang", False):
                return None
            if reply.body is not None:
                return reply.status, reply.body
            if getattr(reply, "raw", None) is not None:
                try:
                    return reply.status, _loads(reply.raw)
                except ValueError:
                    return 502, {"error": {"message": "upstream sent a body that is not JSON", "type": "server_error"}}
            if reply.status >= 400:
                kind = "server_error" if reply.status >= 500 else "invalid_request_error"
                return reply.status, {"error": {"message": f"demo upstream: HTTP {reply.status}", "type": kind}}
        if path not in self.known_paths:
            return 404, {"error": {"message": f"no route {path}", "type": "not_found"}}
        try:
            answer = self.canned(path, body)
        except (AttributeError, TypeError, ValueError):
            return 400, {"error": {"message": "malformed request body", "type": "invalid_request_error"}}
        return 200, answer

    # --- shared by both providers' operations -------------------------------------------------------------

    def _take(self, counters: dict, provider: str) -> bool:
        """Consume one of a per-provider (or "*") knob's count (called with the lock held)."""
        for name in (provider, "*"):
            if counters.get(name, 0) > 0:
                counters[name] -= 1
                return True
        return False

    def _create_knobs(self, provider: str) -> tuple[bool, dict]:
        """(refused, answer options) for one create."""
        with self.lock:
            if self._take(self._refuse, provider):
                return True, {"headers": {"Retry-After": self._retry_after}}
            return False, {"drop": self._take(self._drop, provider), "hold": self._hold}

    def _own_job(self, ctx, id: str, provider: str) -> Job | None:
        with self.lock:
            job = self.jobs.get(id)
        ctx["entry"]["job"] = id
        return job if job is not None and job.key == ctx["key"] and job.provider == provider else None

    def _polls_failing(self) -> bool:
        return self.clock() < self._polls_fail_until
