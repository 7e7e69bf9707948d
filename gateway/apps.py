from django.apps import AppConfig


class GatewayConfig(AppConfig):
    """The gateway holds no models; it is an app so the layers are apps (tests/test_layers.py)."""

    name = "gateway"
    default_auto_field = "django.db.models.BigAutoField"
