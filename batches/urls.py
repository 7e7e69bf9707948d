from django.urls import path

from batches.api import anthropic_views, views

# Both batch surfaces (decisions 0003 and 0005) share these routes (see batches/api/views.py), and the
# OpenAI-compatible ones are also served under /openai/, as the live routes are, so a client whose
# base_url is …/openai/v1 reaches files and batches too.
urlpatterns = []
for _prefix in ("", "openai/"):
    _name = _prefix.replace("/", "-")
    urlpatterns += [
        path(f"{_prefix}v1/batches", views.BatchListView.as_view(), name=f"{_name}batches"),
        path(f"{_prefix}v1/batches/<str:batch_id>", views.BatchDetailView.as_view(), name=f"{_name}batch-detail"),
        path(
            f"{_prefix}v1/batches/<str:batch_id>/results",
            views.BatchResultsView.as_view(),
            name=f"{_name}batch-results",
        ),
        path(
            f"{_prefix}v1/batches/<str:batch_id>/cancel", views.BatchCancelView.as_view(), name=f"{_name}batch-cancel"
        ),
        path(
            f"{_prefix}v1/batches/<str:batch_id>/retry_failed",
            views.BatchRetryFailedView.as_view(),
            name=f"{_name}batch-retry-failed",
        ),
        path(f"{_prefix}v1/files", views.FileListView.as_view(), name=f"{_name}files"),
        path(f"{_prefix}v1/files/<str:file_id>", views.FileDetailView.as_view(), name=f"{_name}file-detail"),
        path(f"{_prefix}v1/files/<str:file_id>/content", views.FileContentView.as_view(), name=f"{_name}file-content"),
    ]

# Anthropic's Message Batches (batches/api/anthropic_views.py), at both prefixes of /v1/messages.
for _prefix in ("", "anthropic/"):
    _name = _prefix.replace("/", "-")
    urlpatterns += [
        path(
            f"{_prefix}v1/messages/batches",
            anthropic_views.MessageBatchListView.as_view(),
            name=f"{_name}message-batches",
        ),
        path(
            f"{_prefix}v1/messages/batches/<str:batch_id>",
            anthropic_views.MessageBatchDetailView.as_view(),
            name=f"{_name}message-batch-detail",
        ),
        path(
            f"{_prefix}v1/messages/batches/<str:batch_id>/cancel",
            anthropic_views.MessageBatchCancelView.as_view(),
            name=f"{_name}message-batch-cancel",
        ),
        path(
            f"{_prefix}v1/messages/batches/<str:batch_id>/retry_failed",
            anthropic_views.MessageBatchRetryFailedView.as_view(),
            name=f"{_name}message-batch-retry-failed",
        ),
        path(
            f"{_prefix}v1/messages/batches/<str:batch_id>/results",
            anthropic_views.MessageBatchResultsView.as_view(),
            name=f"{_name}message-batch-results",
        ),
    ]
