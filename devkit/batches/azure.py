"""The fake Azure OpenAI Global Batch (devkit.batches): OpenAI's Files + Batches under the resource's v1 API,
`/openai/v1/files…` and `/openai/v1/batches…`, the same jobs and lifecycle as the OpenAI fake (partial
failures, expiry, cancel), with what Azure does differently:

- the key is the `api-key` header (401 without it, in Azure's error shape);
- an upload answers `"status": "pending"` and becomes `processed` `AZURE_FILE_PENDING` of the job time later;
  a batch made from a file still pending is refused (400), as the docs leave it undefined;
- a batch's create takes `endpoint` as `/chat/completions` (or `/responses`; embeddings are refused);
- every line's `model` must be one Global-Batch deployment the resource has (Clouds.azure_deployments): else
  the job fails validation with `model_not_found`, or `model_mismatch` when the lines name several;
- batch objects come back with a capitalised `status` and ISO `created_at`, as the older api-versions' do.

The jobs live in the OpenAI fake's state (keyed by the api-key, as Azure keys scope a resource); the log marks
their requests `provider="azure"`."""

from datetime import UTC, datetime

from devkit.batches.common import Answer, _dumps, _loads, openai_error

AZURE_PREFIX = "/openai"
AZURE_PATHS = ("/openai/v1/files", "/openai/v1/batches")
AZURE_ENDPOINTS = {"/chat/completions": "/v1/chat/completions", "/responses": "/v1/responses"}
AZURE_FILE_PENDING = 0.05  # of the job's seconds: how long an upload stays `pending`


def azure_error(status: int, code: str, message: str) -> Answer:
    return Answer(status, {"error": {"code": code, "message": message}})


class AzureBatches:
    """ProviderBatches' Azure operations (a mixin over the OpenAI ones)."""

    def _azure(self, op: str, ctx, ids: dict) -> Answer:
        if not ctx["headers"].get("api-key"):
            return azure_error(
                401,
                "401",
                "Access denied due to invalid subscription key or wrong API endpoint. Make sure to provide a valid "
                "key for an active subscription and use a correct regional API endpoint for your resource.",
            )
        if op == "create":
            refused = self._azure_create_problem(ctx)
            if refused is not None:
                return refused
        answer = getattr(self, f"_openai_{op}")(ctx, **ids)
        if op == "upload" and answer.status == 200:
            with self.lock:
                f = self.files.get(ctx["entry"]["file"])
            if f is not None:
                f.pending_until = self.clock() + AZURE_FILE_PENDING * self.job_seconds
                answer.obj = {**answer.obj, "status": "pending"}
        elif op == "file" and answer.status == 200:
            answer.obj = {**answer.obj, "status": self._azure_file_status(answer.obj["id"])}
        elif op == "create" and answer.status == 200:
            self._azure_check_models(answer.obj["id"])
        if answer.status == 200 and isinstance(answer.obj, dict):
            if answer.obj.get("object") == "batch":
                answer.obj = _azure_batch(answer.obj)
            elif answer.obj.get("object") == "list":
                answer.obj = {**answer.obj, "data": [_azure_batch(b) for b in answer.obj["data"]]}
        return answer

    def _azure_file_status(self, file_id: str) -> str:
        with self.lock:
            f = self.files.get(file_id)
        pending = getattr(f, "pending_until", None)
        return "pending" if pending is not None and self.clock() < pending else "processed"

    def _azure_create_problem(self, ctx) -> Answer | None:
        """Azure's create checks before the OpenAI fake's own: its endpoint spelling and a processed file."""
        try:
            body = _loads(ctx["raw"] or b"{}")
        except ValueError:
            return None  # the OpenAI fake answers it
        if not isinstance(body, dict):
            return None
        endpoint = body.get("endpoint")
        if endpoint not in AZURE_ENDPOINTS:
            return openai_error(
                400, f"Invalid value for 'endpoint': {endpoint!r}. Supported: /chat/completions, /responses."
            )
        if self._azure_file_status(str(body.get("input_file_id"))) != "processed":
            return openai_error(400, "The input file is not processed yet.", code="invalid_request")
        body["endpoint"] = AZURE_ENDPOINTS[endpoint]
        ctx["raw"] = _dumps(body)
        return None

    def _azure_check_models(self, job_id: str) -> None:
        """Every line must name one Global-Batch deployment of the resource: else the job fails validation."""
        job = self.jobs.get(job_id)
        if job is None:
            return
        models = set()
        for line in job.data.splitlines():
            try:
                models.add(str((_loads(line).get("body") or {}).get("model")))
            except (ValueError, AttributeError):
                continue
        deployments = self.server.clouds.azure_deployments
        if len(models) > 1:
            job.fail_message = "model_mismatch: the lines name more than one deployment."
        elif models and not models <= deployments:
            job.fail_message = f"model_not_found: the deployment {sorted(models)[0]!r} does not exist."


def _azure_batch(obj: dict) -> dict:
    """A batch object as Azure's older api-versions show it: a capitalised status, ISO times."""
    out = dict(obj)
    out["status"] = str(obj.get("status") or "").capitalize()
    if isinstance(obj.get("created_at"), int):
        out["created_at"] = datetime.fromtimestamp(obj["created_at"], UTC).strftime("%Y-%m-%dT%H:%M:%S.%f0+00:00")
    out["endpoint"] = str(obj.get("endpoint") or "").removeprefix("/v1") or None
    return out
