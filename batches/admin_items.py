"""Operator view of batch items (with their attempts and where each ran) and of the OpenAI surface's files.
Registered when batches/admin.py is imported (it imports this module last)."""

import contextlib
import logging

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from batches import storage
from batches.admin_display import PREVIEW_BYTES, preview, search_public_id
from batches.models import Attempt, File, Item, ItemState
from batches.provider import placement
from core.admin_base import (
    ChoicesFilter,
    LargeTableAdmin,
    NamedOwnersChangeList,
    ViewOnlyAdmin,
    owner_label,
    short_id,
)

log = logging.getLogger(__name__)


class AttemptInline(admin.TabularInline):
    """The item's attempt history: every try that reached a provider, and how it ended."""

    model = Attempt
    fields = (
        "number",
        "started_at",
        "duration_ms",
        "decision",
        "outcome",
        "status_code",
        "host_key_id",
        "error",
        "upstream_error_body",
    )
    readonly_fields = fields
    extra = 0
    max_num = 0
    can_delete = False
    ordering = ("number",)

    @admin.display(description="upstream error body")
    def upstream_error_body(self, obj):
        return format_html("<pre style='white-space:pre-wrap'>{}</pre>", obj.error_body) if obj.error_body else ""

    def has_add_permission(self, request, obj=None):
        return False


class PlacementFilter(ChoicesFilter):
    """Why a record meant for the provider ran in the relay (batches/provider/placement.py)."""

    title = "placement"
    parameter_name = "placement"
    field = "placement"

    def options(self):
        return [(n, n) for n in placement.NOTES]


@admin.register(Item)
class ItemAdmin(LargeTableAdmin):
    inlines = [AttemptInline]
    list_display = (
        "item",
        "batch_link",
        "custom",
        "state",
        "attempt",
        "status_code",
        "error_head",
        "finished_at",
        "job_link",
        "usage_link",
    )
    list_filter = ("state", PlacementFilter)
    search_fields = ("id", "batch__id", "custom_id", "error")
    list_select_related = ("batch",)
    fields = (
        "id",
        "batch",
        "idx",
        "custom_id",
        "state",
        "attempt",
        "retries",
        "max_attempts",
        "not_before",
        "lease_owner",
        "lease_expires_at",
        "started_at",
        "finished_at",
        "status_code",
        "error_code",
        "error",
        "provider_job",
        "placement",
        "usage_link",
        "request",
        "response",
        "upstream_error_body",
    )
    readonly_fields = fields

    @admin.display(description="item", ordering="idx")
    def item(self, obj):
        return f"#{obj.idx}"

    @admin.display(description="batch")
    def batch_link(self, obj):
        public = obj.batch.public_id
        return format_html(
            '<a class="relay-id" href="{}" title="{}">{}</a>',
            reverse("admin:batches_batch_change", args=[obj.batch_id]),
            public,
            short_id(public),
        )

    @admin.display(description="error")
    def error_head(self, obj):
        text = obj.error or ""
        if len(text) <= 80:
            return format_html('<span class="relay-wrap">{}</span>', text)
        return format_html('<span class="relay-wrap" title="{}">{}…</span>', text, text[:80])

    @admin.display(description="custom id", ordering="custom_id")
    def custom(self, obj):
        return format_html('<span class="relay-wrap">{}</span>', obj.custom_id) if obj.custom_id else "—"

    @admin.display(description="provider job")
    def job_link(self, obj):
        if obj.provider_job_id is None:
            return "—"
        return format_html(
            '<a class="relay-id" href="{}">{}</a>',
            reverse("admin:batches_providerjob_change", args=[obj.provider_job_id]),
            short_id(obj.provider_job_id),
        )

    @admin.display(description="usage event")
    def usage_link(self, obj):
        # An item's usage event carries its id as request_id (written by the transaction that finishes it).
        if obj.state not in (ItemState.COMPLETED, ItemState.DISCARDED):
            return "—"
        return format_html('<a href="{}?request_id={}">usage</a>', reverse("admin:usage_usageevent_changelist"), obj.pk)

    @admin.display(description="request")
    def request(self, obj):
        return preview(obj.input_ref)

    @admin.display(description="response")
    def response(self, obj):
        return preview(obj.result_ref)

    @admin.display(description="upstream error body")
    def upstream_error_body(self, obj):
        return format_html("<pre style='white-space:pre-wrap'>{}</pre>", obj.error_body) if obj.error_body else ""


@admin.register(File)
class FileAdmin(ViewOnlyAdmin):
    """Files of the OpenAI surface: uploads (purpose batch) and the output/error files batches write."""

    list_display = ("list_id", "purpose", "file_name", "bytes", "owner", "batch_link", "created_at")
    list_filter = ("purpose", "created_at")
    search_fields = ("id", "filename", "owner_hash", "credential_id")
    date_hierarchy = "created_at"
    show_full_result_count = False
    fields = (
        "shown_id",
        "purpose",
        "filename",
        "bytes",
        "created_at",
        "batch_link",
        "owner_hash",
        "credential_kind",
        "credential_id",
        "principal_kind",
        "principal_id",
        "project_id",
        "ref",
        "content",
    )
    readonly_fields = fields

    # Deleting here removes the stored bytes too (batches/retention.py), as DELETE /v1/files/{id} does.

    def get_search_results(self, request, queryset, search_term):
        found = search_public_id(queryset, search_term, "file-")
        if found is not None:
            return found, False
        return super().get_search_results(request, queryset, search_term)

    @admin.display(description="id", ordering="id")
    def shown_id(self, obj):
        return obj.public_id

    @admin.display(description="id", ordering="id")
    def list_id(self, obj):
        return format_html('<span class="relay-id" title="{}">{}</span>', obj.public_id, short_id(obj.public_id))

    @admin.display(description="owner")
    def owner(self, obj):
        return getattr(obj, "owner_label", None) or owner_label(obj)

    def get_changelist(self, request, **kwargs):
        return NamedOwnersChangeList

    @admin.display(description="filename", ordering="filename")
    def file_name(self, obj):
        return format_html('<span class="relay-wrap">{}</span>', obj.filename)

    @admin.display(description="batch")
    def batch_link(self, obj):
        if obj.batch_id is None:
            return "—"
        return format_html(
            '<a class="relay-id" href="{}" title="batch_{}">batch_{}…</a>',
            reverse("admin:batches_batch_change", args=[obj.batch_id]),
            obj.batch_id.hex,
            obj.batch_id.hex[:8],
        )

    @admin.display(description="content (first 4 KiB)")
    def content(self, obj):
        try:
            with contextlib.closing(storage.iter_file(obj.ref, chunk_size=PREVIEW_BYTES)) as chunks:
                head = next(chunks, b"")[:PREVIEW_BYTES]
        except storage.PayloadMissing as exc:
            return f"(missing: {exc})"
        text = head.decode("utf-8", errors="replace")
        if obj.bytes > len(head):
            text += f"\n… ({obj.bytes} bytes in all)"
        return format_html("<pre style='white-space:pre-wrap;max-width:80em'>{}</pre>", text)
