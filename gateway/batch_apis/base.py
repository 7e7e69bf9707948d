"""What every provider's batch API has in common: the `BatchAPI` interface the job code calls, the shapes it
answers in (`Status`, `Result`), the refusals it raises, where and with which key it talks (`Target`), and the
input file the records are written to once and streamed from. Nothing here names a provider; each provider's
module (openai.py, anthropic.py) subclasses `BatchAPI` and `InputFile`, and the package's registry names it.

Imports nothing from `batches`: a provider's batch wire is the host kind's business, and this package can move
down to the gateway layer unchanged (docs/decisions/0018-provider-batch-apis.md)."""

import abc
import json
import logging
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import ClassVar

import orjson

from core import hostkinds
from core.retry_after import parse_retry_after
from gateway import adapters, upstream

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
    """The provider answered a call with an error status. `capacity`: it has no room now (429, or what its API
    says means so: Bedrock's 400 ServiceQuotaExceededException): wait and send again. `key`: the key was
    refused (401/403). `transient`: try again after a pause. `absent`: the host has no batch API at all (an
    OpenAI-compatible server answering 404/405 on the Files or Batches path): its records run in the relay."""

    def __init__(
        self,
        status: int,
        body: bytes,
        retry_after: float | None = None,
        *,
        capacity: bool | None = None,
        absent: bool = False,
    ):
        super().__init__(f"provider answered {status}")
        self.status, self.body, self.retry_after = status, body[:8192], retry_after
        self._capacity, self.absent = capacity, absent

    @property
    def capacity(self) -> bool:
        return self.status == 429 if self._capacity is None else self._capacity

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
    # are the operator's, as a live call's are (gateway.adapters); no caller header reaches a provider job.
    key: object = None
    # The catalog rows the job is sent through: the host's kind signs (api-key, SigV4) and its settings say
    # where its storage and control plane are; the binding names the upstream model. None: read by the API
    # from the job's own ids (BatchAPI.host / .binding).
    host: object = None
    binding: object = None

    @classmethod
    def of(cls, binding, key, key_value: str) -> "Target":
        """The target of a job sent through `binding` with host key `key` (whose secret is `key_value`)."""
        return cls(binding.host.base_url, binding.adapter, key_value, key, host=binding.host, binding=binding)

    def url(self, path: str) -> str:
        return adapters.upstream_url(self.base_url, path)

    def headers(self, **extra) -> dict:
        if self.host is not None and getattr(self.host, "kind", ""):
            # The host's kind's own credential headers (Azure's api-key), as its live calls carry.
            kind = hostkinds.of(self.host, self.adapter)
            auth = {"Content-Type": "application/json", "Accept": "application/json"}
            auth.update(kind.auth_headers(self.key_value, key=self.key))
            return {**auth, **extra}
        return {**adapters.upstream_headers(self.adapter, self.key_value, key=self.key), **extra}


# --- the input: written once, streamed out ---------------------------------------------------------------


class InputFile(abc.ABC):
    """A job's records written once to a temporary file in the shape its API takes, sent from there (the
    upload's body, or the create's). A provider's subclass says how the body starts, how each record is
    framed and how it ends; `job` gives what the framing names (its id, its records' endpoint)."""

    def __init__(self, job):
        self.job_id, self.endpoint = job.pk, job.endpoint
        self.file = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        self.records = 0
        self.on_read = None
        self.file.write(self.head())

    @abc.abstractmethod
    def head(self) -> bytes: ...

    @abc.abstractmethod
    def line(self, custom_id: str, body: bytes) -> bytes:
        """One record, as it sits in the body (after `self.records` others)."""

    @abc.abstractmethod
    def tail(self) -> bytes: ...

    def add(self, custom_id: str, body: bytes) -> None:
        self.file.write(self.line(custom_id, body))
        self.records += 1

    def finish(self):
        """The body to send, from its start. With `on_read` set (a callable raising LeaseLost), it is called as
        the body is read out, so a sender that lost its job stops mid-body."""
        self.file.write(self.tail())
        self.file.flush()
        self.file.seek(0)
        return _Guarded(self.file, self.on_read) if self.on_read is not None else self.file

    def close(self) -> None:
        self.file.close()


class CloudClaudeJSONL(InputFile):
    """A JSONL object of Claude records in a cloud's envelope, one `{<id_field>: …, <body_field>: <body>}` a line:
    the live call's body without `model` and `stream` (the job names the model; nothing is streamed) and with the
    cloud's `anthropic_version`. Bedrock's (`recordId`, `modelInput`) and Vertex's (`custom_id`, `request`)."""

    id_field = ""
    body_field = ""
    anthropic_version = ""
    NOT_IN_BODY = ("model", "stream")

    def head(self) -> bytes:
        return b""

    def line(self, custom_id: str, body: bytes) -> bytes:
        try:
            fields = json.loads(body)
        except ValueError:
            fields = None
        if isinstance(fields, dict):
            for name in self.NOT_IN_BODY:
                fields.pop(name, None)
            fields.setdefault("anthropic_version", self.anthropic_version)
            body = json.dumps(fields).encode()
        head = json.dumps({self.id_field: custom_id}).encode()[:-1]
        return head + b", " + json.dumps(self.body_field).encode() + b": " + body + b"}\n"

    def tail(self) -> bytes:
        return b""


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


# --- the interface ---------------------------------------------------------------------------------------


class BatchAPI(abc.ABC):
    """One provider's batch API, bound to one job and the target (host, key) it is sent with. The job code
    (batches/provider/jobs.py, placement.py) reads the class's limits and calls these methods only; it never
    asks which provider it talks to. Every call goes through gateway.upstream's `exchange` (the one HTTP exit).

    A job's steps, in order: `records()` (the input file the job writes its records to), `upload(records)`
    (an input file the provider keeps apart, if it has such; its id is stored on the job and reused by a
    later send with the same key), `create(records)` (the upstream batch; its id is the job's `upstream_id`),
    `status()` (one poll), `results(status)` (the records' results, streamed), `cancel()`. `find(owned)` is
    the reconciliation of a create whose answer was lost: the upstream batch the job made, if any."""

    kind: ClassVar[str]  # the registry's name, stored on ProviderJob.kind: the host kind whose batch API it is
    label: ClassVar[str]  # the product's name, for people (admin filters, logs)
    adapters: ClassVar[frozenset]  # the binding adapters whose records it takes
    endpoints: ClassVar[frozenset]  # the record paths it batches
    max_records: ClassVar[int]  # the provider's limits per job: requests …
    max_bytes: ClassVar[int]  # … and bytes of the input
    window: ClassVar[timedelta] = timedelta(hours=24)  # the completion window a job is created with
    line_overhead: ClassVar[int] = 160  # bytes a record's framing adds to its body, counted toward max_bytes
    # The fewest records a job may carry (Bedrock refuses a job under 100): a smaller one runs in the relay.
    min_records: ClassVar[int] = 1
    input_file: ClassVar[type[InputFile]]

    def __init__(self, target: Target, job):
        self.target, self.job = target, job

    # --- what placement asks of a host, before any job exists ---

    @classmethod
    def limits(cls, host) -> tuple[int, int]:
        """(records, bytes) a job sent to `host` may carry: the provider's, unless the host's settings say
        less (an OpenAI-compatible server's own limits)."""
        return cls.max_records, cls.max_bytes

    @classmethod
    def unready(cls, host) -> str:
        """Why `host` cannot take batch jobs as it is set up ("" when it can): Bedrock needs a bucket and a
        service role. Its records then run in the relay, with the reason as their note."""
        return ""

    # --- the catalog rows the job goes through ---

    @property
    def host(self):
        """The job's host (the target's, else read by the job's `host_id`)."""
        if self.target is not None and self.target.host is not None:
            return self.target.host
        if not hasattr(self, "_host"):
            from core.models import Host

            self._host = Host.objects.get(pk=self.job.host_id)
        return self._host

    @property
    def binding(self):
        """The job's binding (the target's, else read by the job's `binding_id`): its upstream model name."""
        if self.target is not None and self.target.binding is not None:
            return self.target.binding
        if not hasattr(self, "_binding"):
            from core.models import HostBinding

            self._binding = HostBinding.objects.select_related("host").get(pk=self.job.binding_id)
        return self._binding

    def records(self) -> InputFile:
        return self.input_file(self.job)

    def upload(self, records: InputFile) -> str | None:
        """The records as an input file the provider keeps apart: its id. None (the default): the provider
        takes the records in the create itself, and nothing is uploaded."""
        return None

    @abc.abstractmethod
    def create(self, records: InputFile) -> str:
        """The upstream batch (from the job's uploaded file, `job.upstream_input_file_id`, or from `records`):
        its id. Raises Refused, or an UpstreamError when no answer came (the create may have happened)."""

    @abc.abstractmethod
    def status(self) -> Status:
        """The job's upstream batch (`job.upstream_id`) as the provider shows it now."""

    @abc.abstractmethod
    def find(self, owned=frozenset()) -> str | None:
        """The upstream batch the job's lost create made, if the provider has it; None when it has none.
        `owned`: upstream ids other jobs already hold (never the job's). Raises NotYetKnown when a candidate
        cannot be told apart yet (look again later; never create)."""

    @abc.abstractmethod
    def results(self, status: Status) -> Iterator[Result]:
        """The records' results of an ended job, streamed line by line."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Ask the provider to stop the job's upstream batch (its poll sees it end)."""

    @staticmethod
    @abc.abstractmethod
    def parse_line(line: bytes) -> Result:
        """One line of the provider's results, normalized (a line that does not parse: `errored`, no id)."""

    # --- helpers for the subclasses ---

    def _call(self, method: str, path: str, *, data=None, headers=None, stream=False):
        """One call to a path under the target's base URL, with its key's headers; Refused on an error status."""
        headers = {**self._auth(), **(headers or {})}
        resp = upstream.exchange(method, self.target.url(path), headers=headers, data=data, stream=stream)
        return accepted(resp, stream)

    def _stream(self, url: str):
        """An absolute URL the provider gave (Anthropic's results_url), read streamed with the target's key."""
        return accepted(upstream.exchange("GET", url, headers=self._auth(), stream=True), stream=True)

    def _auth(self) -> dict:
        """The target's headers, signed as the job's host's kind signs (its host read by id when the target
        was made without it)."""
        target = self.target
        if target.host is None and getattr(self.job, "host_id", None) is not None:
            target = replace(target, host=self.host)
        return target.headers()

    def _list_find(self, path: str, cursor: str, since, matches, next_after) -> str | None:
        """The id of the first batch on the provider's list (newest first, FIND_PAGES pages of 100 at most) that
        `matches`, looking no further back than `since`. `cursor` names the list's paging parameter and
        `next_after(page, rows)` gives its next value."""
        after = None
        for _ in range(FIND_PAGES):
            query = "?limit=100" + (f"&{cursor}={after}" if after else "")
            page = json_object(self._call("GET", f"{path}{query}"))
            rows = [r for r in page.get("data") or [] if isinstance(r, dict)]
            for row in rows:
                if matches(row):
                    return row.get("id")
            if not page.get("has_more") or not rows or created(rows[-1]) < since:
                return None
            after = next_after(page, rows)
        return None


def accepted(resp, stream: bool):
    """`resp`, unless the provider refused it (status ≥ 400): then Refused, with its body and Retry-After."""
    if resp.status_code >= 400:
        body = resp.content if not stream else resp.raw.read(8192, decode_content=True)
        resp.close()
        raise Refused(resp.status_code, body, parse_retry_after(resp.headers.get("retry-after")))
    return resp


def jsonl(resp, parse) -> Iterator[Result]:
    """Each non-blank line of a streamed results file, parsed; the response is closed however it ends."""
    try:
        for line in resp.iter_lines():
            if line.strip():
                yield parse(line)
    finally:
        resp.close()


def result_row(line: bytes) -> dict | None:
    """One results line as the object every provider's line is; None for anything else (a line that is not
    JSON, or JSON but not an object), which becomes an error with no record id."""
    try:
        row = orjson.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def json_object(resp) -> dict:
    try:
        value = resp.json()
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {}


def new_id(resp, missing: str) -> str:
    """The `id` of an upload's or a create's answer; an answer without one is the provider's fault (502,
    `missing` saying which)."""
    value = json_object(resp).get("id")
    if not isinstance(value, str) or not value:
        raise Refused(502, orjson.dumps({"error": missing}))
    return value


def count(value) -> int:
    if isinstance(value, str) and value.isascii() and value.isdigit():  # int64 in proto3 JSON: a string
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def created(row: dict, field: str = "created_at") -> datetime:
    value = row.get(field)
    if isinstance(value, int | float):  # OpenAI: Unix seconds
        return datetime.fromtimestamp(value, UTC)
    if isinstance(value, str):  # Anthropic, Azure's older versions, Bedrock: RFC 3339
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            pass
    return datetime.max.replace(tzinfo=UTC)


def boundary() -> str:
    return f"relay-{uuid.uuid4().hex}"
