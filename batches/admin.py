"""Operator view of batches: progress, items with their request/response, cancel."""

import json

from django.contrib import admin
from django.db.models import Count, Q
from django.utils.html import format_html

from batches import services, storage
from batches.models import Batch, Item, ItemState

_PREVIEW_BYTES = 4096


def _preview(ref: str) -> str:
    if not ref:
        return ""
    try:
        data = storage.read(ref)
    except storage.PayloadMissing as exc:
        return f"(missing: {exc})"
    text = data[:_PREVIEW_BYTES].decode("utf-8", errors="replace")
    if len(data) <= _PREVIEW_BYTES:
        try:
            text = json.dumps(json.loads(data), indent=2, ensure_ascii=False)
        except ValueError:
            pass
    else:
        text += f"\n… ({len(data)} bytes in all)"
    return format_html("<pre style='white-space:pre-wrap;max-width:80em'>{}</pre>", text)


class ItemInline(admin.TabularInline):
    model = Item
    fields = ("idx", "state", "attempt", "status_code", "error", "started_at", "finished_at")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True
    ordering = ("idx",)
    max_num = 0
    # A batch can hold 50,000 items: the inline shows the first ones; the
    # items list (linked from the batch page) pages through all of them.
    per_page = 50

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        ids = list(qs.order_by("idx").values_list("id", flat=True)[: self.per_page])
        return qs.filter(id__in=ids)

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    list_display = ("id", "owner", "inbound_shape", "status", "progress", "total_items", "created_at", "completed_at")
    list_filter = ("status", "inbound_shape", "principal_kind", "created_at")
    search_fields = ("id", "owner_hash", "credential_id")
    date_hierarchy = "created_at"
    readonly_fields = [f.name for f in Batch._meta.fields] + ["progress", "items_link"]
    inlines = [ItemInline]
    actions = ["cancel_batches"]

    def get_queryset(self, request):
        return (
            super()
            .get_queryset(request)
            .annotate(
                n_completed=Count("items", filter=Q(items__state=ItemState.COMPLETED)),
                n_discarded=Count("items", filter=Q(items__state=ItemState.DISCARDED)),
                n_cancelled=Count("items", filter=Q(items__state=ItemState.CANCELLED)),
                n_running=Count("items", filter=Q(items__state=ItemState.RUNNING)),
                n_available=Count("items", filter=Q(items__state=ItemState.AVAILABLE)),
            )
        )

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    @admin.display(description="owner")
    def owner(self, obj):
        return f"{obj.principal_kind}:{obj.principal_id} via {obj.credential_kind} {obj.credential_id}"

    @admin.display(description="progress (completed / discarded / cancelled / running / available)")
    def progress(self, obj):
        return f"{obj.n_completed} / {obj.n_discarded} / {obj.n_cancelled} / {obj.n_running} / {obj.n_available}"

    @admin.display(description="all items")
    def items_link(self, obj):
        return format_html('<a href="../../item/?batch__id__exact={}">browse all {} items</a>', obj.pk, obj.total_items)

    @admin.action(description="Cancel the selected batches")
    def cancel_batches(self, request, queryset):
        for batch in queryset:
            services.cancel(batch)
        self.message_user(request, f"Cancelled {queryset.count()} batch(es).")


@admin.register(Item)
class ItemAdmin(admin.ModelAdmin):
    list_display = ("batch", "idx", "state", "attempt", "status_code", "error", "finished_at")
    list_filter = ("state",)
    search_fields = ("id", "batch__id", "error")
    list_select_related = ("batch",)
    show_full_result_count = False
    fields = (
        "id",
        "batch",
        "idx",
        "state",
        "attempt",
        "max_attempts",
        "lease_owner",
        "lease_expires_at",
        "started_at",
        "finished_at",
        "status_code",
        "error",
        "request",
        "response",
        "upstream_error_body",
    )
    readonly_fields = fields

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    @admin.display(description="request")
    def request(self, obj):
        return _preview(obj.input_ref)

    @admin.display(description="response")
    def response(self, obj):
        return _preview(obj.result_ref)

    @admin.display(description="upstream error body")
    def upstream_error_body(self, obj):
        return format_html("<pre style='white-space:pre-wrap'>{}</pre>", obj.error_body) if obj.error_body else ""
