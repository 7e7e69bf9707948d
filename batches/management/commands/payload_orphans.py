"""`manage.py payload_orphans [--clean]`: stored payloads no batch or file row points at."""

from django.core.management.base import BaseCommand

from batches import retention


class Command(BaseCommand):
    help = (
        "Report batch payloads and file bytes in the payload store (directory, database or bucket) that no row "
        "points at, and file rows whose bytes are gone. --clean removes the orphans (never a row). Entries younger "
        "than RELAY_ORPHAN_GRACE_SECONDS are left alone: they may belong to an upload or a submit in flight."
    )

    def add_arguments(self, parser):
        parser.add_argument("--clean", action="store_true", help="delete the orphaned payloads")

    def handle(self, *args, clean=False, **options):
        found = retention.find_orphans()
        for path in found.paths:
            self.stdout.write(f"orphan  {path}")
        for key in found.keys:
            self.stdout.write(f"orphan  db:{key}")
        for ref in found.objects:
            self.stdout.write(f"orphan  {ref}")
        for rel, upload_id in found.uploads:
            self.stdout.write(f"orphan  s3:{rel} (multipart upload {upload_id})")
        for file_id in found.missing_files:
            self.stdout.write(f"missing {file_id} (its row remains; its bytes are gone)")
        self.stdout.write(
            f"{found.count} orphaned payload(s), {found.bytes} bytes on disk; "
            f"{len(found.missing_files)} file row(s) without bytes"
        )
        if clean and found.count:
            retention.clean_orphans(found)
            self.stdout.write(f"removed {found.count} orphaned payload(s)")
