"""Shared pieces of the fake providers' batch APIs (devkit.batches): limits and timing constants, JSON
helpers, the results Spool, an Answer, a StoredFile, the Job base, both providers' error bodies, and request
body / multipart parsing."""

import json
import os
import re
import secrets
import string
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a runtime requirement
    orjson = None

OPENAI_ENDPOINTS = (
    "/v1/responses",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/completions",
    "/v1/moderations",
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/videos",
)
OPENAI_FILE_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
OPENAI_MAX_REQUESTS = 50_000  # per input file
OPENAI_MAX_BATCH_BYTES = 200 * 1024 * 1024  # per input file
OPENAI_MAX_FILE_BYTES = 512 * 1024 * 1024  # any upload
ANTHROPIC_MAX_REQUESTS = 100_000
ANTHROPIC_MAX_BYTES = 256 * 1024 * 1024
ANTHROPIC_CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# Fractions of a job's seconds (see the package docstring, devkit.batches).
VALIDATED_AT = 0.1
RECORDS_DONE_AT = 0.9
CANCEL_TAKES = 0.1
CHUNK = 1 << 20  # bytes per write of a file or results body
DEFAULT_JOB_SECONDS = 3.0
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
CANCELLED_MESSAGE = "This request was not executed because the batch was cancelled."
BASE62 = string.ascii_letters + string.digits


def default_job_seconds() -> float:
    return float(os.environ.get("RELAY_DEMO_BATCH_SECONDS") or DEFAULT_JOB_SECONDS)


def _dumps(obj) -> bytes:
    if orjson is not None:
        try:
            return orjson.dumps(obj)
        except TypeError:  # a test's body orjson refuses (e.g. an int past 64 bits): the standard library's
            pass
    return json.dumps(obj).encode()


def _loads(raw):
    return orjson.loads(raw) if orjson is not None else json.loads(raw)


def _token(n: int) -> str:
    return "".join(secrets.choice(BASE62) for _ in range(n))


def _rfc3339(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _int(t: float | None) -> int | None:
    return None if t is None else int(t)


class Spool:
    """A results file written line by line into 1 MiB chunks: served chunk by chunk, never joined."""

    def __init__(self):
        self.chunks: list[bytes] = []
        self.buf = bytearray()
        self.size = 0
        self.lines = 0

    def add(self, obj) -> None:
        line = _dumps(obj)
        self.buf += line
        self.buf += b"\n"
        self.size += len(line) + 1
        self.lines += 1
        if len(self.buf) >= CHUNK:
            self.chunks.append(bytes(self.buf))
            self.buf.clear()

    def close(self) -> None:
        if self.buf:
            self.chunks.append(bytes(self.buf))
            self.buf.clear()


@dataclass
class Answer:
    status: int = 200
    obj: object = None  # a JSON body
    headers: dict = field(default_factory=dict)
    chunks: object = None  # an iterable of bytes (a file), with `size` its total length
    size: int = 0
    content_type: str = "application/json"
    drop: bool = False  # close the connection without an answer (after the work is done)
    hold: threading.Event | None = None  # answer only once this is set (after the work is done)


@dataclass
class StoredFile:
    id: str
    key: str
    filename: str
    purpose: str
    created: float
    data: bytes | None = None  # an upload
    spool: Spool | None = None  # a batch's output or error file
    batch_id: str | None = None

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else self.spool.size

    def chunks(self):
        if self.data is not None:
            view = memoryview(self.data)
            for i in range(0, len(view), CHUNK):
                yield view[i : i + CHUNK]
        else:
            yield from self.spool.chunks

    def object(self) -> dict:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.size,
            "created_at": int(self.created),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }


class Job:
    """What both providers' jobs have: an owner, a clock, records that finish over time."""

    provider = ""

    def __init__(self, id: str, key: str, created: float, seconds: float):
        self.id = id
        self.key = key
        self.created = created
        self.seconds = max(seconds, 1e-6)
        self.lock = threading.Lock()
        self.next = 0  # index of the next record to run
        self.never: list[int] = []  # records that never finish: they expire at the window's end
        self.cancel_at: float | None = None
        self.ended_at: float | None = None

    def at(self, fraction: float) -> float:
        return self.created + fraction * self.seconds


def openai_error(status: int, message: str, type="invalid_request_error", code=None, param=None, **extra) -> Answer:
    return Answer(status, {"error": {"message": message, "type": type, "param": param, "code": code}}, **extra)


def anthropic_error(status: int, message: str, type=None, **extra) -> Answer:
    body = {
        "type": "error",
        "error": {"type": type or ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message},
        "request_id": f"req_{_token(24)}",
    }
    return Answer(status, body, **extra)


def _read_body(handler) -> bytes:
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(parts)
            parts.append(handler.rfile.read(size))
            handler.rfile.readline()
    length = int(handler.headers.get("Content-Length") or 0)
    return handler.rfile.read(length) if length else b""


def parse_multipart(body: bytes, content_type: str) -> dict[str, tuple[str | None, bytes]]:
    """{field name: (filename or None, content)} of a multipart/form-data body; one copy of each part."""
    match = re.search(r'boundary="?([^";]+)"?', content_type)
    if not match:
        return {}
    delim = b"--" + match.group(1).encode()
    fields = {}
    pos = body.find(delim)
    while pos != -1:
        start = pos + len(delim)
        if body[start : start + 2] == b"--":
            break
        start = body.find(b"\r\n", start) + 2
        head_end = body.find(b"\r\n\r\n", start)
        if start < 2 or head_end == -1:
            break
        head = body[start:head_end].decode("utf-8", "replace")
        end = body.find(b"\r\n" + delim, head_end + 4)
        if end == -1:
            break
        name = re.search(r'\bname="([^"]*)"', head)
        filename = re.search(r'\bfilename="([^"]*)"', head)
        if name:
            fields[name.group(1)] = (filename.group(1) if filename else None, body[head_end + 4 : end])
        pos = end + 2
    return fields
