"""Google Vertex AI batch prediction for Claude: the records as one JSONL object in the host's Cloud Storage
bucket, a batchPredictionJob made from it, its predictions read back from the bucket. Every call carries the
host key's service-account access token (core.hostkinds.vertex mints and keeps it, as for live calls).

- Input: `{gcs_prefix}/{job hex}/input.jsonl` in the host's `gcs_bucket` (the Cloud Storage JSON API's simple
  upload), one `{"custom_id", "request"}` line per record; `request` is the rawPredict body (no `model`, no
  `stream`, `anthropic_version` vertex-2023-10-16), as the live call's envelope is. Its `gs://` URI is the
  job's upstream input file.
- Create: `POST {location}/batchPredictionJobs` with the model `publishers/anthropic/models/{upstream_name}`,
  the output under `{gcs_prefix}/{job hex}/output`, and the label `relay_job: <job hex>`. Vertex has no
  idempotency key: a lost create is found by that label (`filter=labels.relay_job="<hex>"`).
- Poll: `GET /v1/{name}` (the job's full resource name is its upstream id); JOB_STATE_QUEUED, PENDING,
  RUNNING, CANCELLING, PAUSED and UPDATING run; SUCCEEDED, PARTIALLY_SUCCEEDED, CANCELLED and EXPIRED ended;
  FAILED (and anything else) failed, a RESOURCE_EXHAUSTED error meaning "no room now". Counts are
  `completionStats`, int64 as strings.
- Results: every `*.jsonl` in the job's `outputInfo.gcsOutputDirectory` (Vertex names the directory and its
  files; they are listed, never guessed), one line per record echoing `custom_id` and `request` with a
  `response` (the Anthropic message) or an error in `response` / `status`. A job that ended before every
  record ran (EXPIRED, CANCELLED, or a PARTIALLY_SUCCEEDED one short of lines) wrote none for those: they come
  out expired (canceled when CANCELLED), their ids read from the input the relay wrote.
- Limits: Google documents none for Claude's batch beyond four concurrent jobs per project, so Anthropic's
  own (100,000 requests, 256 MB) are used. Claude batches need a regional location, not `global`."""

import json
import logging
import os
from collections.abc import Iterator
from typing import ClassVar
from urllib.parse import quote, urlencode

import orjson

from core import hostkinds
from core.retry_after import parse_retry_after
from gateway import upstream
from gateway.batch_apis.anthropic import ERROR_STATUS as _ERROR_STATUS  # the same error types
from gateway.batch_apis.base import (
    FIND_PAGES,
    BatchAPI,
    CloudClaudeJSONL,
    Refused,
    Result,
    Status,
    count,
    json_object,
    jsonl,
    result_row,
)

log = logging.getLogger(__name__)

ANTHROPIC_VERSION = "vertex-2023-10-16"
LABEL = "relay_job"
_RUNNING = {
    "JOB_STATE_QUEUED",
    "JOB_STATE_PENDING",
    "JOB_STATE_RUNNING",
    "JOB_STATE_CANCELLING",
    "JOB_STATE_PAUSED",
    "JOB_STATE_UPDATING",
}
_ENDED = {"JOB_STATE_SUCCEEDED", "JOB_STATE_PARTIALLY_SUCCEEDED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED"}
# Ended before every record ran: a record with no line did not run (CANCELLED: it was cancelled).
_UNFINISHED = {
    "JOB_STATE_EXPIRED": "expired",
    "JOB_STATE_PARTIALLY_SUCCEEDED": "expired",
    "JOB_STATE_CANCELLED": "canceled",
}
# google.rpc.Code RESOURCE_EXHAUSTED: a job failed for quota.
_RESOURCE_EXHAUSTED = 8


class VertexInput(CloudClaudeJSONL):
    """The JSONL object uploaded to Cloud Storage: one `{"custom_id": …, "request": <rawPredict body>}` a record."""

    id_field, body_field, anthropic_version = "custom_id", "request", ANTHROPIC_VERSION


class VertexBatchAPI(BatchAPI):
    kind = "vertex"
    label = "Google Vertex AI batch prediction"
    adapters: ClassVar[frozenset] = frozenset({"anthropic"})
    endpoints: ClassVar[frozenset] = frozenset({"/v1/messages"})
    max_records = 100_000
    max_bytes = 256 * 1024 * 1024
    line_overhead = 80
    input_file = VertexInput

    @classmethod
    def unready(cls, host) -> str:
        settings = _kind(host).option_values(getattr(host, "options", None))
        if not settings.get("gcs_bucket"):
            return "the host has no gcs_bucket"
        if settings.get("region") == "global":
            return "Claude batches on Vertex AI need a regional location, and the host's region is global"
        return ""

    # --- where: the host's settings ---

    @property
    def settings(self) -> dict:
        return _kind(self.host).option_values(self.host.options)

    @property
    def _folder(self) -> str:
        prefix = (self.settings.get("gcs_prefix") or "relay").strip("/")
        return f"{prefix}/{self.job.id.hex}"

    def _bucket_url(self, upload: bool = False) -> str:
        root = self.settings["storage_url"].rstrip("/")
        return f"{root}{'/upload' if upload else ''}/storage/v1/b/{quote(self.settings['gcs_bucket'], safe='')}/o"

    def _location_url(self) -> str:
        return _kind(self.host).location_url(self.host)

    def _resource_url(self, name: str) -> str:
        return f"{_kind(self.host).api_root(self.host)}/v1/{quote(name, safe='/')}"

    # --- calls with the service account's token ---

    def _google(self, method: str, url: str, *, data=None, headers=None, stream: bool = False):
        """One call with the key's access token; Refused on an error status (RESOURCE_EXHAUSTED is 429)."""
        auth = _kind(self.host).call_headers(self.host, self.target.key_value, key=self.target.key)
        sent = {"Accept": "application/json", **auth, **(headers or {})}
        resp = upstream.exchange(method, url, headers=sent, data=data, stream=stream)
        if resp.status_code >= 400:
            raw = resp.content if not stream else resp.raw.read(8192, decode_content=True)
            resp.close()
            raise Refused(resp.status_code, raw, parse_retry_after(resp.headers.get("retry-after")))
        return resp

    def _json(self, method: str, url: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if body is not None else {}
        return json_object(self._google(method, url, data=data, headers=headers))

    # --- the steps ---

    def upload(self, records: VertexInput) -> str:
        body = records.finish()
        name = f"{self._folder}/input.jsonl"
        size = os.fstat(body.fileno()).st_size
        query = urlencode({"uploadType": "media", "name": name}, quote_via=quote)
        headers = {"Content-Type": "application/jsonl", "Content-Length": str(size)}
        resp = self._google("POST", f"{self._bucket_url(upload=True)}?{query}", data=body, headers=headers)
        resp.close()
        return f"gs://{self.settings['gcs_bucket']}/{name}"

    def create(self, records: VertexInput) -> str:
        answer = self._json(
            "POST",
            f"{self._location_url()}/batchPredictionJobs",
            {
                "displayName": f"relay-job-{self.job.id.hex}",
                "model": f"publishers/anthropic/models/{self.binding.upstream_name}",
                "inputConfig": {"instancesFormat": "jsonl", "gcsSource": {"uris": [self.job.upstream_input_file_id]}},
                "outputConfig": {
                    "predictionsFormat": "jsonl",
                    "gcsDestination": {"outputUriPrefix": f"gs://{self.settings['gcs_bucket']}/{self._folder}/output"},
                },
                "labels": {LABEL: self.job.id.hex},
            },
        )
        name = answer.get("name")
        if not isinstance(name, str) or not name:
            raise Refused(502, b'{"error": "the provider answered the create without a job name"}')
        return name

    def status(self) -> Status:
        data = self._json("GET", self._resource_url(self.job.upstream_id))
        raw = str(data.get("state") or "")
        stats = data.get("completionStats") if isinstance(data.get("completionStats"), dict) else {}
        status = Status(
            phase="running" if raw in _RUNNING else "ended" if raw in _ENDED else "failed",
            raw_status=raw,
            completed=count(stats.get("successfulCount")),
            failed=count(stats.get("failedCount")),
        )
        error = data.get("error") if isinstance(data.get("error"), dict) else {}
        if status.phase == "failed":
            status.capacity = error.get("code") == _RESOURCE_EXHAUSTED
            status.message = str(error.get("message") or f"the provider's batch job is {raw or 'in no state'}")[:300]
        output = data.get("outputInfo") if isinstance(data.get("outputInfo"), dict) else {}
        directory = output.get("gcsOutputDirectory")
        status.sources = [directory] if isinstance(directory, str) and directory.startswith("gs://") else []
        return status

    def find(self, owned=frozenset()) -> str | None:
        """The job Vertex made from the job's lost create: the one labelled with the job's id (a label no other
        job carries); a failed one is not it (a send again makes a new one)."""
        token = None
        for _ in range(FIND_PAGES):
            query = {"filter": f'labels.{LABEL}="{self.job.id.hex}"', "pageSize": "100"}
            if token:
                query["pageToken"] = token
            page = self._json("GET", f"{self._location_url()}/batchPredictionJobs?{urlencode(query, quote_via=quote)}")
            for row in page.get("batchPredictionJobs") or []:
                if not isinstance(row, dict) or (row.get("labels") or {}).get(LABEL) != self.job.id.hex:
                    continue
                if row.get("state") != "JOB_STATE_FAILED" and row.get("name") not in owned:
                    return row.get("name")
            token = page.get("nextPageToken")
            if not token:
                return None
        return None

    def results(self, status: Status) -> Iterator[Result]:
        seen: set[str] = set()
        for directory in status.sources:
            bucket, _, prefix = directory.removeprefix("gs://").partition("/")
            for name in self._objects(bucket, prefix.rstrip("/") + "/"):
                if not name.endswith(".jsonl"):
                    continue
                for result in jsonl(self._download(bucket, name), self.parse_line):
                    seen.add(result.custom_id)
                    yield result
        unrun = _UNFINISHED.get(status.raw_status)
        if unrun is None or not self.job.upstream_input_file_id:
            return
        # The records the job never ran have no line: read their ids from the input the relay wrote.
        bucket, _, name = self.job.upstream_input_file_id.removeprefix("gs://").partition("/")
        for line in jsonl(self._download(bucket, name), _input_record):
            if line.custom_id and line.custom_id not in seen:
                yield Result(line.custom_id, unrun)

    def _objects(self, bucket: str, prefix: str) -> Iterator[str]:
        """The object names under `prefix` in `bucket` (the JSON API's list, page by page)."""
        root = self.settings["storage_url"].rstrip("/")
        token = None
        while True:
            query = {"prefix": prefix, "maxResults": "1000"}
            if token:
                query["pageToken"] = token
            url = f"{root}/storage/v1/b/{quote(bucket, safe='')}/o?{urlencode(query, quote_via=quote)}"
            page = self._json("GET", url)
            for item in page.get("items") or []:  # absent when the list is empty
                if isinstance(item, dict) and isinstance(item.get("name"), str):
                    yield item["name"]
            token = page.get("nextPageToken")
            if not token:
                return

    def _download(self, bucket: str, name: str):
        root = self.settings["storage_url"].rstrip("/")
        url = f"{root}/storage/v1/b/{quote(bucket, safe='')}/o/{quote(name, safe='')}?alt=media"
        return self._google("GET", url, stream=True)

    def cancel(self) -> None:
        self._google("POST", f"{self._resource_url(self.job.upstream_id)}:cancel", data=b"{}").close()

    @staticmethod
    def parse_line(line: bytes) -> Result:
        """One prediction line. Google shows no example of Claude's: a line echoes `custom_id` and `request` and
        adds `response` (the Anthropic message) and `status` (empty on success, else the error), the two
        columns its BigQuery output reserves; `response.body` and an `error` object are read too."""
        row = result_row(line)
        if row is None:
            return Result("", "errored")
        custom_id = str(row.get("custom_id") or "")
        response = row.get("response")
        if isinstance(response, dict) and isinstance(response.get("body"), dict):
            response = response["body"]
        problem = row.get("status") or row.get("error")
        if isinstance(response, dict) and response.get("type") == "message" and not problem:
            return Result(custom_id, "succeeded", 200, orjson.dumps(response), response)
        if isinstance(response, dict) and response.get("type") == "error" and isinstance(response.get("error"), dict):
            status = _ERROR_STATUS.get(response["error"].get("type"), 500)
            return Result(custom_id, "errored", status, orjson.dumps(response))
        if isinstance(problem, dict):
            code = count(problem.get("code"))
            message = str(problem.get("message") or "the provider returned no prediction for this record")
        else:
            code, message = 0, str(problem or "the provider returned no prediction for this record")
        status = code if 400 <= code < 600 else 500
        kind = "api_error" if status >= 500 else "invalid_request_error"
        body = {"type": "error", "error": {"type": kind, "message": message[:2000]}}
        return Result(custom_id, "errored", status, orjson.dumps(body))


def _kind(host):
    return hostkinds.of(host, "anthropic")


def _input_record(line: bytes) -> Result:
    row = result_row(line)
    return Result(str(row.get("custom_id") or "") if row else "", "expired")
