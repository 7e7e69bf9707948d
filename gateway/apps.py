from django.apps import AppConfig


class GatewayConfig(AppConfig):
    """The gateway holds no models; it is an app so the layers are apps (tests/test_layers.py), and its ready()
    lends the host kinds the HTTP choke point."""

    name = "gateway"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        import time

        from core.hostkinds import base as kinds
        from gateway import upstream

        # A host kind's own calls (Vertex's token endpoint) leave through the one HTTP choke point too.
        kinds.use_transport(
            lambda url, headers, body, timeout: upstream.call(url, headers, body, deadline=time.monotonic() + timeout)
        )
