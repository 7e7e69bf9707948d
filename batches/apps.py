from django.apps import AppConfig


class BatchesConfig(AppConfig):
    name = "batches"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # Deleting a batch or a file removes its stored bytes (post_delete receivers).
        from batches import retention  # noqa: F401
