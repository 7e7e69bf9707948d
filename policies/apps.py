from django.apps import AppConfig


class PoliciesConfig(AppConfig):
    name = "policies"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from core import catalog
        from policies.models import Policy

        catalog.connect_m2m(Policy.host_keys.through)  # a key added to or dropped from a pool is a catalog change
