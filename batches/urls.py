from django.urls import path

from batches.api import anthropic_views, views

urlpatterns = [
    # Both batch surfaces (decisions 0003 and 0005) share these routes; see batches/api/views.py.
    path("v1/batches", views.BatchListView.as_view(), name="batches"),
    path("v1/batches/<str:batch_id>", views.BatchDetailView.as_view(), name="batch-detail"),
    path("v1/batches/<str:batch_id>/results", views.BatchResultsView.as_view(), name="batch-results"),
    path("v1/batches/<str:batch_id>/cancel", views.BatchCancelView.as_view(), name="batch-cancel"),
    # Files of the OpenAI-compatible surface.
    path("v1/files", views.FileListView.as_view(), name="files"),
    path("v1/files/<str:file_id>", views.FileDetailView.as_view(), name="file-detail"),
    path("v1/files/<str:file_id>/content", views.FileContentView.as_view(), name="file-content"),
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
            f"{_prefix}v1/messages/batches/<str:batch_id>/results",
            anthropic_views.MessageBatchResultsView.as_view(),
            name=f"{_name}message-batch-results",
        ),
    ]
