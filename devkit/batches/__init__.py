"""The providers' batch APIs for the demo / test upstream (devkit.upstream). Not a model.

`ProviderBatches` keeps, in memory, what OpenAI's Files + Batches API and Anthropic's Message Batches
API keep, and answers their wire formats so the relay's code and the official `openai` and `anthropic`
SDKs run against it unchanged:

- OpenAI: POST /v1/files (multipart: file, purpose), GET /v1/files, GET /v1/files/{id},
  GET /v1/files/{id}/content, DELETE /v1/files/{id}; POST /v1/batches, GET /v1/batches (limit, after),
  GET /v1/batches/{id}, POST /v1/batches/{id}/cancel.
- Anthropic: POST /v1/messages/batches, GET /v1/messages/batches (limit, after_id, before_id),
  GET /v1/messages/batches/{id}, GET /v1/messages/batches/{id}/results,
  POST /v1/messages/batches/{id}/cancel, DELETE /v1/messages/batches/{id}.

Every record is answered by the same logic as a live call: a standing answer of the server's
(`server.answer_when(text, Reply(...))`, matched against the record's raw JSON line) or else
`canned(url, body)`. Jobs and files belong to the API key that made them; another key gets 404, as
providers scope them by organization.

Time: a job runs for `job_seconds` (env RELAY_DEMO_BATCH_SECONDS, default 3), computed lazily on each
request (no thread). With T = the job's seconds, from its creation:
- OpenAI: validating until 0.1 T (the input file is checked then); in_progress until 0.9 T, its
  records finishing evenly over that span (request_counts move); finalizing until T; then completed.
- Anthropic: in_progress, records finishing evenly over [0, 0.9 T); ended at T.
- The completion window (expires_at) is T too: records that never finish (`expire_when`) end expired at
  T. A cancel takes 0.1 T to land (cancelling / canceling, then cancelled / ended).

Tests control it with the knobs below (all undone by `reset()`), `clock` (a function returning the time,
`time.time` by default) to move time by hand, and read `log` (every batch-API request).
"""

from devkit.batches.anthropic import AnthropicBatches, AnthropicJob
from devkit.batches.common import (
    ANTHROPIC_CUSTOM_ID,
    ANTHROPIC_ERROR_TYPES,
    ANTHROPIC_MAX_BYTES,
    ANTHROPIC_MAX_REQUESTS,
    BASE62,
    CANCEL_TAKES,
    CANCELLED_MESSAGE,
    CHUNK,
    DEFAULT_JOB_SECONDS,
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
    anthropic_error,
    default_job_seconds,
    openai_error,
    parse_multipart,
)
from devkit.batches.openai import OpenAIBatches, OpenAIJob
from devkit.batches.server import PREFIXES, ROUTES, ProviderBatches

__all__ = [
    "ANTHROPIC_CUSTOM_ID",
    "ANTHROPIC_ERROR_TYPES",
    "ANTHROPIC_MAX_BYTES",
    "ANTHROPIC_MAX_REQUESTS",
    "BASE62",
    "CANCELLED_MESSAGE",
    "CANCEL_TAKES",
    "CHUNK",
    "DEFAULT_JOB_SECONDS",
    "EXPIRED_MESSAGE",
    "OPENAI_ENDPOINTS",
    "OPENAI_FILE_PURPOSES",
    "OPENAI_MAX_BATCH_BYTES",
    "OPENAI_MAX_FILE_BYTES",
    "OPENAI_MAX_REQUESTS",
    "PREFIXES",
    "RECORDS_DONE_AT",
    "ROUTES",
    "VALIDATED_AT",
    "AnthropicBatches",
    "AnthropicJob",
    "Answer",
    "Job",
    "OpenAIBatches",
    "OpenAIJob",
    "ProviderBatches",
    "Spool",
    "StoredFile",
    "anthropic_error",
    "default_job_seconds",
    "openai_error",
    "parse_multipart",
]
