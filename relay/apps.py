from django.apps import AppConfig


class ShellConfig(AppConfig):
    """The project shell: settings, URLs, the Celery app, the processes, the operator's pages and commands. It holds
    no models; it is an app for its templates, template tags and the `relay` management command."""

    name = "relay"
    label = "relay_shell"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # Bind `shared_task` to the relay's Celery app in every process that loads Django (web, commands, tests),
        # not only in those started with `celery -A relay`.
        import relay.celery  # noqa: F401
