from django.contrib import admin
from django.urls import include, path

from gateway.inference import inference_urls
from gateway.views import ModelsView
from relay import openapi
from relay.metrics import metrics_view
from relay.operator import health_page, landing
from relay.views import HealthView

admin.site.site_header = "Relay batch — operator"
admin.site.site_title = "Relay batch"
admin.site.index_template = "admin/relay_index.html"  # links the health page and the API docs

urlpatterns = [
    # First: the live routes are the hottest, and Django tries patterns in order (none of the others
    # matches these exact paths).
    *inference_urls(),
    path("", landing, name="landing"),
    path("healthz", HealthView.as_view(), name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    path("v1/models", ModelsView.as_view(), name="models"),
    path("openai/v1/models", ModelsView.as_view(), name="openai-models"),
    path("admin/health/", admin.site.admin_view(health_page), name="admin-health"),
    path("admin/", admin.site.urls),
    path("api/usage/", include("relay.reports.urls")),
    *openapi.urls(),
    path("", include("batches.urls")),
    path("", include("batches.webhooks.urls")),
]

# Errors of API paths in the product's JSON envelope; the admin keeps Django's pages (gateway.edge).
handler400 = "gateway.edge.bad_request"
handler403 = "gateway.edge.permission_denied"
handler404 = "gateway.edge.page_not_found"
handler500 = "gateway.edge.server_error"
