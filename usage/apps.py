from django.apps import AppConfig


class UsageConfig(AppConfig):
    name = "usage"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # Budgets are cached with the catalog snapshot (usage.budgets): their saves and deletes bump the
        # catalog generation like a catalog model's (bulk writes bump through their CatalogQuerySet).
        from django.db.models.signals import post_delete, post_save

        from usage.models import Budget

        post_save.connect(_bump, sender=Budget, dispatch_uid="budget-save")
        post_delete.connect(_bump, sender=Budget, dispatch_uid="budget-delete")


def _bump(sender, **kwargs):
    from core import catalog

    catalog.bump()
