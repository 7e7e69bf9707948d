"""Provider jobs in the operator UI: what each upstream job is, where it stands, with which host key (its
name, never its value). Read-only: a job moves only through batches/provider/jobs.py."""

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from batches.provider.models import ProviderJob
from relay.admin_base import ViewOnlyAdmin
from relay.models import HostKey

FIELDS = (
    "id",
    "batch_link",
    "kind",
    "endpoint",
    "status",
    "upstream_status",
    "upstream_id",
    "upstream_input_file_id",
    "host_key_name",
    "records",
    "bytes",
    "completed",
    "failed",
    "created_at",
    "submitted_at",
    "ended_at",
    "not_before",
    "polls",
    "create_attempts",
    "capacity_waits",
    "cancel_requested_at",
    "last_error",
)


class _JobDisplay:
    @admin.display(description="host key")
    def host_key_name(self, obj):
        if not obj.host_key_id:
            return "—"
        return HostKey.objects.filter(pk=obj.host_key_id).values_list("name", flat=True).first() or "(deleted)"

    @admin.display(description="batch")
    def batch_link(self, obj):
        url = reverse("admin:batches_batch_change", args=[obj.batch_id])
        return format_html('<a href="{}">{}</a>', url, obj.batch_id)


@admin.register(ProviderJob)
class ProviderJobAdmin(_JobDisplay, ViewOnlyAdmin):
    list_display = (
        "id",
        "batch_link",
        "kind",
        "status",
        "upstream_status",
        "upstream_id",
        "host_key_name",
        "records",
        "completed",
        "failed",
        "polls",
        "capacity_waits",
        "created_at",
    )
    list_filter = ("status", "kind")
    search_fields = ("id", "upstream_id", "batch__id")
    fields = FIELDS
    readonly_fields = FIELDS
    show_full_result_count = False


class ProviderJobInline(_JobDisplay, admin.TabularInline):
    """A batch's provider jobs, on its page."""

    model = ProviderJob
    fields = (
        "id",
        "kind",
        "status",
        "upstream_status",
        "upstream_id",
        "host_key_name",
        "records",
        "completed",
        "failed",
        "last_error",
    )
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False
