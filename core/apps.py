from django.apps import AppConfig


class CoreConfig(AppConfig):
    # The label stays "relay": the tables (relay_host, ...), migrations and permissions keep their names from before
    # the app was split into layers.
    name = "core"
    label = "relay"
    verbose_name = "Relay"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from core import catalog, generation, scrub
        from core.hostkinds import base as kinds

        generation.on_bump(scrub.catalog_changed)
        kinds.on_secret(scrub.remember)  # tokens and keys a host kind makes itself are scrubbed too
        catalog.connect_signals()
