"""Usage events in the operator UI: browsable and searchable, never editable.

An event is a record of what happened (and what was charged); editing or
deleting one from the admin would falsify history, so the admin is read-only.
"""

from django.contrib import admin

from relay.admin_base import ViewOnlyAdmin
from usage.models import UsageEvent


@admin.register(UsageEvent)
class UsageEventAdmin(ViewOnlyAdmin):
    list_display = (
        "ts",
        "request_id",
        "source",
        "status",
        "model",
        "host",
        "project",
        "team",
        "total_tokens",
        "cost_nano_usd",
        "billed_cost_nano_usd",
        "executed_by",
        "duration_ms",
        "error_kind",
        "batch_id",
    )
    list_filter = ("source", "executed_by", "status", "model", "project", "error_kind")
    search_fields = ("request_id", "model", "project")
    date_hierarchy = "ts"
    ordering = ("-ts", "-request_id")
    # The table grows by one row per request: skip the unfiltered COUNT(*) on every page.
    show_full_result_count = False

    deletable = False
