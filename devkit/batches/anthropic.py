"""The fake Anthropic Message Batches API (devkit.batches): AnthropicJob and the `_anthropic_*` operations
that ProviderBatches (devkit.batches.server) dispatches to."""

from devkit.batches.common import (
    ANTHROPIC_CUSTOM_ID,
    ANTHROPIC_ERROR_TYPES,
    ANTHROPIC_MAX_BYTES,
    ANTHROPIC_MAX_REQUESTS,
    CANCEL_TAKES,
    RECORDS_DONE_AT,
    Answer,
    Job,
    Spool,
    _dumps,
    _loads,
    _rfc3339,
    _token,
    anthropic_error,
)


class AnthropicJob(Job):
    provider = "anthropic"

    def __init__(self, id, key, created, seconds, requests: list[tuple[str, bytes]]):
        super().__init__(id, key, created, seconds)
        self.requests = requests  # (custom_id, the request's JSON {"custom_id", "params"})
        self.counts = {"succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        self.results = Spool()

    @property
    def total(self) -> int:
        return len(self.requests)

    @property
    def processing_status(self) -> str:
        if self.ended_at is not None:
            return "ended"
        return "canceling" if self.cancel_at is not None else "in_progress"

    def object(self, base_url: str) -> dict:
        ended = self.ended_at is not None
        return {
            "id": self.id,
            "type": "message_batch",
            "processing_status": self.processing_status,
            "request_counts": {"processing": self.total - sum(self.counts.values()), **self.counts},
            "ended_at": _rfc3339(self.ended_at),
            "created_at": _rfc3339(self.created),
            # The fake's 24 h: the job's seconds.
            "expires_at": _rfc3339(self.at(1.0)),
            "archived_at": None,
            "cancel_initiated_at": _rfc3339(self.cancel_at),
            "results_url": f"{base_url}/v1/messages/batches/{self.id}/results" if ended else None,
        }


class AnthropicBatches:
    """ProviderBatches' Anthropic operations (a mixin: the lock, clock, jobs, knobs and `_run`, `_own_job`,
    `_create_knobs`, `_polls_failing` are ProviderBatches')."""

    # --- Anthropic: message batches -------------------------------------------------------------------------

    def _anthropic_create(self, ctx) -> Answer:
        raw = ctx["raw"]
        if len(raw) > ANTHROPIC_MAX_BYTES:
            return anthropic_error(413, "Request exceeds the maximum allowed number of bytes.")
        try:
            body = _loads(raw or b"{}")
        except ValueError:
            return anthropic_error(400, "The request body is not valid JSON.")
        ctx["raw"] = raw = None
        batch = body.get("requests") if isinstance(body, dict) else None
        if not isinstance(batch, list) or not batch:
            return anthropic_error(400, "requests: Field required (a non-empty list)")
        if len(batch) > ANTHROPIC_MAX_REQUESTS:
            return anthropic_error(413, f"requests: at most {ANTHROPIC_MAX_REQUESTS} requests in a batch")
        requests, seen = [], set()
        for n, req in enumerate(batch):
            if not isinstance(req, dict) or not isinstance(req.get("params"), dict):
                return anthropic_error(400, f"requests.{n}.params: Field required")
            custom_id = req.get("custom_id")
            if not isinstance(custom_id, str) or not ANTHROPIC_CUSTOM_ID.match(custom_id):
                return anthropic_error(
                    400, f"requests.{n}.custom_id: String should match pattern '^[a-zA-Z0-9_-]{{1,64}}$'"
                )
            if custom_id in seen:
                return anthropic_error(
                    400, f"Duplicate custom_id: {custom_id!r}. custom_ids must be unique in a batch."
                )
            seen.add(custom_id)
            requests.append((custom_id, _dumps({"custom_id": custom_id, "params": req["params"]})))
        batch = body = None
        refused, options = self._create_knobs("anthropic")
        if refused:
            return anthropic_error(429, "Number of batch requests in the queue exceeds your rate limit.", **options)
        job = AnthropicJob(f"msgbatch_01{_token(22)}", ctx["key"], self.clock(), self.job_seconds, requests)
        with self.lock:
            self.jobs[job.id] = job
        ctx["entry"]["job"] = job.id
        return Answer(200, job.object(ctx["base_url"]), **options)

    def _anthropic_not_found(self, id) -> Answer:
        return anthropic_error(404, f"No message batch found with id '{id}'.")

    def _anthropic_retrieve(self, ctx, id) -> Answer:
        ctx["entry"]["job"] = id
        if self._polls_failing():
            return anthropic_error(500, "Internal server error", type="api_error")
        job = self._own_job(ctx, id, "anthropic")
        if job is None:
            return self._anthropic_not_found(id)
        self._advance_anthropic(job)
        return Answer(200, job.object(ctx["base_url"]))

    def _anthropic_list(self, ctx) -> Answer:
        if self._polls_failing():
            return anthropic_error(500, "Internal server error", type="api_error")
        with self.lock:
            mine = [j for j in self.jobs.values() if j.key == ctx["key"] and j.provider == "anthropic"]
        mine.reverse()  # newest first
        q = ctx["query"]
        limit = max(1, min(1000, int((q.get("limit") or ["20"])[0])))
        ids = [j.id for j in mine]
        after, before = (q.get("after_id") or [None])[0], (q.get("before_id") or [None])[0]
        if before:
            end = ids.index(before) if before in ids else 0
            page = mine[max(0, end - limit) : end]
            has_more = end - limit > 0
        else:
            start = ids.index(after) + 1 if after in ids else (len(ids) if after else 0)
            page = mine[start : start + limit]
            has_more = start + limit < len(mine)
        for job in page:
            self._advance_anthropic(job)
        return Answer(
            200,
            {
                "data": [j.object(ctx["base_url"]) for j in page],
                "has_more": has_more,
                "first_id": page[0].id if page else None,
                "last_id": page[-1].id if page else None,
            },
        )

    def _anthropic_cancel(self, ctx, id) -> Answer:
        job = self._own_job(ctx, id, "anthropic")
        if job is None:
            return self._anthropic_not_found(id)
        self._advance_anthropic(job)
        with job.lock:
            if job.ended_at is not None:
                return anthropic_error(400, f"Message batch {id} has ended and cannot be canceled.")
            if job.cancel_at is None:
                job.cancel_at = self.clock()
        self._advance_anthropic(job)
        return Answer(200, job.object(ctx["base_url"]))

    def _anthropic_delete(self, ctx, id) -> Answer:
        job = self._own_job(ctx, id, "anthropic")
        if job is None:
            return self._anthropic_not_found(id)
        self._advance_anthropic(job)
        if job.ended_at is None:
            return anthropic_error(400, f"Message batch {id} is still processing: cancel it before deleting it.")
        with self.lock:
            self.jobs.pop(id, None)
        return Answer(200, {"id": id, "type": "message_batch_deleted"})

    def _anthropic_results(self, ctx, id) -> Answer:
        job = self._own_job(ctx, id, "anthropic")
        if job is None:
            return self._anthropic_not_found(id)
        self._advance_anthropic(job)
        if job.ended_at is None:
            return anthropic_error(
                400, f"Message batch {id} has not ended processing: its results are not available yet."
            )
        return Answer(200, chunks=iter(job.results.chunks), size=job.results.size, content_type="application/binary")

    def _advance_anthropic(self, job: AnthropicJob) -> None:
        now = self.clock()
        with job.lock:
            if job.ended_at is not None:
                return
            if job.cancel_at is not None:
                if now < job.cancel_at + CANCEL_TAKES * job.seconds:
                    return
                self._finish_anthropic(job, job.cancel_at + CANCEL_TAKES * job.seconds, "canceled")
                return
            elapsed = (now - job.created) / job.seconds
            share = min(1.0, elapsed / RECORDS_DONE_AT)
            target = min(job.total, int(job.total * share + 1e-9))
            while job.next < target:
                i = job.next
                job.next += 1
                custom_id, raw = job.requests[i]
                params = _loads(raw)["params"]
                problem = _anthropic_params_problem(params)
                if problem:
                    result = 400, {"type": "error", "error": {"type": "invalid_request_error", "message": problem}}
                else:
                    result = self._run("/v1/messages", params, raw)
                if result is None:
                    job.never.append(i)
                    continue
                status, body = result
                if 200 <= status < 300:
                    job.counts["succeeded"] += 1
                    job.results.add({"custom_id": custom_id, "result": {"type": "succeeded", "message": body}})
                else:
                    job.counts["errored"] += 1
                    job.results.add(
                        {
                            "custom_id": custom_id,
                            "result": {"type": "errored", "error": _anthropic_error_body(status, body)},
                        }
                    )
            if elapsed >= 1.0:
                self._finish_anthropic(job, job.at(1.0), "expired")

    def _finish_anthropic(self, job: AnthropicJob, at: float, unrun_as: str) -> None:
        """End a job (with its lock held): records that never finished are `expired` (the window ended) or,
        for a canceled batch, every record not yet run is `canceled`."""
        unrun = list(job.never)
        if unrun_as == "canceled":
            unrun += range(job.next, job.total)
        for i in sorted(unrun):
            job.counts[unrun_as] += 1
            job.results.add({"custom_id": job.requests[i][0], "result": {"type": unrun_as}})
        job.never = []
        job.next = job.total
        job.results.close()
        job.ended_at = at


def _anthropic_params_problem(params: dict) -> str | None:
    """What Anthropic's Messages API refuses in a batched request's params (it errors the request)."""
    for name in ("model", "max_tokens", "messages"):
        if name not in params:
            return f"{name}: Field required"
    if not isinstance(params["messages"], list):
        return "messages: Input should be a valid list"
    if params.get("stream"):
        return "stream: streaming is not supported in Message Batches"
    return None


def _anthropic_error_body(status: int, body) -> dict:
    """An `errored` result's error: the provider's error body, in Anthropic's shape."""
    if isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict):
        return body
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return {
        "type": "error",
        "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message or f"HTTP {status}"},
    }
