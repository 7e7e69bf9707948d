"""Provider jobs in the operator UI: what each upstream job is, where it stands, with which host key (its
name, never its value). Read-only: a job moves only through batches/provider/jobs.py."""

from django.contrib import admin
from django.db.models import OuterRef, Subquery
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from batches.provider.models import ProviderJob
from core.admin_base import ChoicesFilter, ViewOnlyAdmin, short_id
from core.models import HostKey
from gateway import batch_apis


class KindFilter(ChoicesFilter):
    """The batch API by its product's name (OpenAI, Azure OpenAI Global Batch, …), not the stored value: every
    registered one (gateway.batch_apis.REGISTRY)."""

    title = "batch API"
    parameter_name = "kind"
    field = "kind"

    def options(self):
        return [(kind, api.label) for kind, api in batch_apis.REGISTRY.items()]


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
    "related",
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
    def get_queryset(self, request):
        # The host key's name in the rows' own query, not one look-up per row.
        name = HostKey.objects.filter(pk=OuterRef("host_key_id")).values("name")[:1]
        return super().get_queryset(request).annotate(host_key_label=Subquery(name))

    @admin.display(description="host key")
    def host_key_name(self, obj):
        if not obj.host_key_id:
            return "—"
        return getattr(obj, "host_key_label", None) or "(deleted)"

    @admin.display(description="batch")
    def batch_link(self, obj):
        url = reverse("admin:batches_batch_change", args=[obj.batch_id])
        return format_html('<a class="relay-id" href="{}" title="{}">{}</a>', url, obj.batch_id, short_id(obj.batch_id))

    @admin.display(description="batch API", ordering="kind")
    def kind_name(self, obj):
        api = batch_apis.REGISTRY.get(obj.kind)
        return api.label if api is not None else obj.kind

    @admin.display(description="elsewhere")
    def related(self, obj):
        """The job's records in the items list, and their usage events (their batch's)."""
        links = (
            (reverse("admin:batches_item_changelist"), f"provider_job__id__exact={obj.pk}", "records"),
            (reverse("admin:usage_usageevent_changelist"), f"batch_id={obj.batch_id}&executed_by__exact=provider",
             "usage events"),
        )  # fmt: skip
        return format_html_join(" · ", '<a href="{}?{}">{}</a>', links)


@admin.register(ProviderJob)
class ProviderJobAdmin(_JobDisplay, ViewOnlyAdmin):
    list_display = (
        "job",
        "batch_link",
        "kind_name",
        "status",
        "upstream_status",
        "host_key_name",
        "records",
        "completed",
        "failed",
        "related",
        "created_at",
    )
    list_filter = ("status", KindFilter)
    search_fields = ("id", "upstream_id", "batch__id")
    fields = FIELDS
    readonly_fields = FIELDS
    show_full_result_count = False

    @admin.display(description="id", ordering="id")
    def job(self, obj):
        return format_html('<span class="relay-id" title="{}">{}</span>', obj.pk, short_id(obj.pk))


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
