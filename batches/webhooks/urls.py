from django.urls import path

from batches.webhooks.api import views

# OpenAI's Webhook Endpoints API, at both prefixes of the OpenAI-compatible surface (as batches and files).
urlpatterns = []
for _prefix in ("", "openai/"):
    _name = _prefix.replace("/", "-")
    _one = f"{_prefix}v1/webhook_endpoints/<str:endpoint_id>"
    urlpatterns += [
        path(f"{_prefix}v1/webhook_endpoints", views.EndpointListView.as_view(), name=f"{_name}webhook-endpoints"),
        path(_one, views.EndpointDetailView.as_view(), name=f"{_name}webhook-endpoint"),
        path(f"{_one}/rotate_secret", views.RotateSecretView.as_view(), name=f"{_name}webhook-endpoint-rotate"),
        path(f"{_one}/test", views.TestView.as_view(), name=f"{_name}webhook-endpoint-test"),
        path(f"{_one}/deliveries", views.DeliveryListView.as_view(), name=f"{_name}webhook-deliveries"),
        path(f"{_one}/resume", views.ResumeView.as_view(), name=f"{_name}webhook-endpoint-resume"),
        path(
            f"{_one}/deliveries/<str:delivery_id>",
            views.DeliveryDetailView.as_view(),
            name=f"{_name}webhook-delivery",
        ),
        path(
            f"{_one}/deliveries/<str:delivery_id>/resend",
            views.ResendView.as_view(),
            name=f"{_name}webhook-delivery-resend",
        ),
        path(f"{_prefix}v1/webhook_event_types", views.EventTypesView.as_view(), name=f"{_name}webhook-event-types"),
    ]
