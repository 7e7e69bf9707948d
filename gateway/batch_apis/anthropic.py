"""Anthropic's Message Batches API: the records in the create body (`POST /v1/messages/batches`,
`{"requests": [{custom_id, params}]}`), no input file and no metadata, so a lost create is found by the
relay-made custom_ids in a candidate's results, never by its size and time alone. Results: one JSON line per
record at the batch's `results_url`."""

import json
import logging
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import ClassVar

import orjson

from gateway.batch_apis.base import (
    BatchAPI,
    InputFile,
    NotYetKnown,
    Result,
    Status,
    count,
    created,
    json_object,
    jsonl,
    new_id,
    result_row,
)

log = logging.getLogger(__name__)

# A candidate for a lost create is made no earlier than this before the job's send began (clocks differ).
FIND_SLACK = timedelta(seconds=5)

ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "overloaded_error": 529,
}


class AnthropicInput(InputFile):
    """The create's JSON body: `{"requests": [{"custom_id": …, "params": <body>}, …]}`."""

    def head(self) -> bytes:
        return b'{"requests": ['

    def line(self, custom_id: str, body: bytes) -> bytes:
        sep = b", " if self.records else b""
        return sep + json.dumps({"custom_id": custom_id}).encode()[:-1] + b', "params": ' + body + b"}"

    def tail(self) -> bytes:
        return b"]}"


class AnthropicBatchAPI(BatchAPI):
    kind = "anthropic"
    label = "Anthropic"
    adapters: ClassVar[frozenset] = frozenset({"anthropic"})
    endpoints: ClassVar[frozenset] = frozenset({"/v1/messages"})
    max_records = 100_000
    max_bytes = 256 * 1024 * 1024  # one create body
    input_file = AnthropicInput

    def create(self, records: AnthropicInput) -> str:
        body = records.finish()
        size = os.fstat(body.fileno()).st_size
        resp = self._call("POST", "/v1/messages/batches", data=body, headers={"Content-Length": str(size)})
        return new_id(resp, "the provider answered the create without a batch id")

    def status(self) -> Status:
        data = json_object(self._call("GET", f"/v1/messages/batches/{self.job.upstream_id}"))
        raw = str(data.get("processing_status") or "")
        counts = data.get("request_counts") if isinstance(data.get("request_counts"), dict) else {}
        status = Status(
            phase="ended" if raw == "ended" else "running",
            raw_status=raw,
            completed=count(counts.get("succeeded")),
            failed=sum(count(counts.get(k)) for k in ("errored", "canceled", "expired")),
        )
        if isinstance(data.get("results_url"), str) and data["results_url"]:
            status.sources = [data["results_url"]]
        return status

    def find(self, owned=frozenset()) -> str | None:
        """The message batch the job's lost create made, if the provider has it. Anthropic keeps no metadata,
        and two jobs of one size sent together look alike: a candidate (made within the window of the job's
        send with exactly its number of requests) is the job's only if its results name the job's own
        relay-made custom_ids. A candidate still running cannot be read yet: NotYetKnown (look again), never
        adopted. `owned`: upstream ids other jobs already hold (never candidates: a job waits only on
        unclaimed ones)."""
        job = self.job
        since = (job.submit_started_at or job.created_at) - FIND_SLACK
        unread = []

        def matches(row: dict) -> bool:
            counts = row.get("request_counts") if isinstance(row.get("request_counts"), dict) else {}
            if created(row) < since or sum(count(v) for v in counts.values()) != job.records or row.get("id") in owned:
                return False
            if row.get("processing_status") != "ended" or not isinstance(row.get("results_url"), str):
                unread.append(row.get("id"))
                return False
            return self._first_custom_id(row["results_url"]).partition("-")[0] == job.id.hex

        found = self._list_find(
            "/v1/messages/batches",
            "after_id",
            since,
            matches,
            lambda page, rows: page.get("last_id") or rows[-1].get("id"),
        )
        if found is None and unread:
            raise NotYetKnown(f"{len(unread)} candidate batch(es) still running: {', '.join(map(str, unread[:3]))}")
        return found

    def _first_custom_id(self, url: str) -> str:
        """The custom_id of a message batch's first result (the rest is not read)."""
        lines = jsonl(self._stream(url), self.parse_line)
        try:
            for result in lines:
                if result.custom_id:
                    return result.custom_id
            return ""
        finally:
            lines.close()  # closes the response: the rest of the results is never downloaded

    def results(self, status: Status) -> Iterator[Result]:
        for url in status.sources:  # results_url is absolute: not a path under the target
            yield from jsonl(self._stream(url), self.parse_line)

    def cancel(self) -> None:
        self._call("POST", f"/v1/messages/batches/{self.job.upstream_id}/cancel", data=b"{}").close()

    @staticmethod
    def parse_line(line: bytes) -> Result:
        row = result_row(line)
        if row is None:
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
        return Result(custom_id, "errored", ERROR_STATUS.get(inner.get("type"), 500), orjson.dumps(error))
