"""Amazon Bedrock batch inference (model invocation jobs): the records as one JSONL object in the host's S3
bucket, a job made from it on Bedrock's control plane (`bedrock.{region}.amazonaws.com`, not the runtime host),
its results read back from S3. Every call is SigV4-signed with botocore's signer (service `bedrock` for the
control plane, `s3` for the bucket), with the host key's secret and the host's access key id, as its live
calls are (core.hostkinds.bedrock).

- Input: `{prefix}/{job hex}/input.jsonl` in the host's `batch_bucket`, one `{"recordId", "modelInput"}` line
  per record; `modelInput` is the InvokeModel body (no `model`, no `stream`, `anthropic_version`
  bedrock-2023-05-31), as the live call's envelope is. Its `s3://` URI is the job's upstream input file.
- Create: `POST /model-invocation-job` named `relay-<job hex>` with `clientRequestToken` `relay<job hex>`:
  Bedrock ignores a create whose token it has seen (no error), so a create retried after a lost answer makes
  no second job; a lost create is also found by its name (`GET /model-invocation-jobs?nameContains=`).
- Poll: `GET /model-invocation-job/{id}`; Submitted, Validating, Scheduled, InProgress and Stopping run;
  Completed, PartiallyCompleted, Stopped and Expired ended; Failed failed.
- Results: `{output prefix}/{job id}/input.jsonl.out` (every `*.jsonl.out` under it, the manifest aside),
  a `modelOutput` (the InvokeModel answer: an Anthropic message) or an `error` per line, matched by recordId
  (their order is not promised). A job that ended before every record ran (PartiallyCompleted, Expired,
  Stopped) writes no line for those: they come out expired (canceled when Stopped), read from the input.
- Limits: at least 100 records a job (Bedrock refuses fewer: placement keeps such a batch in the relay),
  50,000 records and 1 GB an input file.
- Refusals: the error type is the `x-amzn-ErrorType` header; `ServiceQuotaExceededException` (400: too many
  jobs in flight) and `ThrottlingException` (429) mean "no room now"."""

import hashlib
import json
import logging
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from typing import ClassVar
from urllib.parse import quote, urlencode

import orjson

from core import hostkinds
from core.retry_after import parse_retry_after
from gateway import upstream
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

ANTHROPIC_VERSION = "bedrock-2023-05-31"
_RUNNING = {"submitted", "validating", "scheduled", "inprogress", "stopping"}
_ENDED = {"completed", "partiallycompleted", "stopped", "expired"}
# Ended before every record ran: the records with no result line did not run (Stopped: cancelled).
_UNFINISHED = {"partiallycompleted": "expired", "expired": "expired", "stopped": "canceled"}
_CAPACITY_ERRORS = {"ServiceQuotaExceededException", "ThrottlingException"}
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_S3_NS = re.compile(r"^\{[^}]*\}")


class BedrockInput(CloudClaudeJSONL):
    """The JSONL object uploaded to S3: one `{"recordId": …, "modelInput": <InvokeModel body>}` per record."""

    id_field, body_field, anthropic_version = "recordId", "modelInput", ANTHROPIC_VERSION


class BedrockBatchAPI(BatchAPI):
    kind = "bedrock"
    label = "Amazon Bedrock batch inference"
    adapters: ClassVar[frozenset] = frozenset({"anthropic"})
    endpoints: ClassVar[frozenset] = frozenset({"/v1/messages"})
    max_records = 50_000  # records per input file and per job (Service Quotas' defaults)
    max_bytes = 1024 * 1024 * 1024  # one input file
    min_records = 100
    line_overhead = 120
    input_file = BedrockInput

    @classmethod
    def unready(cls, host) -> str:
        settings = _settings(host)
        missing = [name for name in ("batch_bucket", "batch_role_arn") if not settings.get(name)]
        return f"the host has no {' and no '.join(missing)}" if missing else ""

    # --- where: the host's settings ---

    @property
    def settings(self) -> dict:
        return _settings(self.host)

    @property
    def region(self) -> str:
        return hostkinds.of(self.host, "anthropic").region(self.host)

    def _s3_url(self, key: str = "", query: str = "") -> str:
        base = (self.settings.get("batch_s3_url") or f"https://s3.{self.region}.amazonaws.com").rstrip("/")
        url = f"{base}/{self.settings['batch_bucket']}"
        url += f"/{quote(key, safe='/')}" if key else ""
        return url + (f"?{query}" if query else "")

    def _control_url(self, path: str) -> str:
        base = (self.settings.get("batch_control_url") or f"https://bedrock.{self.region}.amazonaws.com").rstrip("/")
        return base + path

    @property
    def _folder(self) -> str:
        prefix = (self.settings.get("batch_prefix") or "relay").strip("/")
        return f"{prefix}/{self.job.id.hex}"

    @property
    def _upstream_job(self) -> str:
        """The job's id on Bedrock (the last part of its ARN), as its paths and output folder name it."""
        return self.job.upstream_id.rsplit("/", 1)[-1]

    # --- signed calls ---

    def _signed(
        self,
        method: str,
        url: str,
        service: str,
        body: bytes = b"",
        *,
        payload_hash: str = "",
        data=None,
        extra_headers: dict | None = None,
        stream: bool = False,
    ):
        """One call signed with SigV4 for `service` (`data`: a file body sent instead of `body`, whose hash is
        `payload_hash`); Refused on an error status, the capacity ones marked so."""
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        settings = self.settings
        token = os.environ.get(settings["session_token_env"], "") if settings.get("session_token_env") else ""
        headers = {"Content-Type": "application/json"} if service == "bedrock" and method == "POST" else {}
        if service == "s3":  # S3 wants the payload's hash as a header (signed with the rest)
            headers["X-Amz-Content-SHA256"] = payload_hash or hashlib.sha256(body).hexdigest()
        request = AWSRequest(method=method, url=url, data=body if service != "s3" else b"", headers=headers)
        creds = Credentials(settings["access_key_id"], self.target.key_value, token or None)
        SigV4Auth(creds, service, self.region).add_auth(request)
        sent = {**dict(request.headers.items()), **(extra_headers or {})}
        payload = data if data is not None else body or None
        resp = upstream.exchange(method, url, headers=sent, data=payload, stream=stream)
        if resp.status_code >= 400:
            raw = resp.content if not stream else resp.raw.read(8192, decode_content=True)
            resp.close()
            error = str(resp.headers.get("x-amzn-ErrorType") or "").split(":", 1)[0]
            capacity = True if error in _CAPACITY_ERRORS else None
            retry_after = parse_retry_after(resp.headers.get("retry-after"))
            raise Refused(resp.status_code, raw, retry_after, capacity=capacity)
        return resp

    def _control(self, method: str, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else b""
        return json_object(self._signed(method, self._control_url(path), "bedrock", data))

    # --- the steps ---

    def upload(self, records: BedrockInput) -> str:
        body = records.finish()
        digest = hashlib.sha256()
        raw = records.file  # hashed as it sits (not through the lease check: that runs as the body is sent)
        for piece in iter(lambda: raw.read(1 << 20), b""):
            digest.update(piece)
        raw.seek(0)
        key = f"{self._folder}/input.jsonl"
        size = os.fstat(raw.fileno()).st_size
        resp = self._signed(
            "PUT",
            self._s3_url(key),
            "s3",
            payload_hash=digest.hexdigest(),
            data=body,
            extra_headers={"Content-Length": str(size)},
        )
        resp.close()
        return f"s3://{self.settings['batch_bucket']}/{key}"

    def create(self, records: BedrockInput) -> str:
        hex_id = self.job.id.hex
        answer = self._control(
            "POST",
            "/model-invocation-job",
            {
                "jobName": f"relay-{hex_id}",
                "roleArn": self.settings["batch_role_arn"],
                "modelId": self.binding.upstream_name,
                "clientRequestToken": f"relay{hex_id}",
                "inputDataConfig": {
                    "s3InputDataConfig": {"s3Uri": self.job.upstream_input_file_id, "s3InputFormat": "JSONL"}
                },
                "outputDataConfig": {
                    "s3OutputDataConfig": {"s3Uri": f"s3://{self.settings['batch_bucket']}/{self._folder}/output/"}
                },
                "timeoutDurationInHours": max(24, int(self.window.total_seconds() // 3600)),
                "modelInvocationType": "InvokeModel",
                "tags": [{"key": "relay_job", "value": hex_id}],
            },
        )
        arn = answer.get("jobArn")
        if not isinstance(arn, str) or not arn:
            raise Refused(502, b'{"error": "the provider answered the create without a jobArn"}')
        return arn

    def status(self) -> Status:
        data = self._control("GET", f"/model-invocation-job/{quote(self._upstream_job, safe='')}")
        raw = str(data.get("status") or "")
        lowered = raw.lower()
        status = Status(
            phase="running" if lowered in _RUNNING else "ended" if lowered in _ENDED else "failed",
            raw_status=raw,
            completed=count(data.get("successRecordCount")),
            failed=count(data.get("errorRecordCount")),
        )
        if status.phase == "failed":
            # Never "no room now": a job sent again keeps its name and token, which Bedrock would answer with
            # this failed job (or a ConflictException). Bedrock says "no room" at the create, as a refusal.
            status.message = str(data.get("message") or f"the provider's batch job is {raw}")[:300]
        status.sources = [f"{self._folder}/output/{self._upstream_job}/"]
        return status

    def find(self, owned=frozenset()) -> str | None:
        """The job Bedrock made from the job's lost create: the one named `relay-<job hex>` (names are unique in
        an account, and the create's token makes a retried create the same job)."""
        name = f"relay-{self.job.id.hex}"
        token = None
        for _ in range(FIND_PAGES):
            query = {"nameContains": name, "maxResults": "100", "sortBy": "CreationTime", "sortOrder": "Descending"}
            if token:
                query["nextToken"] = token
            page = self._control("GET", "/model-invocation-jobs?" + urlencode(query, quote_via=quote))
            for row in page.get("invocationJobSummaries") or []:
                if isinstance(row, dict) and row.get("jobName") == name and row.get("jobArn") not in owned:
                    return row.get("jobArn")
            token = page.get("nextToken")
            if not token:
                return None
        return None

    def results(self, status: Status) -> Iterator[Result]:
        seen: set[str] = set()
        for folder in status.sources:
            for key in self._keys(folder):
                if not key.endswith(".jsonl.out"):
                    continue  # manifest.json.out: the counts, not records
                for result in jsonl(self._signed("GET", self._s3_url(key), "s3", stream=True), self.parse_line):
                    seen.add(result.custom_id)
                    yield result
        unrun = _UNFINISHED.get(status.raw_status.lower())
        if unrun is None or not self.job.upstream_input_file_id:
            return
        # The records the job never ran have no line: read their ids from the input the relay wrote.
        key = self.job.upstream_input_file_id.split("/", 3)[-1]
        for line in jsonl(self._signed("GET", self._s3_url(key), "s3", stream=True), _input_record):
            if line.custom_id and line.custom_id not in seen:
                yield Result(line.custom_id, unrun)

    def _keys(self, folder: str) -> Iterator[str]:
        """The keys under `folder` in the host's bucket (ListObjectsV2, page by page)."""
        token = None
        while True:
            query = {"list-type": "2", "prefix": folder}
            if token:
                query["continuation-token"] = token
            resp = self._signed("GET", self._s3_url(query=urlencode(sorted(query.items()), quote_via=quote)), "s3")
            root = ET.fromstring(resp.content)
            fields = {_S3_NS.sub("", child.tag): child for child in root}
            for child in root:
                if _S3_NS.sub("", child.tag) == "Contents":
                    for part in child:
                        if _S3_NS.sub("", part.tag) == "Key" and part.text:
                            yield part.text
            truncated = fields.get("IsTruncated")
            token_field = fields.get("NextContinuationToken")
            if truncated is None or truncated.text != "true" or token_field is None or not token_field.text:
                return
            token = token_field.text

    def cancel(self) -> None:
        self._control("POST", f"/model-invocation-job/{quote(self._upstream_job, safe='')}/stop", {})

    @staticmethod
    def parse_line(line: bytes) -> Result:
        row = result_row(line)
        if row is None:
            return Result("", "errored")
        custom_id = str(row.get("recordId") or "")
        output = row.get("modelOutput")
        error = row.get("error")
        if isinstance(output, dict) and not error:
            return Result(custom_id, "succeeded", 200, orjson.dumps(output), output)
        error = error if isinstance(error, dict) else {}
        status = count(error.get("errorCode")) or 500
        status = status if 400 <= status < 600 else 500
        message = str(error.get("errorMessage") or "the provider returned no output for this record")
        body = {"type": "error", "error": {"type": "api_error" if status >= 500 else "invalid_request_error"}}
        body["error"]["message"] = message
        return Result(custom_id, "errored", status, orjson.dumps(body))


def _settings(host) -> dict:
    return hostkinds.of(host, "anthropic").option_values(getattr(host, "options", None))


def _input_record(line: bytes) -> Result:
    row = result_row(line)
    return Result(str(row.get("recordId") or "") if row else "", "expired")
