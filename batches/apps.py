from django.apps import AppConfig


class BatchesConfig(AppConfig):
    name = "batches"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from django.db.models.signals import post_migrate

        # Deleting a batch or a file removes its stored bytes (post_delete receivers).
        from batches import retention  # noqa: F401
        from batches.surfaces import installed
        from batches.worker import warmup

        # Every surface's object into the registry the lifecycle, sweeper and views look them up in.
        installed.install()

        # A batch worker warms up before it takes work (Celery's worker_init comes after this).
        warmup.connect()
        from django.test.signals import setting_changed

        from batches.worker import bookkeeper

        setting_changed.connect(bookkeeper.rescheduled, dispatch_uid="batches.worker.bookkeeper.rescheduled")

        post_migrate.connect(_sync_error_codes, sender=self)


def _sync_error_codes(sender, using, **kwargs):
    """After every `migrate`: the error-code domain's check lists batches.outcomes.Code (batches/domains.py)."""
    from django.db import connections

    from batches import domains

    domains.sync(connections[using])
