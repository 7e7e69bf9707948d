"""Usage API routes, mounted at /api/usage/ by relay.urls."""

from django.urls import path

from relay.reports.views import BudgetListView, EventListView, SummaryView

urlpatterns = [
    path("events", EventListView.as_view(), name="usage-events"),
    path("summary", SummaryView.as_view(), name="usage-summary"),
    path("budgets", BudgetListView.as_view(), name="usage-budgets"),
]
