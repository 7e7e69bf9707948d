"""OpenAI's Batch API: the records as a JSONL file (Files API, `purpose=batch`), then a batch made from it
(`POST /v1/batches`) whose `metadata.relay_job` names the job, which is how a lost create is found again.
Results: an output file and an error file, one JSON line per record.

The same wire at an OpenAI-compatible server's base URL (`OpenAICompatibleBatchAPI`): its limits are the
host's settings, a lost create is found by its input file (a vendor may drop `metadata`), and a server with no
Batch API at all (vLLM, llama.cpp and most gateways answer 404 or 405) is told apart from a refused job."""

import json
import logging
import os
import re
from collections.abc import Iterator
from typing import ClassVar

import orjson

from gateway.batch_apis.base import (
    FIND_WINDOW,
    BatchAPI,
    InputFile,
    Refused,
    Result,
    Status,
    boundary,
    count,
    json_object,
    jsonl,
    new_id,
    result_row,
)

log = logging.getLogger(__name__)

_RUNNING = {"validating", "in_progress", "finalizing", "cancelling"}
_ENDED = {"completed", "expired", "cancelled"}


class OpenAIInput(InputFile):
    """A multipart/form-data body: `purpose=batch` and the JSONL file, one `{custom_id, method, url, body}`
    line per record."""

    def __init__(self, job):
        self.boundary = boundary()
        super().__init__(job)

    def head(self) -> bytes:
        return (
            f'--{self.boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{self.boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="relay-job-{self.job_id}.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
        ).encode()

    def line(self, custom_id: str, body: bytes) -> bytes:
        head = json.dumps({"custom_id": custom_id, "method": "POST", "url": self.endpoint})
        return head[:-1].encode() + b', "body": ' + body + b"}\n"

    def tail(self) -> bytes:
        return f"\r\n--{self.boundary}--\r\n".encode()


class OpenAIBatchAPI(BatchAPI):
    kind = "openai"
    label = "OpenAI"
    adapters: ClassVar[frozenset] = frozenset({"openai", "openai_responses"})
    endpoints: ClassVar[frozenset] = frozenset(
        {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"}
    )
    max_records = 50_000
    max_bytes = 200 * 1024 * 1024  # one input file
    input_file = OpenAIInput

    # Where the Files and Batches API sits under the host's base URL (Azure: under /openai).
    prefix: ClassVar[str] = ""

    def upload(self, records: OpenAIInput) -> str:
        body = records.finish()
        size = os.fstat(body.fileno()).st_size
        headers = {"Content-Type": f"multipart/form-data; boundary={records.boundary}", "Content-Length": str(size)}
        resp = self._call("POST", f"{self.prefix}/v1/files", data=body, headers=headers)
        return new_id(resp, "the provider answered the upload without a file id")

    def create_body(self) -> dict:
        return {
            "input_file_id": self.job.upstream_input_file_id,
            "endpoint": self.job.endpoint,
            "completion_window": f"{int(self.window.total_seconds() // 3600)}h",
            "metadata": {"relay_job": str(self.job.id)},
        }

    def create(self, records: OpenAIInput) -> str:
        resp = self._call("POST", f"{self.prefix}/v1/batches", data=json.dumps(self.create_body()).encode())
        return new_id(resp, "the provider answered the create without a batch id")

    @staticmethod
    def capacity_failure(first: dict) -> bool:
        """Whether a failed batch's first error means "no room now" (wait and send again), not a bad job."""
        return first.get("code") == "token_limit_exceeded"

    def status(self) -> Status:
        data = json_object(self._call("GET", f"{self.prefix}/v1/batches/{self.job.upstream_id}"))
        raw = str(data.get("status") or "").lower()  # Azure's may be capitalised ("Validating")
        counts = data.get("request_counts") if isinstance(data.get("request_counts"), dict) else {}
        status = Status(
            phase="running" if raw in _RUNNING else "ended" if raw in _ENDED else "failed",
            raw_status=raw,
            completed=count(counts.get("completed")),
            failed=count(counts.get("failed")),
        )
        if status.phase == "failed":
            errors = (data.get("errors") or {}).get("data") if isinstance(data.get("errors"), dict) else None
            first = errors[0] if isinstance(errors, list) and errors and isinstance(errors[0], dict) else {}
            status.capacity = self.capacity_failure(first)
            status.message = str(first.get("message") or first.get("code") or f"the provider's batch is {raw}")[:300]
        files = (data.get("output_file_id"), data.get("error_file_id"))
        status.sources = [f for f in files if isinstance(f, str) and f]
        return status

    def find(self, owned=frozenset()) -> str | None:
        """The upstream batch whose metadata names the job (its create answer was lost), if the provider has it."""
        job = self.job
        since = (job.submit_started_at or job.created_at) - FIND_WINDOW

        def matches(row: dict) -> bool:
            return (
                self.is_the_jobs(row)
                and str(row.get("status") or "").lower() != "failed"
                and row.get("id") not in owned
            )

        path = f"{self.prefix}/v1/batches"
        return self._list_find(path, "after", since, matches, lambda page, rows: rows[-1].get("id"))

    def is_the_jobs(self, row: dict) -> bool:
        """Whether a listed batch is the job's: its metadata names the job."""
        metadata = row.get("metadata") if isinstance(row.get("metadata"), dict) else {}
        return metadata.get("relay_job") == str(self.job.id)

    def results(self, status: Status) -> Iterator[Result]:
        for file_id in status.sources:
            resp = self._call("GET", f"{self.prefix}/v1/files/{file_id}/content", stream=True)
            yield from jsonl(resp, self.parse_line)

    def cancel(self) -> None:
        self._call("POST", f"{self.prefix}/v1/batches/{self.job.upstream_id}/cancel", data=b"{}").close()

    @staticmethod
    def parse_line(line: bytes) -> Result:
        row = result_row(line)
        if row is None:
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
        status = count(response.get("status_code")) or 500
        parsed = response.get("body")
        outcome = "succeeded" if 200 <= status < 300 else "errored"
        return Result(custom_id, outcome, status, orjson.dumps(parsed), parsed)


_DIGITS = re.compile(r"^[1-9][0-9]{0,11}\Z")


class OpenAICompatibleBatchAPI(OpenAIBatchAPI):
    """OpenAI's Files + Batches wire at an OpenAI-compatible server's base URL. Its limits are the host's own
    (`batch_max_requests`, `batch_max_bytes`), defaulting to OpenAI's. A lost create is found by its input file,
    which is the job's alone (a vendor may not keep `metadata`). A 404 or 405 on the Files or Batches path means
    the server has no Batch API: the refusal says so (`absent`), and the job's records run in the relay."""

    kind = "openai_compatible"
    label = "OpenAI-compatible Batch API"
    adapters: ClassVar[frozenset] = frozenset({"openai", "openai_responses"})

    @classmethod
    def limits(cls, host) -> tuple[int, int]:
        options = host.options if isinstance(getattr(host, "options", None), dict) else {}
        records, size = cls.max_records, cls.max_bytes
        if _DIGITS.match(str(options.get("batch_max_requests") or "")):
            records = int(options["batch_max_requests"])
        if _DIGITS.match(str(options.get("batch_max_bytes") or "")):
            size = int(options["batch_max_bytes"])
        return records, size

    def is_the_jobs(self, row: dict) -> bool:
        return super().is_the_jobs(row) or (
            bool(self.job.upstream_input_file_id) and row.get("input_file_id") == self.job.upstream_input_file_id
        )

    def _call(self, method: str, path: str, *, data=None, headers=None, stream=False):
        try:
            return super()._call(method, path, data=data, headers=headers, stream=stream)
        except Refused as exc:
            if exc.status in (404, 405) and method == "POST" and path in ("/v1/files", "/v1/batches"):
                raise Refused(exc.status, exc.body, exc.retry_after, absent=True) from None
            raise
