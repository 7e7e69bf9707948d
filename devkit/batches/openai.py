"""The fake OpenAI Files + Batches API (devkit.batches): OpenAIJob and the `_openai_*` operations that
ProviderBatches (devkit.batches.server) dispatches to."""

import math
import secrets
from array import array

from devkit.batches.common import (
    CANCEL_TAKES,
    CANCELLED_MESSAGE,
    EXPIRED_MESSAGE,
    OPENAI_ENDPOINTS,
    OPENAI_FILE_PURPOSES,
    OPENAI_MAX_BATCH_BYTES,
    OPENAI_MAX_FILE_BYTES,
    OPENAI_MAX_REQUESTS,
    RECORDS_DONE_AT,
    VALIDATED_AT,
    Answer,
    Job,
    Spool,
    StoredFile,
    _int,
    _loads,
    _token,
    openai_error,
    parse_multipart,
)


class OpenAIJob(Job):
    provider = "openai"

    def __init__(self, id, key, created, seconds, input_file: StoredFile, endpoint, window, metadata):
        super().__init__(id, key, created, seconds)
        self.input_file_id = input_file.id
        self.data = input_file.data  # kept even if the file is deleted, as OpenAI keeps a job's input
        self.endpoint = endpoint
        self.completion_window = window
        self.metadata = metadata
        self.status = "validating"
        self.model = None
        self.errors = None
        self.token_limit = False
        self.fail_message = ""  # fail validation with this message (ProviderBatches.fail_jobs)
        self.starts = array("q")
        self.ends = array("q")
        self.completed = 0
        self.failed = 0
        self.out = Spool()
        self.err = Spool()
        self.output_file_id = None
        self.error_file_id = None
        self.usage = {"input": 0, "cached": 0, "output": 0}
        self.stamps: dict[str, float] = {}

    @property
    def total(self) -> int:
        return len(self.starts)

    def line(self, i: int) -> bytes:
        return self.data[self.starts[i] : self.ends[i]]

    def object(self) -> dict:
        s = self.stamps
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model,
            "errors": self.errors,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": int(self.created),
            "in_progress_at": _int(s.get("in_progress")),
            # The fake's completion window is the job's seconds (expiry is fast in tests), not 24 h.
            "expires_at": math.ceil(self.at(1.0)),
            "finalizing_at": _int(s.get("finalizing")),
            "completed_at": _int(s.get("completed")),
            "failed_at": _int(s.get("failed")),
            "expired_at": _int(s.get("expired")),
            "cancelling_at": _int(s.get("cancelling")),
            "cancelled_at": _int(s.get("cancelled")),
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "usage": {
                "input_tokens": self.usage["input"],
                "input_tokens_details": {"cached_tokens": self.usage["cached"]},
                "output_tokens": self.usage["output"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.usage["input"] + self.usage["output"],
            },
            "metadata": self.metadata,
        }


class OpenAIBatches:
    """ProviderBatches' OpenAI operations (a mixin: the lock, clock, files, jobs, knobs and `_run`, `_own_job`,
    `_create_knobs`, `_polls_failing` are ProviderBatches')."""

    # --- OpenAI: files -------------------------------------------------------------------------------------

    def _own_file(self, key: str, id: str) -> StoredFile | None:
        with self.lock:
            f = self.files.get(id)
        return f if f is not None and f.key == key else None

    def _openai_upload(self, ctx) -> Answer:
        fields = parse_multipart(ctx["raw"], ctx["content_type"])
        ctx["raw"] = None
        purpose = (fields.get("purpose") or (None, b""))[1].decode("utf-8", "replace")
        if "file" not in fields or fields["file"][0] is None:
            return openai_error(400, "Missing required parameter: 'file'.", code="missing_required_parameter")
        if purpose not in OPENAI_FILE_PURPOSES:
            return openai_error(
                400, f"Invalid value for 'purpose': {purpose!r}.", code="invalid_value", param="purpose"
            )
        filename, data = fields["file"]
        if len(data) > OPENAI_MAX_FILE_BYTES:
            return openai_error(413, "File is larger than 512 MB.", code="file_too_large")
        if purpose == "batch" and not filename.endswith(".jsonl"):
            return openai_error(400, "Invalid file format for Batch API. Must be .jsonl", param="file")
        f = StoredFile(f"file-{_token(22)}", ctx["key"], filename, purpose, self.clock(), data=data)
        with self.lock:
            self.files[f.id] = f
        ctx["entry"]["file"] = f.id
        return Answer(200, f.object())

    def _openai_files(self, ctx) -> Answer:
        q = ctx["query"]
        purpose = (q.get("purpose") or [None])[0]
        with self.lock:
            mine = [f for f in self.files.values() if f.key == ctx["key"] and purpose in (None, f.purpose)]
        mine.reverse()  # newest first (order=desc, OpenAI's default)
        if (q.get("order") or ["desc"])[0] == "asc":
            mine.reverse()
        return Answer(200, _page(mine, q, "after", 10_000, lambda f: f.object()))

    def _openai_file(self, ctx, id) -> Answer:
        f = self._own_file(ctx["key"], id)
        ctx["entry"]["file"] = id
        if f is None:
            return openai_error(404, f"No such File object: {id}", param="id")
        ctx["entry"]["job"] = f.batch_id
        return Answer(200, f.object())

    def _openai_content(self, ctx, id) -> Answer:
        f = self._own_file(ctx["key"], id)
        ctx["entry"]["file"] = id
        if f is None:
            return openai_error(404, f"No such File object: {id}", param="id")
        ctx["entry"]["job"] = f.batch_id
        return Answer(200, chunks=f.chunks(), size=f.size, content_type="application/octet-stream")

    def _openai_delete_file(self, ctx, id) -> Answer:
        ctx["entry"]["file"] = id
        if self._own_file(ctx["key"], id) is None:
            return openai_error(404, f"No such File object: {id}", param="id")
        with self.lock:
            self.files.pop(id, None)
        return Answer(200, {"id": id, "object": "file", "deleted": True})

    # --- OpenAI: batches -----------------------------------------------------------------------------------

    def _openai_create(self, ctx) -> Answer:
        try:
            body = _loads(ctx["raw"] or b"{}")
        except ValueError:
            return openai_error(400, "We could not parse the JSON body of your request.")
        if not isinstance(body, dict):
            return openai_error(400, "The body of your request must be a JSON object.")
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not body.get(name):
                return openai_error(
                    400, f"Missing required parameter: '{name}'.", code="missing_required_parameter", param=name
                )
        endpoint, window, metadata = body["endpoint"], body["completion_window"], body.get("metadata")
        if endpoint not in OPENAI_ENDPOINTS:
            return openai_error(
                400, f"Invalid value for 'endpoint': {endpoint!r}.", code="invalid_value", param="endpoint"
            )
        if window != "24h":
            return openai_error(
                400, f"Invalid value for 'completion_window': {window!r}. Supported: '24h'.", param="completion_window"
            )
        if metadata is not None and not (
            isinstance(metadata, dict)
            and len(metadata) <= 16
            and all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                for k, v in metadata.items()
            )
        ):
            return openai_error(400, "Invalid 'metadata': at most 16 string pairs.", param="metadata")
        f = self._own_file(ctx["key"], body["input_file_id"])
        if f is None:
            return openai_error(404, f"No such File object: {body['input_file_id']}", param="input_file_id")
        if f.purpose != "batch" or f.data is None:
            return openai_error(400, f"File {f.id} was not uploaded with purpose 'batch'.", param="input_file_id")
        refused, options = self._create_knobs("openai")
        if refused:
            return openai_error(
                429,
                "Enqueued token limit reached for this organization. Please try again once some in_progress "
                "batches have been completed.",
                code="rate_limit_exceeded",
                **options,
            )
        job = OpenAIJob(
            f"batch_{secrets.token_hex(16)}", ctx["key"], self.clock(), self.job_seconds, f, endpoint, window, metadata
        )
        with self.lock:
            if self._token_limit > 0:
                self._token_limit -= 1
                job.token_limit = True
            if self._fail_messages:
                job.fail_message = self._fail_messages.pop(0)
            self.jobs[job.id] = job
        ctx["entry"]["job"] = job.id
        return Answer(200, job.object(), **options)

    def _openai_retrieve(self, ctx, id) -> Answer:
        ctx["entry"]["job"] = id
        if self._polls_failing():
            return openai_error(
                500, "The server had an error while processing your request. Sorry about that!", type="server_error"
            )
        job = self._own_job(ctx, id, "openai")
        if job is None:
            return openai_error(404, f"No batch found with id '{id}'.", param="batch_id")
        self._advance_openai(job)
        return Answer(200, job.object())

    def _openai_list(self, ctx) -> Answer:
        if self._polls_failing():
            return openai_error(
                500, "The server had an error while processing your request. Sorry about that!", type="server_error"
            )
        with self.lock:
            mine = [j for j in self.jobs.values() if j.key == ctx["key"] and j.provider == "openai"]
        mine.reverse()  # newest first

        def render(job):
            self._advance_openai(job)
            return job.object()

        return Answer(200, _page(mine, ctx["query"], "after", 100, render))

    def _openai_cancel(self, ctx, id) -> Answer:
        job = self._own_job(ctx, id, "openai")
        if job is None:
            return openai_error(404, f"No batch found with id '{id}'.", param="batch_id")
        self._advance_openai(job)
        with job.lock:
            if job.status in ("validating", "in_progress", "finalizing"):
                now = self.clock()
                if job.status == "validating":
                    self._validate(job)
                    job.stamps["in_progress"] = min(now, job.stamps.get("in_progress", now))
                if job.status != "failed":
                    job.cancel_at = now
                    job.status = "cancelling"
                    job.stamps["cancelling"] = now
            elif job.status != "cancelling" and job.status != "cancelled":
                return openai_error(400, f"Cannot cancel a batch with status '{job.status}'.")
        self._advance_openai(job)
        return Answer(200, job.object())

    def _validate(self, job: OpenAIJob) -> None:
        """The validating step (with the job's lock held): index and check the input file's lines."""
        now_stamp = job.at(VALIDATED_AT)
        errors, seen, model = [], set(), None
        data, pos, size = job.data, 0, len(job.data)
        starts, ends = job.starts, job.ends
        number = 0
        while pos < size:
            nl = data.find(b"\n", pos)
            end = size if nl == -1 else nl
            line = data[pos:end]
            number += 1
            if line.strip():
                starts.append(pos)
                ends.append(end)
                try:
                    rec = _loads(line)
                except ValueError:
                    rec = None
                problem = _line_problem(rec, job.endpoint, seen)
                if problem:
                    errors.append({"code": problem[0], "line": number, "message": problem[1], "param": problem[2]})
                elif model is None:
                    model = rec["body"].get("model")
            pos = end + 1
        job.model = model
        if not starts:
            errors.append({"code": "empty_file", "line": None, "message": "The input file is empty.", "param": None})
        elif len(starts) > OPENAI_MAX_REQUESTS:
            errors.append(
                {
                    "code": "too_many_requests",
                    "line": None,
                    "message": f"The input file has {len(starts)} requests; a batch holds at most 50,000.",
                    "param": None,
                }
            )
        elif size > OPENAI_MAX_BATCH_BYTES:
            errors.append(
                {"code": "file_too_large", "line": None, "message": "The input file exceeds 200 MB.", "param": None}
            )
        elif job.fail_message:
            errors.append({"code": "invalid_request", "line": None, "message": job.fail_message, "param": None})
        elif job.token_limit:
            errors.append(
                {
                    "code": "token_limit_exceeded",
                    "line": None,
                    "message": f"Enqueued token limit reached for {model} in organization org-demo. Limit: 90,000 "
                    "enqueued tokens. Please try again once some in_progress batches have been completed.",
                    "param": None,
                }
            )
        if errors:
            # A batch that fails validation runs nothing and counts nothing (OpenAI reports total 0).
            job.errors = {"object": "list", "data": errors[:100]}
            job.starts, job.ends = array("q"), array("q")
            job.status = "failed"
            job.stamps["failed"] = now_stamp
            job.ended_at = now_stamp
            return
        job.status = "in_progress"
        job.stamps["in_progress"] = now_stamp

    def _advance_openai(self, job: OpenAIJob) -> None:
        now = self.clock()
        with job.lock:
            if job.ended_at is not None:
                return
            elapsed = (now - job.created) / job.seconds
            if job.status == "validating":
                if elapsed < VALIDATED_AT:
                    return
                self._validate(job)
                if job.status == "failed":
                    return
            if job.cancel_at is not None:
                # Records that finished before the cancel keep their results; no more run.
                if now < job.cancel_at + CANCEL_TAKES * job.seconds:
                    return
                self._finish_openai(job, "cancelled", job.cancel_at + CANCEL_TAKES * job.seconds)
                return
            if elapsed >= RECORDS_DONE_AT:
                target = job.total
            else:
                share = (elapsed - VALIDATED_AT) / (RECORDS_DONE_AT - VALIDATED_AT)
                target = min(job.total, int(job.total * max(0.0, share) + 1e-9))
            self._run_openai_records(job, target)
            if elapsed >= 1.0:
                self._finish_openai(job, "expired" if job.never else "completed", job.at(1.0))
            elif elapsed >= RECORDS_DONE_AT and not job.never and job.status == "in_progress":
                job.status = "finalizing"
                job.stamps["finalizing"] = job.at(RECORDS_DONE_AT)

    def _run_openai_records(self, job: OpenAIJob, target: int) -> None:
        while job.next < target:
            i = job.next
            job.next += 1
            line = job.line(i)
            rec = _loads(line)
            result = self._run(rec["url"], rec["body"], line)
            if result is None:
                job.never.append(i)
                continue
            status, body = result
            response = {"status_code": status, "request_id": f"req_{secrets.token_hex(16)}", "body": body}
            out = {"id": f"batch_req_{secrets.token_hex(16)}", "custom_id": rec["custom_id"], "response": response}
            out["error"] = None
            if 200 <= status < 300:
                job.completed += 1
                job.out.add(out)
                _add_usage(job.usage, body)
            else:
                job.failed += 1
                job.err.add(out)

    def _finish_openai(self, job: OpenAIJob, status: str, at: float) -> None:
        """End a job (with its lock held). Records that never ran (expired: the window ended; cancelled: the
        batch was cancelled) go to the error file with `response: null` and an error: OpenAI documents
        `batch_expired` lines for an expired batch, and for a cancelled one only that finished records'
        results stay in the output file; this fake writes the unrun records of a cancelled batch as
        `batch_cancelled` lines, so every input line has exactly one output or error line. Neither kind
        counts in request_counts (completed + failed are the records that ran)."""
        if status == "cancelled":
            unrun = list(job.never) + list(range(job.next, job.total))
            code, message = "batch_cancelled", CANCELLED_MESSAGE
        else:
            unrun, code, message = job.never, "batch_expired", EXPIRED_MESSAGE
        for i in sorted(unrun):
            custom_id = _loads(job.line(i)).get("custom_id")
            line = {"id": f"batch_req_{secrets.token_hex(16)}", "custom_id": custom_id, "response": None}
            line["error"] = {"code": code, "message": message}
            job.err.add(line)
        job.never = []
        job.next = job.total
        if status == "completed" and "finalizing" not in job.stamps:
            job.stamps["finalizing"] = job.at(RECORDS_DONE_AT)
        job.status = status
        job.stamps[status] = at
        job.ended_at = at
        for spool, kind, attr in ((job.out, "output", "output_file_id"), (job.err, "error", "error_file_id")):
            spool.close()
            if spool.lines:
                f = StoredFile(f"file-{_token(22)}", job.key, f"{job.id}_{kind}.jsonl", "batch_output", at, spool=spool)
                f.batch_id = job.id
                with self.lock:
                    self.files[f.id] = f
                setattr(job, attr, f.id)


def _page(items: list, q: dict, cursor: str, max_limit: int, render) -> dict:
    """An OpenAI list page: items after the `cursor` id, at most `limit` of them."""
    limit = max(1, min(max_limit, int((q.get("limit") or ["20"])[0])))
    after = (q.get(cursor) or [None])[0]
    ids = [i.id for i in items]
    start = ids.index(after) + 1 if after in ids else (len(ids) if after else 0)
    page = items[start : start + limit]
    return {
        "object": "list",
        "data": [render(i) for i in page],
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
        "has_more": start + limit < len(items),
    }


def _line_problem(rec, endpoint: str, seen: set) -> tuple[str, str, str | None] | None:
    """(code, message, param) of an input line OpenAI would refuse at validation, or None."""
    if not isinstance(rec, dict):
        return "invalid_json_line", "This line is not a JSON object.", None
    custom_id = rec.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_required_parameter", "Missing required parameter: 'custom_id'.", "custom_id"
    if custom_id in seen:
        return "duplicate_custom_id", f"The custom_id {custom_id!r} is used more than once in the file.", "custom_id"
    seen.add(custom_id)
    if rec.get("method") != "POST":
        return "invalid_method", "Only the POST method is supported.", "method"
    if rec.get("url") != endpoint:
        return (
            "mismatched_endpoint",
            f"The url {rec.get('url')!r} does not match the batch's endpoint {endpoint!r}.",
            "url",
        )
    if not isinstance(rec.get("body"), dict):
        return "missing_required_parameter", "Missing required parameter: 'body'.", "body"
    return None


def _add_usage(usage: dict, body) -> None:
    got = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(got, dict):
        return
    usage["input"] += got.get("prompt_tokens", got.get("input_tokens")) or 0
    usage["output"] += got.get("completion_tokens", got.get("output_tokens")) or 0
    details = got.get("prompt_tokens_details") or got.get("input_tokens_details") or {}
    usage["cached"] += (details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
