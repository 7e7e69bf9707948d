"""Cleaning what was stored before redaction covered every encoding (`manage.py scrub_secrets`).

Bodies are redacted as they leave the pipeline (core.scrub); rows and files written by an older
relay may still hold a provider key in an encoded form. This walks every place a provider's words
are kept — the OpenAI output and error files, the items' and attempts' error text and bodies, the
usage events' error messages — and rewrites each one whose redacted form differs.
"""

import logging
from dataclasses import dataclass, field

import uuid6
from django.db import transaction

from batches import storage
from batches.models import Attempt, File, FilePurpose, Item
from core import scrub
from usage.models import UsageEvent

log = logging.getLogger(__name__)

# Output lines are bounded by what the relay writes (a result of at most the response limit).
_MAX_LINE = 64 * 1024 * 1024
_BATCH_ROWS = 500


@dataclass
class Report:
    files: list[str] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return len(self.files) + sum(self.rows.values())


def scrub_stored(*, dry_run: bool = False) -> Report:
    report = Report()
    scrub.forget_all()  # the catalog's host keys as they are now
    for file in File.objects.filter(purpose=FilePurpose.BATCH_OUTPUT).only("id", "ref", "bytes").iterator():
        if _scrub_file(file, dry_run):
            report.files.append(file.public_id)
    kept = ((Item, ("error", "error_body")), (Attempt, ("error", "error_body")), (UsageEvent, ("error_message",)))
    for model, fields in kept:
        report.rows[model.__name__] = _scrub_rows(model, fields, dry_run)
    return report


def _scrub_file(file: File, dry_run: bool) -> bool:
    try:
        dirty = any(scrub.scrub_bytes(line) != line for _, line in storage.iter_lines(file.ref, _MAX_LINE))
    except storage.PayloadMissing:
        return False
    if not dirty or dry_run:
        return dirty
    # Written beside the old bytes under a new name, then the row points at it: a crash in between
    # leaves the old file whole (and the new one an orphan `payload_orphans --clean` removes).
    writer = storage.file_writer(uuid6.uuid7().hex)
    try:
        for _, line in storage.iter_lines(file.ref, _MAX_LINE):
            writer.write(scrub.scrub_bytes(line) + b"\n")
        ref = writer.close()
    except BaseException:
        writer.discard()
        raise
    old = file.ref
    with transaction.atomic():
        File.objects.filter(pk=file.pk, ref=old).update(ref=ref, bytes=writer.size)
    storage.delete_file(old)
    log.info("redacted a secret from %s", file.public_id)
    return True


def _scrub_rows(model, fields: tuple[str, ...], dry_run: bool) -> int:
    changed = 0
    limits = {f: model._meta.get_field(f).max_length for f in fields}
    rows = model.objects.exclude(**{f: "" for f in fields}).values_list("pk", *fields)
    pending = []
    for pk, *values in rows.iterator(chunk_size=_BATCH_ROWS):
        # A redacted value may be longer than the key it replaced: cut to the column's width.
        clean = [scrub.scrub_text(v)[: limits[f]] for f, v in zip(fields, values, strict=True)]
        if clean != values:
            changed += 1
            pending.append((pk, dict(zip(fields, clean, strict=True))))
        if len(pending) >= _BATCH_ROWS and not dry_run:
            _update(model, pending)
            pending = []
    if pending and not dry_run:
        _update(model, pending)
    return changed


def _update(model, pending) -> None:
    with transaction.atomic():
        for pk, values in pending:
            model.objects.filter(pk=pk).update(**values)
