"""Retention: what the relay keeps, for how long, and what removes it.

- Files of the OpenAI surface carry `expires_at` (OpenAI's `expires_after` on upload, the batch's
  `output_expires_after` on its output and error files). The retention job (`batches.tasks.retention`,
  every RELAY_RETENTION_SWEEP_SECONDS) deletes expired files, row and bytes. An upload still being
  validated by a batch waits for the next sweep.
- Native batches (decision 0003) finished more than RELAY_NATIVE_BATCH_RETENTION_SECONDS ago are deleted
  with their payloads (0 = kept until deleted).
- Revoked inference tokens are forgotten once the token would have expired anyway (plus a margin).
- Deleting a batch or a file — through the API, the admin, the retention job or a cascade — removes
  its stored bytes once the delete has committed (`post_delete` receivers below). A batch takes the
  files it wrote (its output and error files, the file made from inline `requests`) with it.
- `manage.py payload_orphans [--clean]` reports (and removes) stored payloads no row points at: in the
  payload directory, the database store and, when RELAY_S3_BUCKET is set, the bucket under
  RELAY_S3_PREFIX (objects, and multipart uploads begun longer than the grace period ago and never
  completed: a process killed mid-upload leaves one, and the store keeps its parts until aborted).
"""

import contextlib
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.db.models.signals import post_delete
from django.dispatch import receiver
from django.utils import timezone

from batches import storage, storage_s3
from batches.errors import invalid
from batches.models import Batch, BatchStatus, File, OutputExpiry, Payload, Surface
from relay.errors import clipped, quoted
from relay.http import ascii_int

log = logging.getLogger(__name__)

# OpenAI's bounds for expires_after / output_expires_after: one hour to thirty days.
EXPIRES_MIN_SECONDS = 3600
EXPIRES_MAX_SECONDS = 30 * 24 * 3600
SWEEP_LIMIT = 500  # rows per kind per sweep: a backlog drains over several sweeps, each one short


# --- the API's expires_after --------------------------------------------------------------------


def parse_expires_after(value, param: str) -> int:
    """OpenAI's {"anchor": "created_at", "seconds": N} → N, or a 400 naming `param`."""
    if not isinstance(value, dict):
        raise invalid(
            f"Invalid type for '{param}': expected an object with 'anchor' and 'seconds'.",
            param=param,
            code="invalid_type",
        )
    unknown = sorted(set(value) - {"anchor", "seconds"})
    if unknown:
        name = f"{param}.{clipped(unknown[0])}"
        raise invalid(f"Unknown field '{name}'.", param=name)
    if value.get("anchor") != "created_at":
        raise invalid(
            f"Invalid value for '{param}.anchor': {quoted(value.get('anchor'))}. Supported values are: 'created_at'.",
            param=f"{param}.anchor",
        )
    seconds = value.get("seconds")
    if isinstance(seconds, str) and ascii_int(seconds) is not None:  # multipart fields are strings
        seconds = ascii_int(seconds)
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        raise invalid(f"Invalid type for '{param}.seconds': expected an integer.", param=f"{param}.seconds")
    if not EXPIRES_MIN_SECONDS <= seconds <= EXPIRES_MAX_SECONDS:
        raise invalid(
            f"'{param}.seconds' must be between {EXPIRES_MIN_SECONDS} and {EXPIRES_MAX_SECONDS}.",
            param=f"{param}.seconds",
        )
    return seconds


def upload_expiry(fields) -> int | None:
    """The multipart form's `expires_after[anchor]` / `expires_after[seconds]` (as the SDKs send them)."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    return parse_expires_after({"anchor": anchor, "seconds": seconds}, "expires_after")


UPLOAD_FIELDS = {"expires_after[anchor]", "expires_after[seconds]"}


def expires_at(seconds: int | None, created_at):
    return created_at + timedelta(seconds=seconds) if seconds else None


def remember_output_expiry(batch_id, seconds: int | None) -> None:
    """Batch create: keep `output_expires_after` until finalize writes the files."""
    if seconds:
        OutputExpiry.objects.create(batch_id=batch_id, seconds=seconds)


def output_expires_at(batch: Batch, created_at):
    """When a batch's output or error file written at `created_at` expires (None: kept)."""
    seconds = OutputExpiry.objects.filter(batch_id=batch.pk).values_list("seconds", flat=True).first()
    return expires_at(seconds, created_at)


# --- the periodic job -------------------------------------------------------------------------------


def sweep(now=None) -> dict:
    """Remove what is past its retention. Idempotent; each kind bounded per run."""
    from relay.models import RevokedToken

    now = now or timezone.now()
    out = {"files": 0, "native_batches": 0, "revoked_tokens": 0}

    validating_inputs = Batch.objects.filter(status=BatchStatus.VALIDATING).values("input_file_id")
    expired = File.objects.filter(expires_at__lte=now).exclude(pk__in=validating_inputs)
    for file in expired.order_by("expires_at")[:SWEEP_LIMIT]:
        with transaction.atomic():
            out["files"] += File.objects.filter(pk=file.pk).delete()[0]  # bytes go on commit (receiver below)

    keep = settings.RELAY_NATIVE_BATCH_RETENTION_SECONDS
    if keep > 0:
        old = Batch.objects.filter(
            surface=Surface.NATIVE,
            status__in=[BatchStatus.COMPLETED, BatchStatus.CANCELLED],
            completed_at__lt=now - timedelta(seconds=keep),
        )
        for batch_id in old.values_list("id", flat=True)[:SWEEP_LIMIT]:
            with transaction.atomic():
                out["native_batches"] += Batch.objects.filter(pk=batch_id).delete()[1].get("batches.Batch", 0)

    margin = timedelta(seconds=settings.RELAY_REVOKED_TOKEN_PRUNE_MARGIN_SECONDS)
    out["revoked_tokens"] = RevokedToken.objects.filter(expires_at__lt=now - margin).delete()[0]
    if any(out.values()):
        log.info("retention: removed %s", out)
    return out


# --- deleting a row removes its bytes ------------------------------------------------------------


@receiver(post_delete, sender=File, dispatch_uid="retention_file_bytes")
def _file_deleted(sender, instance: File, **kwargs) -> None:
    ref = instance.ref
    transaction.on_commit(lambda: storage.delete_file(ref))


@receiver(post_delete, sender=Batch, dispatch_uid="retention_batch_payloads")
def _batch_deleted(sender, instance: Batch, **kwargs) -> None:
    batch_id = instance.pk
    # The files this batch wrote go with it (their own receiver removes their bytes).
    File.objects.filter(batch_id=batch_id).delete()
    transaction.on_commit(lambda: storage.delete_batch(str(batch_id)))


# --- orphans -------------------------------------------------------------------------------------


@dataclass
class Orphans:
    """Stored payloads that no row points at. `paths` are under RELAY_BATCH_PAYLOAD_DIR; `keys` are db rows;
    `objects` are s3 refs (`s3:files/<id>`, or `s3:<batch>/` for all of a batch's objects); `uploads` are
    (s3 ref path, upload id) of multipart uploads never completed."""

    paths: list[Path] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)
    uploads: list[tuple[str, str]] = field(default_factory=list)
    bytes: int = 0
    missing_files: list[str] = field(default_factory=list)  # file rows whose bytes are gone (reported only)

    @property
    def count(self) -> int:
        return len(self.paths) + len(self.keys) + len(self.objects) + len(self.uploads)


def _uuid(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text)
    except ValueError:
        return None


def _young_uuid7(value: uuid.UUID, cutoff_ms: int) -> bool:
    """UUIDv7 ids carry their creation time: a payload made after `cutoff_ms` may still be in flight."""
    return value.version == 7 and (value.int >> 80) > cutoff_ms


def find_orphans(now: float | None = None) -> Orphans:
    """`now` (epoch seconds): the clock the grace period is counted on (tests move it; default: the time)."""
    now = time.time() if now is None else now
    grace = settings.RELAY_ORPHAN_GRACE_SECONDS
    cutoff_ms = int((now - grace) * 1000)
    found = Orphans()
    batch_ids = {str(b) for b in Batch.objects.values_list("id", flat=True)}
    file_refs = set(File.objects.values_list("ref", flat=True))

    root = Path(settings.RELAY_BATCH_PAYLOAD_DIR)
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name == "files" and entry.is_dir():
                for f in entry.iterdir():
                    if f"file:files/{f.name.removesuffix('.part')}" in file_refs and not f.name.endswith(".part"):
                        continue
                    if f.stat().st_mtime > now - grace:
                        continue  # an upload in flight
                    found.paths.append(f)
                    found.bytes += f.stat().st_size
                continue
            value = _uuid(entry.name)
            if value is None or str(value) in batch_ids or _young_uuid7(value, cutoff_ms):
                continue
            if entry.stat().st_mtime > now - grace:
                continue
            found.paths.append(entry)
            found.bytes += sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())

    file_prefixes = {ref.removeprefix("dbfile:") for ref in file_refs if ref.startswith("dbfile:")}
    stored_db_files = set()
    for key in Payload.objects.values_list("key", flat=True).iterator(chunk_size=5000):
        head, _, rest = key.partition("/")
        if head == "files":
            file_id = rest.partition("/")[0]
            stored_db_files.add(f"files/{file_id}")
            value = _uuid(file_id)
            if f"files/{file_id}" in file_prefixes or (value is not None and _young_uuid7(value, cutoff_ms)):
                continue
        else:
            value = _uuid(head)
            if head in batch_ids or (value is not None and _young_uuid7(value, cutoff_ms)):
                continue
        found.keys.append(key)

    stored_s3_files = _s3_orphans(found, batch_ids, file_refs, now - grace) if storage_s3.configured() else None

    for public, ref in File.objects.values_list("id", "ref").iterator(chunk_size=2000):
        scheme, _, rest = ref.partition(":")
        if scheme == "file" and not (root / rest).exists():
            found.missing_files.append(f"file-{public.hex}")
        elif scheme == "dbfile" and rest not in stored_db_files:
            found.missing_files.append(f"file-{public.hex}")
        elif scheme == "s3" and stored_s3_files is not None and rest not in stored_s3_files:
            found.missing_files.append(f"file-{public.hex}")
    return found


def _s3_orphans(found: Orphans, batch_ids: set, file_refs: set, cutoff_s: float) -> set:
    """The bucket's part of find_orphans; answers the file objects that exist. As in the directory: a
    batch's objects are orphans when no batch row has its id and the batch is older than the grace
    period (its UUIDv7) and so is every object of it; a file object when no file row points at it and it
    is older than the grace period. A multipart upload older than that is abandoned (one in flight keeps
    its batch's objects from being taken)."""
    cutoff = datetime.fromtimestamp(cutoff_s, tz=UTC)
    cutoff_ms = int(cutoff_s * 1000)
    in_flight = set()
    for rel, upload_id, initiated in storage_s3.uploads():
        # Both clocks must say old: the store's (moto reports a fixed date) and the UUIDv7 in the key.
        head, _, rest = rel.partition("/")
        value = _uuid(rest if head == "files" else head)
        if initiated < cutoff and not (value is not None and _young_uuid7(value, cutoff_ms)):
            found.uploads.append((rel, upload_id))
        else:
            in_flight.add(rel.partition("/")[0])
    stored = set()
    for name in storage_s3.top_level():
        if name == "files":
            for rel, size, modified in storage_s3.objects("files/"):
                stored.add(rel)
                if f"s3:{rel}" in file_refs or modified > cutoff:
                    continue
                found.objects.append(f"s3:{rel}")
                found.bytes += size
            continue
        value = _uuid(name)
        if value is None or str(value) in batch_ids or _young_uuid7(value, cutoff_ms) or name in in_flight:
            continue
        listing = list(storage_s3.objects(f"{name}/"))
        if listing and all(modified <= cutoff for _, _, modified in listing):
            found.objects.append(f"s3:{name}/")
            found.bytes += sum(size for _, size, _ in listing)
    return stored


def clean_orphans(found: Orphans) -> None:
    for path in found.paths:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    for i in range(0, len(found.keys), 1000):
        Payload.objects.filter(key__in=found.keys[i : i + 1000]).delete()
    for rel, upload_id in found.uploads:
        storage_s3.abort_upload(rel, upload_id)
    if single := [ref[3:] for ref in found.objects if not ref.endswith("/")]:
        storage_s3.delete_keys(single)
    for ref in found.objects:
        if ref.endswith("/"):
            storage_s3.delete_prefix(ref[3:])
