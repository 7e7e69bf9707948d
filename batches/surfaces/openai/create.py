"""The OpenAI-compatible batch surface (decision 0005): create, and the sweeper's look-ups.

Same Batch and Item rows and the same execution path as the native surface
(batches/worker/: claim, run, finish, heartbeat; batches/sweeper.py). This module
decides only how an OpenAI batch is created; how it moves through its
lifecycle (cancel, expiry, finalizing) lives in batches/lifecycle/. Records
are validated in the background (batches/validation.py) and results are
written as files at the end (batches/finalize.py). A record's relay-owned
`openrelay` key is split off in services (batches/tools/config.py) before any
model sees the body.
"""

import logging
from datetime import timedelta

import uuid6
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from batches import dispatch, ingest, retention, storage
from batches.errors import OpenAIError, invalid, missing
from batches.models import Batch, BatchStatus, Endpoint, File, FilePurpose, Shape, Surface
from batches.surfaces import common
from batches.surfaces.openai import read as openai_read
from batches.surfaces.openai.files import write_file
from core.auth import Principal
from core.errors import clipped, quoted

log = logging.getLogger(__name__)

CREATE_KEYS = {
    "endpoint",
    "completion_window",
    "input_file_id",
    "requests",
    "metadata",
    "model",
    "output_expires_after",
}
# The shape (and so the binding adapter) each endpoint's records are routed with.
ENDPOINT_SHAPE = {
    Endpoint.CHAT_COMPLETIONS: Shape.OPENAI,
    Endpoint.COMPLETIONS: Shape.OPENAI,
    Endpoint.EMBEDDINGS: Shape.OPENAI,
    Endpoint.RESPONSES: Shape.OPENAI_RESPONSES,
}
METADATA_MAX_PAIRS = 16
METADATA_KEY_MAX = 64
METADATA_VALUE_MAX = 512
MODEL_HINT_MAX = 200
IDEMPOTENCY_KEY_MAX = 255


# --- create -----------------------------------------------------------------------------------


def create(
    principal: Principal, submission: ingest.Submission, *, idempotency_key: str = "", retry_of: Batch | None = None
) -> Batch:
    """POST /v1/batches (OpenAI body) → a `validating` batch; validation runs in the background.

    Inline `requests` become the batch's input file (purpose `batch`, one record
    per line, line N = requests[N-1]), so both ways in share one validator and
    the batch object always has an input_file_id. With an Idempotency-Key, the
    same key and body from the same owner return the first batch. `retry_of`: the
    batch whose failed records this one re-runs (batches/surfaces/retry.py).
    """
    common.check_access(principal)
    params = _create_params(submission)
    if len(idempotency_key) > IDEMPOTENCY_KEY_MAX:
        raise invalid(f"Idempotency-Key must be at most {IDEMPOTENCY_KEY_MAX} characters.", code="invalid_request")
    if idempotency_key:
        replay = _replay(principal, idempotency_key, submission.sha256)
        if replay is not None:
            return replay
    input_file = _input_file(principal, params["input_file_id"]) if params["input_file_id"] else None
    _check_dispatchable()
    batch_id = uuid6.uuid7()
    now = timezone.now()
    inline = None
    try:
        with transaction.atomic():
            if input_file is None:
                inline = write_file(
                    principal,
                    purpose=FilePurpose.BATCH,
                    filename=f"batch_{batch_id.hex}_requests.jsonl",
                    chunks=submission.jsonl_chunks(),  # line N = requests[N-1], a megabyte per write
                    batch_id=batch_id,
                )
            batch = Batch.objects.create(
                id=batch_id,
                surface=Surface.OPENAI,
                # The shape its records are in, which is the adapter their bindings must have (as for a
                # live call): `openai` for chat/completions/embeddings, `openai_responses` for responses.
                inbound_shape=ENDPOINT_SHAPE[params["endpoint"]],
                status=BatchStatus.VALIDATING,
                created_at=now,
                expires_at=now + timedelta(seconds=settings.RELAY_BATCH_COMPLETION_WINDOW_SECONDS),
                endpoint=params["endpoint"],
                completion_window=params["completion_window"],
                metadata=params["metadata"],
                model=params["model"] or "",
                input_file_id=(input_file or inline).id,
                discount_percent=settings.RELAY_BATCH_DISCOUNT_PERCENT,
                # OpenAI's users expect a batch to wait out a busy provider and retry what is transient.
                max_attempts=settings.RELAY_BATCH_MAX_ATTEMPTS,
                retry_transient=True,
                wait_for_capacity=True,
                idempotency_key=idempotency_key,
                request_sha256=submission.sha256 if idempotency_key else "",
                retry_of=retry_of,
                **Batch.attribution(principal),
            )
            retention.remember_output_expiry(batch_id, params["output_expires_after"])
            transaction.on_commit(lambda: dispatch.hand_off("validate_openai_batch", batch_id))
    except BaseException as exc:
        if inline is not None:
            storage.delete_file(inline.ref)  # its row went with the rollback; its bytes go now
        if isinstance(exc, IntegrityError) and idempotency_key:
            # A concurrent request with the same Idempotency-Key committed first.
            replay = _replay(principal, idempotency_key, submission.sha256)
            if replay is not None:
                return replay
        raise
    return batch


def _create_params(submission: ingest.Submission) -> dict:
    top = submission.top
    unknown = sorted(set(top) - CREATE_KEYS)
    if unknown:
        name = clipped(unknown[0])
        raise invalid(f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter")
    endpoint = top.get("endpoint")
    if endpoint is None:
        raise missing("endpoint")
    if endpoint not in Endpoint.values:
        raise invalid(
            f"Invalid value for 'endpoint': {quoted(endpoint)}. Supported values are: "
            + ", ".join(f"'{e}'" for e in Endpoint.values)
            + ".",
            param="endpoint",
        )
    window = top.get("completion_window")
    if window is None:
        raise missing("completion_window")
    if window != "24h":
        raise invalid(
            f"Invalid value for 'completion_window': {quoted(window)}. Only '24h' is supported.",
            param="completion_window",
        )
    has_file, has_requests = "input_file_id" in top, "requests" in top
    if has_file and has_requests:
        raise invalid(
            "Provide exactly one of 'input_file_id' or 'requests', not both.",
            param="input_file_id",
            code="invalid_request",
        )
    if not has_file and not has_requests:
        raise OpenAIError(
            400,
            "missing_required_parameter",
            "Missing required parameter: provide 'input_file_id' (an uploaded JSONL file) "
            "or 'requests' (inline records).",
            param="input_file_id",
        )
    file_id = top.get("input_file_id")
    if has_file and not isinstance(file_id, str):
        raise invalid(
            "Invalid type for 'input_file_id': expected a string.", param="input_file_id", code="invalid_type"
        )
    if has_file and not file_id.strip():  # "" is not "no file": refuse it (decision 0009)
        raise invalid("Invalid 'input_file_id': empty string; pass a file id (file-…).", param="input_file_id")
    if has_requests:
        max_items = settings.RELAY_BATCH_MAX_ITEMS
        if not submission.count:
            raise invalid("'requests' must contain at least one record.", param="requests")
        if submission.count > max_items:
            raise invalid(
                f"Too many requests: {submission.count} records, "
                f"at most {max_items} per batch (RELAY_BATCH_MAX_ITEMS).",
                param="requests",
                code="too_many_requests",
            )
    return {
        "endpoint": endpoint,
        "completion_window": window,
        "input_file_id": file_id,
        "metadata": _metadata(top.get("metadata")),
        "model": _model_hint(top.get("model")),
        "output_expires_after": (
            retention.parse_expires_after(top["output_expires_after"], "output_expires_after")
            if top.get("output_expires_after") is not None
            else None
        ),
    }


def _metadata(value) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(
            "Invalid type for 'metadata': expected an object of string values.", param="metadata", code="invalid_type"
        )
    if len(value) > METADATA_MAX_PAIRS:
        raise invalid(f"'metadata' has {len(value)} pairs; at most {METADATA_MAX_PAIRS} are allowed.", param="metadata")
    for key, val in value.items():
        if len(key) > METADATA_KEY_MAX:
            raise invalid(
                f"'metadata' key {key[:20]!r}… is longer than {METADATA_KEY_MAX} characters.",
                param=f"metadata.{clipped(key)}",
            )
        if not isinstance(val, str):
            raise invalid(f"'metadata.{key}' must be a string.", param=f"metadata.{key}", code="invalid_type")
        if len(val) > METADATA_VALUE_MAX:
            raise invalid(f"'metadata.{key}' is longer than {METADATA_VALUE_MAX} characters.", param=f"metadata.{key}")
    return value


def _model_hint(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MODEL_HINT_MAX:
        raise invalid(f"'model' must be a string of at most {MODEL_HINT_MAX} characters.", param="model")
    return value


def _input_file(principal: Principal, public_id: str) -> File:
    pk = openai_read.parse_public_id(public_id, "file-")
    file = openai_read.live_files(principal).filter(pk=pk).first() if pk is not None else None
    if file is None:
        raise invalid(f"No file found with id '{clipped(public_id)}'.", param="input_file_id", code="file_not_found")
    if file.purpose != FilePurpose.BATCH:
        raise invalid(
            f"File '{clipped(public_id)}' has purpose '{file.purpose}'; a batch input file must have purpose 'batch'.",
            param="input_file_id",
        )
    return file


def _replay(principal: Principal, key: str, sha256: str) -> Batch | None:
    first = Batch.objects.filter(owner_hash=principal.owner_hash, idempotency_key=key).first()
    if first is None:
        return None
    if first.request_sha256 != sha256:
        raise OpenAIError(
            400,
            "idempotency_key_reused",
            "This Idempotency-Key was already used with a different request body; use a new key for a new batch.",
            headers={"x-should-retry": "false"},
        )
    return first


def _check_dispatchable() -> None:
    """503 (nothing stored) when the queue broker cannot take the validation message."""
    if not dispatch.broker_reachable():
        raise OpenAIError(
            503,
            "dispatch_unavailable",
            "The batch could not be dispatched: the queue broker is unreachable. Retry shortly.",
            headers={"Retry-After": 2},
        )
