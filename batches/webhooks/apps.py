from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "batches.webhooks"
    label = "webhooks"
    verbose_name = "Webhooks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from batches.lifecycle import states
        from batches.webhooks import outbox

        # The event rows of a batch's end commit with its final move, or not at all (the outbox).
        states.on_end(outbox.record_batch_end)
