from django.apps import AppConfig


class RelayConfig(AppConfig):
    name = "relay"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from relay import catalog, generation, scrub

        generation.on_bump(scrub.catalog_changed)
        catalog.connect_signals()
