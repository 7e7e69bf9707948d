"""`manage.py scrub_secrets [--dry-run]`: redact secrets from what an older relay stored."""

from django.core.management.base import BaseCommand

from batches import redaction


class Command(BaseCommand):
    help = (
        "Redact host keys (and the relay's own secrets) in every encoding from stored OpenAI output and error "
        "files, item and attempt errors and error bodies, and usage events' error messages. --dry-run only counts."
    )

    def add_arguments(self, parser):
        parser.add_argument("--dry-run", action="store_true", help="count what would change, change nothing")

    def handle(self, *args, dry_run=False, **options):
        report = redaction.scrub_stored(dry_run=dry_run)
        verb = "would redact" if dry_run else "redacted"
        for file_id in report.files:
            self.stdout.write(f"{verb} {file_id}")
        rows = ", ".join(f"{n} {name} row(s)" for name, n in report.rows.items())
        self.stdout.write(f"{verb}: {len(report.files)} file(s), {rows}")
