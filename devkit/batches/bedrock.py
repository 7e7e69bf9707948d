"""The fake Amazon Bedrock batch inference control plane (devkit.batches), and a small S3 stand-in.

Control plane (rest-json, SigV4 service `bedrock`, every call's signature verified with botocore's own signer,
as devkit.clouds does for InvokeModel): `POST /model-invocation-job` (CreateModelInvocationJob),
`GET /model-invocation-job/{id}`, `POST /model-invocation-job/{id}/stop`, `GET /model-invocation-jobs`
(nameContains, statusEquals, sortOrder, maxResults, nextToken). Errors are Bedrock's: `{"message": …}` with the
type in `x-amzn-ErrorType`.

A job reads its input JSONL from S3 when it is validated (0.1 T after its create; fewer than 100 records or a
line that is not `{recordId, modelInput}` fails it), runs its records over the job's seconds as the OpenAI and
Anthropic fakes do (each `modelInput` answered as the live `/v1/messages` call: scripted replies, `expire_when`),
and at T writes `{output s3Uri}{jobId}/{input name}.out` (one `modelOutput` or `error` line per record that ran)
and `manifest.json.out`. Records that never finish leave the job PartiallyCompleted without a line; a stop
ends it Stopped 0.1 T later with what ran. A create repeating a `clientRequestToken` answers the same job;
one repeating a `jobName` is a ConflictException.

S3: the job reads and writes through `self.s3`: by default `MemoryS3`, an in-process stand-in that also serves
the relay's S3 calls on this server under `/_s3/{bucket}/{key}` (PutObject, GetObject, ListObjectsV2; SigV4
service `s3` verified, the payload's hash checked) — the demo's (`make run`) bucket. Tests point it at a real
S3 on loopback (moto's server, tests/test_storage_s3.py) with `use_s3(endpoint)`."""

import hashlib
import hmac
import re
import secrets
import threading
from datetime import UTC, datetime
from urllib.parse import parse_qs, unquote
from xml.sax.saxutils import escape

from devkit.batches.common import CANCEL_TAKES, RECORDS_DONE_AT, VALIDATED_AT, Answer, Job, _dumps, _loads

CONTROL_PATHS = ("/model-invocation-job", "/model-invocation-jobs")
S3_PREFIX = "/_s3/"
MIN_RECORDS = 100
ACCOUNT = "123456789012"
_SIGV4 = re.compile(
    r"^AWS4-HMAC-SHA256 Credential=([^/]+)/(\d{8})/([^/]+)/([^/]+)/aws4_request, ?"
    r"SignedHeaders=([^,]+), ?Signature=([0-9a-f]{64})\Z"
)
_JOB_NAME = re.compile(r"^[a-zA-Z0-9]{1,63}(-*[a-zA-Z0-9\+\-\.]){0,63}\Z")
_TOKEN = re.compile(r"^[a-zA-Z0-9]{1,256}(-*[a-zA-Z0-9]){0,256}\Z")
_ROLE = re.compile(r"^arn:aws(-[^:]+)?:iam::([0-9]{12})?:role/.+\Z")
_S3_URI = re.compile(r"^s3://([a-z0-9][-.a-z0-9]{1,61}[a-z0-9])(/.*)?\Z")
_JOB_PATH = re.compile(r"^/model-invocation-job/([^/]+)(/stop)?\Z")


def aws_error(status: int, kind: str, message: str) -> Answer:
    return Answer(status, {"message": message}, headers={"x-amzn-ErrorType": f"{kind}:http://internal.amazon.com/"})


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _split_uri(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


# --- S3: the stand-in and a real one ---------------------------------------------------------------------


class MemoryS3:
    """Buckets in memory: what a job reads and writes, and what the relay's S3 calls reach under /_s3/."""

    def __init__(self):
        self.lock = threading.Lock()
        self.objects: dict[tuple[str, str], bytes] = {}

    def put(self, bucket: str, key: str, data: bytes) -> None:
        with self.lock:
            self.objects[(bucket, key)] = bytes(data)

    def get(self, bucket: str, key: str) -> bytes | None:
        with self.lock:
            return self.objects.get((bucket, key))

    def keys(self, bucket: str, prefix: str) -> list[str]:
        with self.lock:
            return sorted(k for b, k in self.objects if b == bucket and k.startswith(prefix))


class RemoteS3:
    """A real S3 (moto's server on loopback in the tests), reached with boto3."""

    def __init__(self, endpoint: str, access_key: str = "relay-test", secret: str = "relay-test-secret"):
        import boto3

        self.client = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=access_key,
            aws_secret_access_key=secret,
        )  # fmt: skip

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=bucket, Key=key, Body=data)

    def get(self, bucket: str, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def keys(self, bucket: str, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]


# --- the jobs ------------------------------------------------------------------------------------------


class BedrockJob(Job):
    provider = "bedrock"

    def __init__(self, id, key, created, seconds, body: dict):
        super().__init__(id, key, created, seconds)
        self.arn = f"arn:aws:bedrock:us-east-1:{ACCOUNT}:model-invocation-job/{id}"
        self.body = body
        self.status = "Submitted"
        self.message = ""
        self.records: list[tuple[str, object, bytes]] = []  # (recordId, modelInput, raw line)
        self.lines: list[dict] = []
        self.success = 0
        self.errors = 0
        self.stamps: dict[str, float] = {}

    @property
    def total(self) -> int:
        return len(self.records)

    def summary(self) -> dict:
        b = self.body
        out = {
            "jobArn": self.arn,
            "jobName": b["jobName"],
            "modelId": b["modelId"],
            "clientRequestToken": b.get("clientRequestToken"),
            "roleArn": b["roleArn"],
            "status": self.status,
            "submitTime": _iso(self.created),
            "lastModifiedTime": _iso(max([self.created, *self.stamps.values()])),
            "endTime": _iso(self.ended_at),
            "inputDataConfig": b["inputDataConfig"],
            "outputDataConfig": b["outputDataConfig"],
            "timeoutDurationInHours": b.get("timeoutDurationInHours", 24),
            "modelInvocationType": b.get("modelInvocationType", "InvokeModel"),
        }
        if self.message:
            out["message"] = self.message
        if self.status not in ("Submitted", "Validating", "Failed"):
            out.update(
                totalRecordCount=self.total,
                processedRecordCount=self.success + self.errors,
                successRecordCount=self.success,
                errorRecordCount=self.errors,
            )
        return {k: v for k, v in out.items() if v is not None}


class BedrockBatches:
    """The control plane and the S3 stand-in, for a ProviderBatches (its clock, job seconds, knobs, `_run`)."""

    def __init__(self, batches):
        self.batches = batches
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.jobs: dict[str, BedrockJob] = {}
            self.tokens: dict[str, str] = {}
            self.memory = MemoryS3()
            self.s3 = self.memory
            self.log: list[dict] = []

    def use_s3(self, endpoint: str | None, **keys) -> None:
        """Jobs read and write this S3 (None: the in-process stand-in again)."""
        with self.lock:
            self.s3 = RemoteS3(endpoint, **keys) if endpoint else self.memory

    @staticmethod
    def handles(path: str) -> bool:
        return path.startswith(S3_PREFIX) or any(path == p or path.startswith(p + "/") for p in CONTROL_PATHS)

    def job(self, id_or_arn: str) -> BedrockJob | None:
        with self.lock:
            return self.jobs.get(id_or_arn.rsplit("/", 1)[-1])

    def creates(self) -> int:
        return sum(1 for e in self.log if e["op"] == "create" and e["status"] == 200)

    # --- HTTP ----------------------------------------------------------------------------------------------

    def serve(self, handler, raw: bytes) -> Answer:
        path, _, query = handler.path.partition("?")
        service = "s3" if path.startswith(S3_PREFIX) else "bedrock"
        entry = {"t": self.batches.clock(), "method": handler.command, "path": path, "op": None, "status": None}
        secret, refusal = self._verify(handler, raw, service)
        if refusal is not None:
            answer = refusal
        elif service == "s3":
            answer = self._s3(handler.command, path, parse_qs(query), raw, entry)
        else:
            try:
                answer = self._control(handler.command, path, parse_qs(query), raw, secret, entry)
            except Exception as exc:  # a bug here must show as a 500, never as a hung connection
                answer = aws_error(500, "InternalServerException", f"demo upstream: {type(exc).__name__}: {exc}")
        entry["status"] = answer.status
        with self.lock:
            self.log.append(entry)
        return answer

    def _verify(self, handler, raw: bytes, service: str) -> tuple[str, Answer | None]:
        """The secret of the access key that signed the request, or the refusal of its signature."""
        headers = handler.headers
        signed = _SIGV4.match(headers.get("Authorization", ""))
        deny = (lambda m: _s3_error(403, "AccessDenied", m)) if service == "s3" else None
        deny = deny or (lambda m: aws_error(403, "AccessDeniedException", m))
        if not signed:
            return "", deny("Missing Authentication Token")
        access_key_id, signed_service = signed.group(1, 4)
        secret = self.batches.server.clouds.bedrock_keys.get(access_key_id)
        if secret is None or signed_service != service:
            return "", deny("The security token included in the request is invalid.")
        if not hmac.compare_digest(signed.group(6), _signature(handler, raw, signed, secret)):
            return secret, deny("The request signature we calculated does not match the signature you provided.")
        if service == "s3" and headers.get("X-Amz-Content-SHA256") != hashlib.sha256(raw).hexdigest():
            mismatch = "The provided 'x-amz-content-sha256' header does not match what was computed."
            return secret, _s3_error(400, "XAmzContentSHA256Mismatch", mismatch)
        return secret, None

    # --- S3 stand-in -------------------------------------------------------------------------------------

    def _s3(self, method: str, path: str, query: dict, raw: bytes, entry: dict) -> Answer:
        bucket, _, key = path.removeprefix(S3_PREFIX).partition("/")
        key = unquote(key)
        entry["op"] = f"s3_{method.lower()}"
        if method == "PUT" and key:
            self.memory.put(bucket, key, raw)
            etag = f'"{hashlib.md5(raw).hexdigest()}"'  # noqa: S324 - S3's ETag, not a security hash
            return Answer(200, chunks=(b"",), size=0, headers={"ETag": etag}, content_type="application/xml")
        if method == "GET" and key:
            data = self.memory.get(bucket, key)
            if data is None:
                return _s3_error(404, "NoSuchKey", "The specified key does not exist.")
            return Answer(200, chunks=(data,), size=len(data), content_type="application/octet-stream")
        if method == "GET" and (query.get("list-type") or [""])[0] == "2":
            prefix = (query.get("prefix") or [""])[0]
            keys = self.memory.keys(bucket, prefix)
            contents = "".join(
                f"<Contents><Key>{escape(k)}</Key><Size>{len(self.memory.get(bucket, k) or b'')}</Size></Contents>"
                for k in keys
            )
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?>'
                '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(keys)}</KeyCount>"
                f"<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>{contents}</ListBucketResult>"
            ).encode()
            return Answer(200, chunks=(xml,), size=len(xml), content_type="application/xml")
        return _s3_error(405, "MethodNotAllowed", "The specified method is not allowed against this resource.")

    # --- control plane -----------------------------------------------------------------------------------

    def _control(self, method: str, path: str, query: dict, raw: bytes, key: str, entry: dict) -> Answer:
        if method == "POST" and path == "/model-invocation-job":
            entry["op"] = "create"
            return self._create(raw, key, entry)
        if method == "GET" and path == "/model-invocation-jobs":
            entry["op"] = "list"
            return self._list(query, key)
        match = _JOB_PATH.match(path)
        if not match:
            return aws_error(404, "UnknownOperationException", "Unknown operation")
        job = self.job(unquote(match.group(1)))
        entry["job"] = job.id if job is not None else None
        if job is None or job.key != key:
            return aws_error(404, "ResourceNotFoundException", "The specified job does not exist.")
        if method == "GET" and not match.group(2):
            entry["op"] = "retrieve"
            if self.batches._polls_failing():
                return aws_error(500, "InternalServerException", "Internal server error")
            self._advance(job)
            return Answer(200, job.summary())
        if method == "POST" and match.group(2):
            entry["op"] = "cancel"
            self._advance(job)
            with job.lock:
                if job.ended_at is not None:
                    return aws_error(400, "ValidationException", f"The job is {job.status}: it cannot be stopped.")
                if job.cancel_at is None:
                    job.cancel_at = self.batches.clock()
                    job.status = "Stopping"
            return Answer(200, {})
        return aws_error(404, "UnknownOperationException", "Unknown operation")

    def _create(self, raw: bytes, key: str, entry: dict) -> Answer:
        try:
            body = _loads(raw or b"{}")
        except ValueError:
            return aws_error(400, "ValidationException", "The request body is not valid JSON.")
        if not isinstance(body, dict):
            return aws_error(400, "ValidationException", "The request body must be an object.")
        problem = _create_problem(body)
        if problem:
            return aws_error(400, "ValidationException", problem)
        token = body.get("clientRequestToken")
        with self.lock:
            known = self.tokens.get(f"{key}:{token}") if token else None
            if known is not None:
                entry["job"] = known
                return Answer(200, {"jobArn": self.jobs[known].arn})  # the same create again: the same job
            if any(j.key == key and j.body["jobName"] == body["jobName"] for j in self.jobs.values()):
                return aws_error(400, "ConflictException", f"A job named {body['jobName']} already exists.")
        refused, options = self.batches._create_knobs("bedrock")
        if refused:
            return aws_error(
                400,
                "ServiceQuotaExceededException",
                "You have exceeded the number of batch inference jobs in progress or submitted for this model.",
            )
        job = BedrockJob(secrets.token_hex(6), key, self.batches.clock(), self.batches.job_seconds, body)
        with self.lock:
            self.jobs[job.id] = job
            if token:
                self.tokens[f"{key}:{token}"] = job.id
        entry["job"] = job.id
        return Answer(200, {"jobArn": job.arn}, **options)

    def _list(self, query: dict, key: str) -> Answer:
        first = {name: values[0] for name, values in query.items() if values}
        with self.lock:
            mine = [j for j in self.jobs.values() if j.key == key]
        for job in mine:
            self._advance(job)
        if first.get("nameContains"):
            mine = [j for j in mine if first["nameContains"] in j.body["jobName"]]
        if first.get("statusEquals"):
            mine = [j for j in mine if j.status == first["statusEquals"]]
        if first.get("sortOrder", "Descending") == "Descending":
            mine.reverse()
        start = int(first.get("nextToken") or 0)
        size = max(1, min(1000, int(first.get("maxResults") or 1000)))
        page = mine[start : start + size]
        out = {"invocationJobSummaries": [j.summary() for j in page]}
        if start + size < len(mine):
            out["nextToken"] = str(start + size)
        return Answer(200, out)

    # --- a job's life ------------------------------------------------------------------------------------

    def _advance(self, job: BedrockJob) -> None:
        now = self.batches.clock()
        with job.lock:
            if job.ended_at is not None:
                return
            elapsed = (now - job.created) / job.seconds
            if job.status in ("Submitted", "Validating") and elapsed >= VALIDATED_AT:
                self._validate(job)
                if job.status == "Failed":
                    return
            if job.status in ("Submitted", "Validating"):
                if job.cancel_at is not None:
                    self._finish(job, "Stopped", now)
                return
            if job.cancel_at is not None:
                if now < job.cancel_at + CANCEL_TAKES * job.seconds:
                    return
                self._finish(job, "Stopped", job.cancel_at + CANCEL_TAKES * job.seconds)
                return
            share = min(1.0, max(0.0, (elapsed - VALIDATED_AT) / (RECORDS_DONE_AT - VALIDATED_AT)))
            self._run_records(job, job.total if elapsed >= RECORDS_DONE_AT else int(job.total * share + 1e-9))
            if elapsed >= 1.0:
                self._finish(job, "PartiallyCompleted" if job.never else "Completed", job.at(1.0))

    def _validate(self, job: BedrockJob) -> None:
        bucket, key = _split_uri(job.body["inputDataConfig"]["s3InputDataConfig"]["s3Uri"])
        data = self.s3.get(bucket, key)
        job.stamps["validated"] = job.at(VALIDATED_AT)
        if data is None:
            return self._fail(job, f"The input S3 object s3://{bucket}/{key} does not exist or is not readable.")
        seen = set()
        for n, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = _loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict) or not isinstance(row.get("modelInput"), dict):
                return self._fail(job, f"Line {n} of the input is not a record: {{recordId, modelInput}}.")
            record_id = str(row.get("recordId") or secrets.token_hex(6)[:11])
            if record_id in seen:
                return self._fail(job, f"The recordId {record_id} is used more than once.")
            seen.add(record_id)
            job.records.append((record_id, row["modelInput"], line))
        if len(job.records) < MIN_RECORDS:
            return self._fail(
                job, f"The job has {len(job.records)} records: a batch inference job takes at least {MIN_RECORDS}."
            )
        job.status = "InProgress"
        return None

    def _fail(self, job: BedrockJob, message: str) -> None:
        job.status, job.message = "Failed", message
        job.ended_at = job.at(VALIDATED_AT)
        job.records = []

    def _run_records(self, job: BedrockJob, target: int) -> None:
        while job.next < target:
            i = job.next
            job.next += 1
            record_id, model_input, raw = job.records[i]
            line = {"recordId": record_id, "modelInput": model_input}
            if "model" in model_input or "stream" in model_input:
                line["error"] = {"errorCode": 400, "errorMessage": "Malformed input request: extraneous key"}
            else:
                result = self.batches._run("/v1/messages", model_input, raw)
                if result is None:
                    job.never.append(i)
                    continue
                status, body = result
                if 200 <= status < 300:
                    line["modelOutput"] = body
                else:
                    message = ((body or {}).get("error") or {}).get("message") or f"HTTP {status}"
                    line["error"] = {"errorCode": status, "errorMessage": message}
            if "error" in line:
                job.errors += 1
            else:
                job.success += 1
            job.lines.append(line)

    def _finish(self, job: BedrockJob, status: str, at: float) -> None:
        """End the job: its output object (a line per record that ran) and manifest written to S3."""
        bucket, prefix = _split_uri(job.body["outputDataConfig"]["s3OutputDataConfig"]["s3Uri"])
        _, input_key = _split_uri(job.body["inputDataConfig"]["s3InputDataConfig"]["s3Uri"])
        folder = f"{prefix.rstrip('/')}/{job.id}/" if prefix.strip("/") else f"{job.id}/"
        out = b"".join(_dumps(line) + b"\n" for line in job.lines)
        self.s3.put(bucket, folder + input_key.rsplit("/", 1)[-1] + ".out", out)
        manifest = {
            "totalRecordCount": job.total,
            "processedRecordCount": job.success + job.errors,
            "successRecordCount": job.success,
            "errorRecordCount": job.errors,
        }
        self.s3.put(bucket, folder + "manifest.json.out", _dumps(manifest))
        job.status, job.ended_at = status, at
        job.stamps[status] = at


def _create_problem(body: dict) -> str:
    for name in ("jobName", "roleArn", "modelId", "inputDataConfig", "outputDataConfig"):
        if not body.get(name):
            return f"1 validation error detected: Value null at '{name}' failed to satisfy constraint: must not be null"
    if not _JOB_NAME.match(str(body["jobName"])):
        return "1 validation error detected: Value at 'jobName' failed to satisfy constraint"
    if body.get("clientRequestToken") is not None and not _TOKEN.match(str(body["clientRequestToken"])):
        return "1 validation error detected: Value at 'clientRequestToken' failed to satisfy constraint"
    if not _ROLE.match(str(body["roleArn"])):
        return "1 validation error detected: Value at 'roleArn' failed to satisfy constraint"
    try:
        uri_in = body["inputDataConfig"]["s3InputDataConfig"]["s3Uri"]
        uri_out = body["outputDataConfig"]["s3OutputDataConfig"]["s3Uri"]
    except (KeyError, TypeError):
        return "inputDataConfig.s3InputDataConfig.s3Uri and outputDataConfig.s3OutputDataConfig.s3Uri are required"
    if not (_S3_URI.match(str(uri_in)) and _S3_URI.match(str(uri_out))) or not str(uri_in).endswith(".jsonl"):
        return "The input must be an s3:// URI of a .jsonl object, the output an s3:// URI"
    hours = body.get("timeoutDurationInHours", 24)
    if not isinstance(hours, int) or not 24 <= hours <= 168:
        return "timeoutDurationInHours must be between 24 and 168"
    return ""


def _s3_error(status: int, code: str, message: str) -> Answer:
    xml = f"<Error><Code>{code}</Code><Message>{escape(message)}</Message></Error>".encode()
    return Answer(status, chunks=(xml,), size=len(xml), content_type="application/xml")


def _signature(handler, raw: bytes, signed: re.Match, secret: str) -> str:
    """The SigV4 signature botocore computes for the request received, re-signed with `secret` at its own date over
    the headers it says it signed (its method, path and query as they came)."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    access_key_id, _, region, service, signed_headers, _ = signed.groups()
    headers = handler.headers
    names = signed_headers.split(";")
    request = AWSRequest(
        method=handler.command,
        url=f"http://{headers.get('Host', '')}{handler.path}",
        data=raw,
        headers={name: headers.get(name, "") for name in names if name != "host"},
    )
    request.context["timestamp"] = headers.get("X-Amz-Date", "")
    signer = SigV4Auth(Credentials(access_key_id, secret), service, region)
    return signer.signature(signer.string_to_sign(request, signer.canonical_request(request)), request)
