"""Retention: what the relay keeps, for how long, and what removes it.

- Files of the OpenAI surface carry `expires_at` (OpenAI's `expires_after` on upload, the batch's
  `output_expires_after` on its output and error files). The retention job (`batches.tasks.retention`,
  every RELAY_RETENTION_SWEEP_SECONDS) deletes expired files, row and bytes. An upload still being
  validated by a batch waits for the next sweep.
- Native batches (decision 0003) finished more than RELAY_NATIVE_BATCH_RETENTION_SECONDS ago are deleted
  with their payloads (0 = kept until deleted).
- OpenAI-surface batches that ended more than RELAY_OPENAI_ITEM_RETENTION_SECONDS ago (default 30 days;
  0 = kept) lose their items — rows, attempts and stored bodies — but keep their batch object, with its
  request counts frozen on the row (`Batch.frozen_counts`): OpenAI's API has no batch delete, and the
  output and error files, written before the batch ended, hold every result (they expire on their own).
  See `prune_items` below.
- Anthropic-surface batches created more than RELAY_ANTHROPIC_RESULTS_RETENTION_SECONDS ago (default 29
  days, as Anthropic keeps results; 0 = kept) and ended lose their items the same way: the batch stays
  (Anthropic's API lets a client view it after its results are gone), shows `archived_at`, and its
  results download is refused (batches/surfaces/anthropic/read.py).
- Revoked inference tokens are forgotten once the token would have expired anyway (plus a margin).
- Deleting a batch or a file — through the API, the admin, the retention job or a cascade — removes
  its stored bytes once the delete has committed (`post_delete` receivers below). A batch takes the
  files it wrote (its output and error files, the file made from inline `requests`) with it.
- `manage.py payload_orphans [--clean]` reports (and removes) stored payloads no row points at (a batch
  whose items retention removed points at none of its own): in the payload directory, the database
  store and, when RELAY_S3_BUCKET is set, the bucket under RELAY_S3_PREFIX (objects, and multipart
  uploads begun longer than the grace period ago and never completed: a process killed mid-upload leaves
  one, and the store keeps its parts until aborted).
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
from django.db import connection, transaction
from django.db.models import Count, Q
from django.db.models.functions import Coalesce
from django.db.models.signals import post_delete
from django.dispatch import receiver
from django.utils import timezone

from batches import storage, storage_s3
from batches.errors import invalid
from batches.lifecycle import states
from batches.models import (
    ANTHROPIC_PRUNABLE_STATUSES,
    PENDING_STATES,
    PRUNABLE_STATUSES,
    Attempt,
    Batch,
    BatchStatus,
    File,
    Item,
    ItemState,
    OutputExpiry,
    Payload,
    Surface,
)
from batches.outcomes import Code
from batches.surfaces import common
from core.errors import clipped, quoted
from core.http import ascii_int

log = logging.getLogger(__name__)

# OpenAI's bounds for expires_after / output_expires_after: one hour to thirty days.
EXPIRES_MIN_SECONDS = 3600
EXPIRES_MAX_SECONDS = 30 * 24 * 3600
SWEEP_LIMIT = 500  # rows per kind per sweep: a backlog drains over several sweeps, each one short
# Item retention: items (with their attempts) removed per transaction, and per sweep at most. A 50,000-item
# batch is ten short transactions, not one that holds its rows locked and bloats the WAL; past the per-sweep
# bound the rest waits for the next sweep (its counts are frozen already, so nothing shows the difference).
PRUNE_SLICE = 5000
PRUNE_ITEMS_PER_SWEEP = 100_000


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
    from core.models import RevokedToken

    now = now or timezone.now()
    out = {"files": 0, "native_batches": 0}

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

    out |= prune_items(now)

    margin = timedelta(seconds=settings.RELAY_REVOKED_TOKEN_PRUNE_MARGIN_SECONDS)
    out["revoked_tokens"] = RevokedToken.objects.filter(expires_at__lt=now - margin).delete()[0]
    if any(out.values()):
        log.info("retention: removed %s", out)
    return out


# --- an ended OpenAI or Anthropic batch's items ---------------------------------------------------
#
# Why the batch stays: OpenAI's API has no batch delete, and Anthropic's results expire while the batch
# stays viewable ("after that, you may still view the Batch, but its results will no longer be available
# for download": `archived_at`); a client may GET a batch (or list it) long after it ended, and what it
# shows then is its status, its file ids or results_url and its request_counts: only the counts are read
# from the items. So the counts are frozen on the row first, and the items go after:
#
#   1. freeze (one transaction, holding the batch row FOR NO KEY UPDATE, as retry_failed does, so a retry
#      being made finishes first, or sees the frozen batch and refuses): `frozen_counts` = the items per
#      final state and the provider's counts, the terms request_counts is made of, and `frozen_at` = now
#      (an Anthropic batch's `archived_at`: its results download is refused from this commit on);
#   2. remove the items (and their attempts) PRUNE_SLICE at a time, each slice its own transaction; the one
#      that removes the last sets `items_pruned_at`, and the batch's stored bodies (inputs and results, the
#      `<batch>/` prefix of every store) are deleted once it commits. An OpenAI batch's output and error
#      files are File rows under `files/`: they stay, and expire with output_expires_after as before.
#
# Readers take the counts from `frozen_counts` as soon as step 1 commits, so a removal cut short (the
# per-sweep bound, a killed worker) shows nothing half-done; the next sweep resumes it. Usage events (the
# billing record) name their item only by request_id, with no foreign key: they stay, and so does the
# batch's `usage` total, which is summed from them. Each surface's own rules are one `ItemRetention`
# below; the steps are the same code for both.


@dataclass(frozen=True)
class ItemRetention:
    """Whose items retention removes, and when: a surface's ended batches, `setting` seconds (0 = kept)
    after they ended (`from_end`) or after they were created."""

    surface: str
    statuses: tuple  # the surface's statuses after which nothing changes
    setting: str
    from_end: bool
    key: str  # sweep()'s count of the batches whose removal ended

    def keep(self) -> int:
        return getattr(settings, self.setting)

    def due(self, cutoff):
        """The batches created before `cutoff` whose items are kept, oldest first, open ones included (the
        caller tells them apart): a range of the batch_items_kept index, which carries the status."""
        qs = Batch.objects.filter(surface=self.surface, frozen_counts__isnull=True, created_at__lt=cutoff)
        return qs.order_by("created_at")


ITEM_RETENTION = (
    # OpenAI: counted from the end; the output and error files, written before it, hold every result.
    ItemRetention(
        surface=Surface.OPENAI,
        statuses=PRUNABLE_STATUSES,
        setting="RELAY_OPENAI_ITEM_RETENTION_SECONDS",
        from_end=True,
        key="openai_batches_pruned",
    ),
    # Anthropic: counted from creation, as Anthropic's 29 days are; the results go with the items.
    ItemRetention(
        surface=Surface.ANTHROPIC,
        statuses=ANTHROPIC_PRUNABLE_STATUSES,
        setting="RELAY_ANTHROPIC_RESULTS_RETENTION_SECONDS",
        from_end=False,
        key="anthropic_batches_pruned",
    ),
)
_RULES = {rules.surface: rules for rules in ITEM_RETENTION}
assert set(ANTHROPIC_PRUNABLE_STATUSES) == set(states.ANTHROPIC_ENDED)


def prune_items(now) -> dict:
    """Steps 1 and 2 above for the ended batches past their surface's retention, removals begun by an
    earlier sweep first; at most PRUNE_ITEMS_PER_SWEEP items. {ItemRetention.key: batches whose removal
    ended, "items_pruned": items removed}"""
    out = dict.fromkeys([rules.key for rules in ITEM_RETENTION] + ["items_pruned"], 0)
    budget = PRUNE_ITEMS_PER_SWEEP
    # Resumed even if the setting has been turned off since: their counts are frozen, their items unread.
    begun = Batch.objects.filter(frozen_counts__isnull=False, items_pruned_at__isnull=True).order_by("id")
    todo = [(pk, surface, False) for pk, surface in begun.values_list("id", "surface")[:SWEEP_LIMIT]]
    for rules in ITEM_RETENTION:
        if rules.keep() > 0:
            todo += [(pk, rules.surface, True) for pk in _due(rules, now - timedelta(seconds=rules.keep()))]
    for batch_id, surface, fresh in todo:
        if budget <= 0:
            break
        if fresh and not _freeze(batch_id, _RULES[surface]):
            continue
        n, done = _remove_items(batch_id, budget)
        budget -= n
        out["items_pruned"] += n
        out[_RULES[surface].key] += done
    return out


def _due(rules: ItemRetention, cutoff) -> list:
    """The ended batches of `rules`' surface past `cutoff` (at most SWEEP_LIMIT). One still open that long
    after its creation (its window is 24 hours: the sweeper should have ended it) keeps its items, and is
    logged: nothing that may still change is counted."""
    due = rules.due(cutoff)
    if stuck := list(due.exclude(status__in=rules.statuses).values_list("id", flat=True)[:10]):
        log.warning(
            "retention: %s batches created before %s have not ended; their items are kept: %s",
            rules.surface,
            cutoff.isoformat(timespec="seconds"),
            ", ".join(Batch(id=pk, surface=rules.surface).public_id for pk in stuck),
        )
    ended = due.filter(status__in=rules.statuses)
    if rules.from_end:
        ended = ended.annotate(ended=Coalesce("completed_at", "cancelled_at", "failed_at", "expired_at"))
        ended = ended.filter(ended__lt=cutoff)
    return list(ended.values_list("id", flat=True)[:SWEEP_LIMIT])


def _freeze(batch_id, rules: ItemRetention) -> bool:
    """Step 1: the batch's counts onto its row. False if it is no longer one to prune (frozen meanwhile)."""
    with transaction.atomic():
        batch = (
            Batch.objects.select_for_update(no_key=True)
            .filter(pk=batch_id, surface=rules.surface, status__in=rules.statuses, frozen_counts__isnull=True)
            .first()
        )
        if batch is None:
            return False
        rows = list(
            Item.objects.filter(batch_id=batch_id)
            .values_list("state")
            .annotate(n=Count("pk"), expired=Count("pk", filter=Q(error_code=Code.BATCH_EXPIRED)))
            .order_by()
        )
        by_state = {state: n for state, n, _ in rows}
        if any(by_state.get(state) for state in PENDING_STATES):
            # An ended batch has none (its end waits for the last); never count a moving target.
            log.warning("retention: batch %s has ended but has pending items; its items are kept", batch_id)
            return False
        done, failed = common.provider_progress(batch)
        expired = sum(e for state, _, e in rows if state == ItemState.CANCELLED)
        frozen = by_state | {"cancelled_expired": expired, "provider_done": done, "provider_failed": failed}
        Batch.objects.filter(pk=batch_id).update(frozen_counts=frozen, frozen_at=timezone.now())
    return True


def _remove_items(batch_id, budget: int) -> tuple[int, bool]:
    """Step 2, up to `budget` items: (items removed, whether the last one is gone)."""
    pk = Batch._meta.pk.get_db_prep_value(batch_id, connection)  # the column's own form (uuid; hex on SQLite)
    quote = connection.ops.quote_name
    item, attempt = quote(Item._meta.db_table), quote(Attempt._meta.db_table)
    # The first slice of the batch's items by (batch, idx), the uniq_item_idx index. Raw SQL because the ORM's
    # delete() would load every item to cascade to its attempts; Item has no delete signal to miss.
    pick = f"SELECT id FROM {item} WHERE batch_id = %s ORDER BY idx LIMIT %s"  # noqa: S608 - table names only
    removed = 0
    while budget > 0:
        n = min(PRUNE_SLICE, budget)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(f"DELETE FROM {attempt} WHERE item_id IN ({pick})", [pk, n])  # noqa: S608
            cursor.execute(f"DELETE FROM {item} WHERE id IN ({pick})", [pk, n])  # noqa: S608
            gone = cursor.rowcount
            removed += gone
            budget -= gone
            if gone < n:  # that was the last of them
                Batch.objects.filter(pk=batch_id, items_pruned_at__isnull=True).update(items_pruned_at=timezone.now())
                transaction.on_commit(lambda: storage.delete_batch(str(batch_id)))
                return removed, True
    return removed, False


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
    # A batch whose items retention removed owns no payloads any more: whatever is left under its id (a
    # result a fenced-out worker appended after the removal) is an orphan like a deleted batch's.
    batch_ids = {str(b) for b in Batch.objects.filter(items_pruned_at__isnull=True).values_list("id", flat=True)}
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
