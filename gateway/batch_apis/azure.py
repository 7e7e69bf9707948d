"""Azure OpenAI's Global Batch: OpenAI's Files + Batches wire on Azure's v1 API (`{resource}/openai/v1/files`,
`/openai/v1/batches`), the host key in `api-key`. Each record's `model` is the binding's upstream name, which
on Azure is the Global-Batch deployment (the same on every line, or Azure fails the job with
`model_mismatch`). What differs from OpenAI, and only that, is here:

- an upload may answer `pending`: the file is polled until `processed` before the batch is made from it
  (a file still pending at the create is a transient refusal: the job is sent again, reusing it);
- a batch's `status` may be capitalised (`Validating`) and its times ISO strings (older api-versions): the
  OpenAI class reads both;
- Azure's create takes `endpoint` without the `/v1` (`/chat/completions`), and whether it keeps `metadata`
  on every api-version is not documented: a lost create is found by its input file, which is the job's alone;
- a job that hits the deployment's enqueued-token quota fails (`token_limit_exceeded`, or a message about the
  enqueued tokens): that is "no room now", not a bad job;
- Global Batch takes Chat Completions and Responses (not Embeddings), 100,000 requests and 200 MB per file.
A successful job still names an (empty) error file; reading it, as for OpenAI, costs nothing."""

import logging
import time
from typing import ClassVar

from gateway.batch_apis.base import Refused, json_object
from gateway.batch_apis.openai import OpenAIBatchAPI

log = logging.getLogger(__name__)

# How long an upload Azure answered `pending` is polled before the create is left to find it processed.
UPLOAD_WAITS = (0.2, 0.5, 1.0, 2.0, 2.0, 4.0)
_FILE_READY = {"processed", ""}
_FILE_FAILED = {"error", "failed", "deleted"}


class AzureBatchAPI(OpenAIBatchAPI):
    kind = "azure_openai"
    label = "Azure OpenAI Global Batch"
    adapters: ClassVar[frozenset] = frozenset({"openai", "openai_responses"})
    endpoints: ClassVar[frozenset] = frozenset({"/v1/chat/completions", "/v1/responses"})
    max_records = 100_000
    max_bytes = 200 * 1024 * 1024  # one input file (1 GB only with the resource's own storage)
    prefix = "/openai"

    def upload(self, records) -> str:
        file_id = super().upload(records)
        for pause in UPLOAD_WAITS:
            if self._file_state(file_id) in _FILE_READY:
                break
            time.sleep(pause)
        return file_id

    def _file_state(self, file_id: str) -> str:
        state = str(json_object(self._call("GET", f"{self.prefix}/v1/files/{file_id}")).get("status") or "")
        state = state.lower()
        if state in _FILE_FAILED:
            # A file Azure could not take is the job's input itself: refused as a bad job (its records fail).
            raise Refused(400, f'{{"error": "the input file {file_id} is {state}"}}'.encode())
        return state

    def create_body(self) -> dict:
        return {
            "input_file_id": self.job.upstream_input_file_id,
            "endpoint": self.job.endpoint.removeprefix("/v1"),
            "completion_window": "24h",  # Azure fails a job created with any other window
        }

    def create(self, records) -> str:
        if self._file_state(self.job.upstream_input_file_id) not in _FILE_READY:
            # Still being processed: nothing is created now, the job is sent again (its upload reused).
            raise Refused(503, b'{"error": "the input file is still being processed"}')
        return super().create(records)

    def is_the_jobs(self, row: dict) -> bool:
        return bool(self.job.upstream_input_file_id) and row.get("input_file_id") == self.job.upstream_input_file_id

    @staticmethod
    def capacity_failure(first: dict) -> bool:
        message = str(first.get("message") or "").lower()
        return first.get("code") == "token_limit_exceeded" or "enqueued token" in message
