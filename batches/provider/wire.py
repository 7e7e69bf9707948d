"""The providers' batch APIs, as the jobs need them: send a job, read its status, find a job whose create
outcome was lost, cancel it, and read its results line by line. OpenAI: Files + Batches (the records as a
JSONL file, `metadata.relay_job` naming the job). Anthropic: Message Batches (the records in the create
body; no metadata, so a lost create is found by the relay-made custom_ids in a candidate's results, never by
its size and time alone, and so are its results). Every call goes through relay.upstream's `exchange` (the
one HTTP choke point)."""

import json
import logging
import os
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import orjson

from relay import adapters, upstream
from relay.retry_after import parse_retry_after

log = logging.getLogger(__name__)

# How far back a lost create is looked for, and how many pages of the provider's list are read at most.
FIND_WINDOW = timedelta(minutes=30)
FIND_PAGES = 10


class NotYetKnown(Exception):
    """A lost create cannot be decided yet: a candidate batch that may be the job's has not ended, and its
    results (which name its records) are the only proof of whose it is. Look again later; never create."""


class LeaseLost(Exception):
    """The job's lease passed to another taker while this process was sending it: the send is abandoned
    (the body is cut off unfinished, so the provider creates nothing from it)."""


class Refused(Exception):
    """The provider answered a call with an error status. `capacity`: it has no room now (429, or a job it
    failed for its enqueued-token limit): wait and send again. `key`: the key was refused (401/403)."""

    def __init__(self, status: int, body: bytes, retry_after: float | None = None):
        super().__init__(f"provider answered {status}")
        self.status, self.body, self.retry_after = status, body[:8192], retry_after

    @property
    def capacity(self) -> bool:
        return self.status == 429

    @property
    def key(self) -> bool:
        return self.status in (401, 403)

    @property
    def transient(self) -> bool:
        return self.status >= 500 or self.status in (408, 409)


@dataclass
class Status:
    """A job as the provider shows it. `phase`: running | ended | failed; `capacity`: a failure that means
    "no room now" (OpenAI's token_limit_exceeded)."""

    phase: str
    raw_status: str
    completed: int = 0
    failed: int = 0
    capacity: bool = False
    message: str = ""
    sources: list = field(default_factory=list)  # where the results are: file ids (OpenAI) or a URL


@dataclass
class Result:
    """One record's result, normalized: succeeded | errored | canceled | expired."""

    custom_id: str
    outcome: str
    status_code: int | None = None
    body: bytes = b""
    parsed: object = None  # the body as parsed from the line (its usage is read from it, not parsed again)


@dataclass
class Target:
    """Where and with which key a job talks to its provider."""

    base_url: str
    adapter: str
    key_value: str
    # The host key, for the provider account it bills (OpenAI-Organization / OpenAI-Project): a job's headers
    # are the operator's, as a live call's are (relay.adapters); no caller header reaches a provider job.
    key: object = None

    def url(self, path: str) -> str:
        return adapters.upstream_url(self.base_url, path)

    def headers(self, **extra) -> dict:
        return {**adapters.upstream_headers(self.adapter, self.key_value, key=self.key), **extra}


def _call(target: Target, method: str, path: str, *, data=None, headers=None, stream=False):
    resp = upstream.exchange(
        method, target.url(path), headers={**target.headers(), **(headers or {})}, data=data, stream=stream
    )
    return _accepted(resp, stream)


def _accepted(resp, stream: bool):
    """`resp`, unless the provider refused it (status ≥ 400): then Refused, with its body and Retry-After."""
    if resp.status_code >= 400:
        body = resp.content if not stream else resp.raw.read(8192, decode_content=True)
        resp.close()
        raise Refused(resp.status_code, body, parse_retry_after(resp.headers.get("retry-after")))
    return resp


def _jsonl(resp, parse) -> Iterator[Result]:
    """Each non-blank line of a streamed results file, parsed; the response is closed however it ends."""
    try:
        for line in resp.iter_lines():
            if line.strip():
                yield parse(line)
    finally:
        resp.close()


def _find_listed(target: Target, path: str, cursor: str, since, matches, next_after) -> str | None:
    """The id of the first batch on the provider's list (newest first, FIND_PAGES pages of 100 at most) that
    `matches`, looking no further back than `since`. `cursor` names the list's paging parameter and
    `next_after(page, rows)` gives its next value."""
    after = None
    for _ in range(FIND_PAGES):
        query = "?limit=100" + (f"&{cursor}={after}" if after else "")
        page = _json(_call(target, "GET", f"{path}{query}"))
        rows = [r for r in page.get("data") or [] if isinstance(r, dict)]
        for row in rows:
            if matches(row):
                return row.get("id")
        if not page.get("has_more") or not rows or _created(rows[-1]) < since:
            return None
        after = next_after(page, rows)
    return None


def _json(resp) -> dict:
    try:
        value = resp.json()
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {}


class InputFile:
    """A job's records written once to a temporary file in the shape its API takes (streamed from there)."""

    def __init__(self, kind: str, job_id, endpoint: str):
        self.kind, self.endpoint = kind, endpoint
        self.boundary = f"relay-{uuid.uuid4().hex}"
        self.file = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        self.records = 0
        self.on_read = None
        if kind == "openai":
            self.file.write(
                (
                    f'--{self.boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                    f'--{self.boundary}\r\nContent-Disposition: form-data; name="file"; '
                    f'filename="relay-job-{job_id}.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
                ).encode()
            )
        else:
            self.file.write(b'{"requests": [')

    def add(self, custom_id: str, body: bytes) -> None:
        if self.kind == "openai":
            head = json.dumps({"custom_id": custom_id, "method": "POST", "url": self.endpoint})
            self.file.write(head[:-1].encode() + b', "body": ' + body + b"}\n")
        else:
            sep = b", " if self.records else b""
            self.file.write(sep + json.dumps({"custom_id": custom_id}).encode()[:-1] + b', "params": ' + body + b"}")
        self.records += 1

    def finish(self):
        """The body to send, from its start. With `on_read` set (a callable raising LeaseLost), it is called as
        the body is read out, so a sender that lost its job stops mid-body."""
        self.file.write(f"\r\n--{self.boundary}--\r\n".encode() if self.kind == "openai" else b"]}")
        self.file.flush()
        self.file.seek(0)
        return _Guarded(self.file, self.on_read) if self.on_read is not None else self.file

    def close(self) -> None:
        self.file.close()


class _Guarded:
    """A body file whose every read first asks `check` (which raises to stop the send). requests streams a
    body with `read` and sizes it by `fileno`, `mode` and `tell` (a body it cannot size goes chunked), so those
    are the file's own."""

    def __init__(self, file, check):
        self.file, self.check = file, check
        self.mode = file.mode

    def read(self, size=-1):
        self.check()
        return self.file.read(size)

    def fileno(self):
        return self.file.fileno()

    def tell(self):
        return self.file.tell()

    def seek(self, *args):
        return self.file.seek(*args)

    def __iter__(self):
        return iter(lambda: self.read(64 * 1024), b"")


# --- OpenAI: Files + Batches ----------------------------------------------------------------------

_OPENAI_RUNNING = {"validating", "in_progress", "finalizing", "cancelling"}
_OPENAI_ENDED = {"completed", "expired", "cancelled"}


def openai_upload(target: Target, records: InputFile) -> str:
    body = records.finish()
    size = os.fstat(body.fileno()).st_size
    resp = _call(
        target,
        "POST",
        "/v1/files",
        data=body,
        headers={"Content-Type": f"multipart/form-data; boundary={records.boundary}", "Content-Length": str(size)},
    )
    file_id = _json(resp).get("id")
    if not isinstance(file_id, str) or not file_id:
        raise Refused(502, b'{"error": "the provider answered the upload without a file id"}')
    return file_id


def openai_create(target: Target, job, file_id: str) -> str:
    body = {
        "input_file_id": file_id,
        "endpoint": job.endpoint,
        "completion_window": "24h",
        "metadata": {"relay_job": str(job.id)},
    }
    resp = _call(target, "POST", "/v1/batches", data=json.dumps(body).encode())
    upstream_id = _json(resp).get("id")
    if not isinstance(upstream_id, str) or not upstream_id:
        raise Refused(502, b'{"error": "the provider answered the create without a batch id"}')
    return upstream_id


def openai_status(target: Target, upstream_id: str) -> Status:
    data = _json(_call(target, "GET", f"/v1/batches/{upstream_id}"))
    raw = str(data.get("status") or "")
    counts = data.get("request_counts") if isinstance(data.get("request_counts"), dict) else {}
    status = Status(
        phase="running" if raw in _OPENAI_RUNNING else "ended" if raw in _OPENAI_ENDED else "failed",
        raw_status=raw,
        completed=_int(counts.get("completed")),
        failed=_int(counts.get("failed")),
    )
    if status.phase == "failed":
        errors = (data.get("errors") or {}).get("data") if isinstance(data.get("errors"), dict) else None
        first = errors[0] if isinstance(errors, list) and errors and isinstance(errors[0], dict) else {}
        status.capacity = first.get("code") == "token_limit_exceeded"
        status.message = str(first.get("message") or first.get("code") or f"the provider's batch is {raw}")[:300]
    status.sources = [f for f in (data.get("output_file_id"), data.get("error_file_id")) if isinstance(f, str) and f]
    return status


def openai_find(target: Target, job) -> str | None:
    """The upstream batch whose metadata names the job (its create answer was lost), if the provider has it."""
    since = (job.submit_started_at or job.created_at) - FIND_WINDOW

    def matches(row: dict) -> bool:
        return (row.get("metadata") or {}).get("relay_job") == str(job.id) and row.get("status") != "failed"

    return _find_listed(target, "/v1/batches", "after", since, matches, lambda page, rows: rows[-1].get("id"))


def openai_results(target: Target, status: Status) -> Iterator[Result]:
    for file_id in status.sources:
        yield from _jsonl(_call(target, "GET", f"/v1/files/{file_id}/content", stream=True), _openai_line)


def _openai_line(line: bytes) -> Result:
    try:
        row = orjson.loads(line)
    except ValueError:
        return Result("", "errored")
    custom_id = str(row.get("custom_id") or "")
    error = row.get("error")
    if isinstance(error, dict) and error:
        code = error.get("code")
        if code == "batch_expired":
            return Result(custom_id, "expired")
        if code == "batch_cancelled":
            return Result(custom_id, "canceled")
        return Result(custom_id, "errored", 500, orjson.dumps({"error": error}))
    response = row.get("response") if isinstance(row.get("response"), dict) else {}
    status = _int(response.get("status_code")) or 500
    parsed = response.get("body")
    return Result(custom_id, "succeeded" if 200 <= status < 300 else "errored", status, orjson.dumps(parsed), parsed)


# --- Anthropic: Message Batches -------------------------------------------------------------------

_ANTHROPIC_ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "overloaded_error": 529,
}


def anthropic_create(target: Target, records: InputFile) -> str:
    body = records.finish()
    size = os.fstat(body.fileno()).st_size
    resp = _call(target, "POST", "/v1/messages/batches", data=body, headers={"Content-Length": str(size)})
    upstream_id = _json(resp).get("id")
    if not isinstance(upstream_id, str) or not upstream_id:
        raise Refused(502, b'{"error": "the provider answered the create without a batch id"}')
    return upstream_id


def anthropic_status(target: Target, upstream_id: str) -> Status:
    data = _json(_call(target, "GET", f"/v1/messages/batches/{upstream_id}"))
    raw = str(data.get("processing_status") or "")
    counts = data.get("request_counts") if isinstance(data.get("request_counts"), dict) else {}
    status = Status(
        phase="ended" if raw == "ended" else "running",
        raw_status=raw,
        completed=_int(counts.get("succeeded")),
        failed=sum(_int(counts.get(k)) for k in ("errored", "canceled", "expired")),
    )
    if isinstance(data.get("results_url"), str) and data["results_url"]:
        status.sources = [data["results_url"]]
    return status


def anthropic_find(target: Target, job, owned=frozenset()) -> str | None:
    """The message batch the job's lost create made, if the provider has it. Anthropic keeps no metadata, and
    two jobs of one size sent together look alike: a candidate (made within the window of the job's send
    with exactly its number of requests) is the job's only if its results name the job's own relay-made
    custom_ids. A candidate still running cannot be read yet: NotYetKnown (look again), never adopted.
    `owned`: upstream ids other jobs already hold (never candidates: a job waits only on unclaimed ones)."""
    since = (job.submit_started_at or job.created_at) - timedelta(seconds=5)
    unread = []

    def matches(row: dict) -> bool:
        counts = row.get("request_counts") if isinstance(row.get("request_counts"), dict) else {}
        if _created(row) < since or sum(_int(v) for v in counts.values()) != job.records or row.get("id") in owned:
            return False
        if row.get("processing_status") != "ended" or not isinstance(row.get("results_url"), str):
            unread.append(row.get("id"))
            return False
        return _first_custom_id(target, row["results_url"]).partition("-")[0] == job.id.hex

    found = _find_listed(
        target,
        "/v1/messages/batches",
        "after_id",
        since,
        matches,
        lambda page, rows: page.get("last_id") or rows[-1].get("id"),
    )
    if found is None and unread:
        raise NotYetKnown(f"{len(unread)} candidate batch(es) still running: {', '.join(map(str, unread[:3]))}")
    return found


def _first_custom_id(target: Target, url: str) -> str:
    """The custom_id of a message batch's first result (the rest is not read)."""
    resp = _accepted(upstream.exchange("GET", url, headers=target.headers(), stream=True), stream=True)
    lines = _jsonl(resp, _anthropic_line)
    try:
        for result in lines:
            if result.custom_id:
                return result.custom_id
        return ""
    finally:
        lines.close()  # closes the response: the rest of the results is never downloaded


def anthropic_results(target: Target, status: Status) -> Iterator[Result]:
    for url in status.sources:  # results_url is absolute: not a path under the target
        resp = upstream.exchange("GET", url, headers=target.headers(), stream=True)
        yield from _jsonl(_accepted(resp, stream=True), _anthropic_line)


def _anthropic_line(line: bytes) -> Result:
    try:
        row = orjson.loads(line)
    except ValueError:
        return Result("", "errored")
    custom_id = str(row.get("custom_id") or "")
    result = row.get("result") if isinstance(row.get("result"), dict) else {}
    kind = result.get("type")
    if kind == "succeeded":
        message = result.get("message")
        return Result(custom_id, "succeeded", 200, orjson.dumps(message), message)
    if kind in ("canceled", "expired"):
        return Result(custom_id, kind)
    error = result.get("error") if isinstance(result.get("error"), dict) else {"type": "error", "error": {}}
    inner = error.get("error") if isinstance(error.get("error"), dict) else {}
    return Result(custom_id, "errored", _ANTHROPIC_ERROR_STATUS.get(inner.get("type"), 500), orjson.dumps(error))


# --- both ---------------------------------------------------------------------------------------


def cancel(target: Target, kind: str, upstream_id: str) -> None:
    path = f"/v1/batches/{upstream_id}/cancel" if kind == "openai" else f"/v1/messages/batches/{upstream_id}/cancel"
    _call(target, "POST", path, data=b"{}").close()


def status(target: Target, kind: str, upstream_id: str) -> Status:
    return openai_status(target, upstream_id) if kind == "openai" else anthropic_status(target, upstream_id)


def find(target: Target, job, owned=frozenset()) -> str | None:
    return openai_find(target, job) if job.kind == "openai" else anthropic_find(target, job, owned)


def results(target: Target, kind: str, st: Status) -> Iterator[Result]:
    return openai_results(target, st) if kind == "openai" else anthropic_results(target, st)


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _created(row: dict) -> datetime:
    value = row.get("created_at")
    if isinstance(value, int | float):  # OpenAI: Unix seconds
        return datetime.fromtimestamp(value, UTC)
    if isinstance(value, str):  # Anthropic: RFC 3339
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            pass
    return datetime.max.replace(tzinfo=UTC)
