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

        generation.on_bump(scrub.catalog_changed)
        catalog.connect_signals()
