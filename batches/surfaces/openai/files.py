"""Files of the OpenAI-compatible surface: streamed uploads, relay-written files, deletion.

An upload is read from the multipart stream chunk by chunk (a Django upload
handler that writes each chunk straight to the payload store), so a 200 MB
file never sits in memory or in a temporary file. The file row is created only
once every byte is stored; any failure removes what was written.

Concurrent uploads are counted per credential in Redis: a sorted set of
in-flight upload tokens scored by start time. Each upload removes its own token
when it ends; a token left by a crashed process stops counting after
UPLOAD_SLOT_STALE_SECONDS, so the count heals itself.
"""

import contextlib
import logging
import time
import uuid

import redis
import uuid6
from django.conf import settings
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.core.files.uploadhandler import FileUploadHandler, SkipFile
from django.db import transaction
from django.http.multipartparser import MultiPartParserError
from django.utils import timezone

from batches import retention, storage
from batches.errors import OpenAIError, invalid, missing
from batches.models import File, FilePurpose
from core.auth import Principal
from core.errors import clipped, quoted
from core.http import ascii_int
from core.redis import get_redis

log = logging.getLogger(__name__)

UPLOAD_SLOT_STALE_SECONDS = 3600
# Multipart framing and the small form fields around the file part.
_MULTIPART_OVERHEAD = 1024 * 1024
_UPLOAD_FIELDS = {"purpose"}


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        "file_too_large",
        f"File is too large: the limit is {limit} bytes (RELAY_MAX_UPLOAD_BYTES).",
        param="file",
    )


# --- upload slots -------------------------------------------------------------------------


@contextlib.contextmanager
def upload_slot(principal: Principal):
    """Hold one of the credential's RELAY_MAX_CONCURRENT_UPLOADS slots; 429 when none is free."""
    limit = settings.RELAY_MAX_CONCURRENT_UPLOADS
    # One hash tag per credential, so a Redis Cluster keeps the set in one slot.
    key = f"uploads:{{cred:{principal.credential_kind}:{principal.credential_id}}}"
    token = uuid.uuid4().hex
    r = get_redis()
    now = time.time()
    try:
        pipe = r.pipeline(transaction=True)
        pipe.zremrangebyscore(key, "-inf", now - UPLOAD_SLOT_STALE_SECONDS)
        pipe.zadd(key, {token: now})
        pipe.zcard(key)
        pipe.expire(key, UPLOAD_SLOT_STALE_SECONDS)
        in_flight = pipe.execute()[2]
    except redis.RedisError as exc:
        raise OpenAIError(
            503, "upload_slots_unavailable", "Uploads cannot be counted right now (Redis is unreachable); retry."
        ) from exc
    if in_flight > limit:
        r.zrem(key, token)
        raise OpenAIError(
            429,
            "too_many_concurrent_uploads",
            f"Too many concurrent uploads: at most {limit} per credential (RELAY_MAX_CONCURRENT_UPLOADS); "
            "retry when one has finished.",
            type="rate_limit_error",
            headers={"Retry-After": 1},
        )
    try:
        yield
    finally:
        try:
            r.zrem(key, token)
        except redis.RedisError:  # the token goes stale on its own
            log.warning("could not release upload slot %s", key, exc_info=True)


# --- uploads ----------------------------------------------------------------------------------


class _StorageUploadHandler(FileUploadHandler):
    """Streams the `file` part into the payload store as Django's parser reads it."""

    chunk_size = 256 * 1024

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.writer = None
        self.file_id = None
        self.filename = ""
        self.complete = False
        self.extra_files = 0

    def new_file(self, field_name, file_name, content_type, content_length, charset=None, content_type_extra=None):
        if field_name != "file" or self.writer is not None:
            self.extra_files += 1
            raise SkipFile()
        if content_length is not None and content_length > self.limit:
            raise storage.FileTooLarge(self.limit)
        self.file_id = uuid6.uuid7()
        # Stored as text in PostgreSQL: no NUL, no lone surrogate (decision 0009); the path part is already gone.
        self.filename = file_name.replace("\x00", "").encode("utf-8", "replace").decode("utf-8")[:255]
        self.writer = storage.file_writer(str(self.file_id), limit=self.limit)

    def receive_data_chunk(self, raw_data, start):
        self.writer.write(raw_data)
        return None  # consumed: no other handler keeps a copy

    def file_complete(self, file_size):
        self.complete = True
        return None

    def discard(self) -> None:
        if self.writer is not None:
            self.writer.discard()
            self.writer = None


def upload(principal: Principal, django_request) -> File:
    """POST /v1/files: store the multipart `file` part (purpose `batch`) as a file owned by the caller."""
    limit = settings.RELAY_MAX_UPLOAD_BYTES
    if not django_request.META.get("CONTENT_TYPE", "").startswith("multipart/form-data"):
        raise invalid("Uploads must be multipart/form-data with a 'file' part and a 'purpose' field.", param="file")
    declared = ascii_int(django_request.META.get("CONTENT_LENGTH") or "")
    if declared is not None and declared > limit + _MULTIPART_OVERHEAD:
        raise too_large(limit)  # refused before reading a byte
    with upload_slot(principal):
        return _receive(principal, django_request, limit)


def _receive(principal: Principal, django_request, limit: int) -> File:
    handler = _StorageUploadHandler(limit)
    django_request.upload_handlers = [handler]
    try:
        try:
            fields = django_request.POST  # parses the whole body, streaming the file part to storage
        except storage.FileTooLarge as exc:
            raise too_large(limit) from exc
        except (MultiPartParserError, RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent) as exc:
            raise invalid(f"Malformed multipart body: {clipped(exc)}", code="invalid_multipart") from exc
        unknown = sorted(set(fields) - _UPLOAD_FIELDS - retention.UPLOAD_FIELDS)
        if unknown:
            raise invalid(
                f"Unsupported upload field(s): {clipped(', '.join(unknown))}.",
                param=clipped(unknown[0]),
                code="unknown_parameter",
            )
        purpose = fields.get("purpose", "")
        if not purpose:
            raise missing("purpose")
        if purpose != FilePurpose.BATCH:
            raise invalid(
                f"Invalid value for 'purpose': {quoted(purpose)}. This relay accepts only 'batch'.", param="purpose"
            )
        if handler.writer is None:
            raise missing("file")
        if handler.extra_files:
            raise invalid("Send exactly one file, in the 'file' part.", param="file")
        if not handler.complete:
            raise invalid("The 'file' part ended before its closing boundary.", param="file")
        expires_after = retention.upload_expiry(fields)
        writer, handler.writer = handler.writer, None
        try:
            ref = writer.close()
            now = timezone.now()
            return File.objects.create(
                id=handler.file_id,
                purpose=FilePurpose.BATCH,
                filename=handler.filename,
                bytes=writer.size,
                ref=ref,
                created_at=now,
                expires_at=retention.expires_at(expires_after, now),
                **owner_columns(principal),
            )
        except BaseException:
            writer.discard()
            raise
    finally:
        handler.discard()


def write_file(owner: Principal, *, purpose: str, filename: str, chunks, batch_id=None) -> File:
    """Write a relay-made file (a batch's inline requests) from an iterable of byte chunks."""
    file_id = uuid6.uuid7()
    writer = storage.file_writer(str(file_id))
    try:
        for chunk in chunks:
            writer.write(chunk)
        ref = writer.close()
        return File.objects.create(
            id=file_id,
            purpose=purpose,
            filename=filename,
            bytes=writer.size,
            ref=ref,
            batch_id=batch_id,
            **owner_columns(owner),
        )
    except BaseException:
        writer.discard()
        raise


def delete(file: File) -> None:
    """DELETE /v1/files/{id}: the row now, the bytes once that has committed."""
    with transaction.atomic():
        File.objects.filter(pk=file.pk).delete()
        transaction.on_commit(lambda: storage.delete_file(file.ref))


_FILE_COLUMNS = {f.name for f in File._meta.concrete_fields}


def owner_columns(owner: Principal) -> dict:
    """Ownership and attribution columns of a file: the principal's attribution, as far as a file keeps it."""
    return {k: v for k, v in owner.attribution().items() if k in _FILE_COLUMNS}
