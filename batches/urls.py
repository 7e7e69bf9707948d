from django.urls import path

from batches.api import views

urlpatterns = [
    path("v1/batches", views.BatchListView.as_view(), name="batches"),
    path("v1/batches/<str:batch_id>", views.BatchDetailView.as_view(), name="batch-detail"),
    path("v1/batches/<str:batch_id>/results", views.BatchResultsView.as_view(), name="batch-results"),
    path("v1/batches/<str:batch_id>/cancel", views.BatchCancelView.as_view(), name="batch-cancel"),
]
