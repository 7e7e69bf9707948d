"""The OpenAI surface's objects, as OpenAI shapes them: Batch, File, lists. Timestamps are Unix seconds."""

from batches.models import Batch, File
from batches.surfaces import common
from batches.surfaces.openai import read as openai_read


def _ts(dt) -> int | None:
    return int(dt.timestamp()) if dt else None


def _file_id(pk) -> str | None:
    return f"file-{pk.hex}" if pk else None


def batch(b: Batch) -> dict:
    return {
        "id": b.public_id,
        "object": "batch",
        "endpoint": b.endpoint,
        "model": b.model or None,
        "errors": {"object": "list", "data": b.errors} if b.errors else None,
        "input_file_id": _file_id(b.input_file_id),
        "completion_window": b.completion_window,
        "status": b.status,
        "output_file_id": _file_id(b.output_file_id),
        "error_file_id": _file_id(b.error_file_id),
        "created_at": _ts(b.created_at),
        "in_progress_at": _ts(b.in_progress_at),
        "expires_at": _ts(b.expires_at),
        "finalizing_at": _ts(b.finalizing_at),
        "completed_at": _ts(b.completed_at),
        "failed_at": _ts(b.failed_at),
        "expired_at": _ts(b.expired_at),
        "cancelling_at": _ts(b.cancelling_at),
        "cancelled_at": _ts(b.cancelled_at),
        "request_counts": openai_read.request_counts(b),
        "metadata": b.metadata,
        "usage": openai_read.usage(b),
        # Re-run what failed (batches/surfaces/retry.py): the batch this one re-runs, and its own retries.
        "retry_of": b.retry_of_public_id,
        "retried_by": common.retried_by(b),
    }


def file(f: File) -> dict:
    return {
        "id": f.public_id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": _ts(f.created_at),
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",  # deprecated by OpenAI; a stored file here is always ready
        "expires_at": _ts(f.expires_at),  # null: kept until deleted
        "status_details": None,
    }


def page(objects: list, render, has_more: bool) -> dict:
    data = [render(o) for o in objects]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
