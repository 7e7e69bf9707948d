"""Operator view of batches: progress, cancel, retry (the items and files pages: batches/admin_items.py).

OpenAI-surface batches show their own fields too: the batch_… id, endpoint,
input/output/error files (linked), metadata, validation errors, and each
item's custom_id; Anthropic-surface batches their msgbatch_… id, expiry and
cancel times. The `surface` column and filter say where each batch came from.
Files of the OpenAI surface have their own read-only pages. An ended OpenAI batch whose items retention
removed (batches/retention.py) shows the counts frozen on its row instead, and when they went. A batch
made by retry_failed links to the batch it re-runs, and that one to its retries; the "retry failed
records" action makes one through the same service as the API (batches/surfaces/retry.py).
"""

import json
import logging

from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from batches import admin_items  # noqa: F401 - registers the items' and files' pages
from batches.admin_display import file_link, pretty, progress_bar, related_links
from batches.lifecycle import stop
from batches.models import Batch, Item, ItemState, Surface
from batches.provider.admin import ProviderJobInline  # registers the provider jobs' admin too
from batches.surfaces import common, registry, retry
from core import auth
from core.admin_base import (
    SURFACE_NAMES,
    ChoicesFilter,
    NamedOwnersChangeList,
    ViewOnlyAdmin,
    owner_label,
    short_id,
)
from core.errors import RelayError

log = logging.getLogger(__name__)


class ItemInline(admin.TabularInline):
    model = Item
    fields = ("idx", "custom_id", "state", "attempt", "status_code", "error_code", "error", "started_at", "finished_at")
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


_BAR_STATES = (ItemState.COMPLETED, ItemState.DISCARDED, ItemState.CANCELLED, ItemState.RUNNING, ItemState.AVAILABLE)


class SurfaceFilter(ChoicesFilter):
    """By the products' names (OpenAI, Anthropic, native), not Django's title-cased values ("Openai")."""

    title = "surface"
    parameter_name = "surface"
    field = "surface"

    def options(self):
        return list(SURFACE_NAMES.items())


# The request shapes by the products' names: the field's own values read "openai" and "Openai responses".
SHAPE_NAMES = {"openai": "OpenAI Chat Completions", "openai_responses": "OpenAI Responses", "anthropic": "Anthropic"}


class ShapeFilter(ChoicesFilter):
    title = "inbound shape"
    parameter_name = "inbound_shape"
    field = "inbound_shape"

    def options(self):
        return list(SHAPE_NAMES.items())


class _BatchChangeList(NamedOwnersChangeList):
    """Counts items per state for the page's batches only, after paging: annotating the changelist's
    queryset grouped every item of every batch before the LIMIT (4 s at a million items, bench/scale.py).
    Owners are named from one set of look-ups for the page (core.admin_base.owner_labels)."""

    def get_results(self, request):
        super().get_results(request)
        counts = common.item_counts(self.result_list)
        for b in self.result_list:
            b.item_counts = counts.get(b.pk, {})


@admin.register(Batch)
class BatchAdmin(ViewOnlyAdmin):
    # The key columns only, so the list fits a 1280 px laptop beside its filters: the total is in the progress
    # label, the shape, endpoint and end time on the batch's page.
    list_display = ("list_id", "surface_name", "owner", "status", "progress", "created_at")
    list_filter = (SurfaceFilter, "status", ShapeFilter, "endpoint", "principal_kind", "created_at")
    search_fields = ("id", "owner_hash", "credential_id", "idempotency_key")
    date_hierarchy = "created_at"
    _openai_fields = (
        "shown_id",
        "endpoint",
        "completion_window",
        "model",
        "input_file",
        "output_file",
        "error_file",
        "metadata_view",
        "errors_view",
        "expires_at",
        "in_progress_at",
        "finalizing_at",
        "failed_at",
        "expired_at",
        "cancelling_at",
        "cancelled_at",
        "discount_percent",
        "idempotency_key",
        "items_pruned_at",
        "frozen_counts",
    )
    # completed_at is the message batch's ended_at; cancelling_at its cancel_initiated_at.
    _anthropic_fields = ("shown_id", "expires_at", "expired_at", "cancelling_at", "discount_percent")
    readonly_fields = [f.name for f in Batch._meta.fields] + [
        "progress",
        "items_link",
        "shown_id",
        "input_file",
        "output_file",
        "error_file",
        "metadata_view",
        "errors_view",
        "api_object",
        "retry_of_link",
        "retried_by_links",
        "owner",
        "surface_name",
        "related",
    ]
    inlines = [ItemInline, ProviderJobInline]
    actions = ["cancel_batches", "retry_failed_records"]

    def get_fieldsets(self, request, obj=None):
        common = (
            "id",
            "surface_name",
            "owner",
            "inbound_shape",
            "status",
            "progress",
            "items_link",
            "related",
            "total_items",
            "created_at",
            "completed_at",
            "cancel_requested_at",
        )
        owner = (
            "owner_hash",
            "policy_id",
            "project_id",
            "team_id",
            "principal_kind",
            "principal_id",
            "credential_kind",
            "credential_id",
            "principal",
        )
        retry = ("max_attempts", "retry_transient", "wait_for_capacity", "not_before")
        sets = [
            (None, {"fields": common}),
            ("Waiting and retrying", {"fields": retry}),
            ("Retries of failed records", {"fields": ("retry_of_link", "retried_by_links")}),
        ]
        if obj is not None and obj.surface == Surface.OPENAI:
            sets.append(("OpenAI-compatible batch", {"fields": self._openai_fields}))
        if obj is not None and obj.surface == Surface.ANTHROPIC:
            sets.append(("Anthropic-compatible batch (Message Batches)", {"fields": self._anthropic_fields}))
        sets.append(("Owner", {"fields": owner}))
        if obj is not None:
            sets.append(("As its API shows it", {"fields": ("api_object",), "classes": ("collapse",)}))
        return sets

    def get_search_results(self, request, queryset, search_term):
        # The id a client of any surface holds (UUID, batch_…, msgbatch_…) finds its batch.
        pk = registry.find_id(search_term)
        if pk is not None:
            return queryset.filter(pk=pk), False
        if search_term.strip().startswith(("batch_", "msgbatch_")):
            return queryset.none(), False
        return super().get_search_results(request, queryset, search_term)

    @admin.display(description="As its API shows it")
    def api_object(self, obj):
        return format_html("<pre>{}</pre>", json.dumps(registry.as_shown(obj), indent=2, default=str))

    def get_changelist(self, request, **kwargs):
        return _BatchChangeList

    @admin.display(description="owner")
    def owner(self, obj):
        return getattr(obj, "owner_label", None) or owner_label(obj)

    @admin.display(description="surface", ordering="surface")
    def surface_name(self, obj):
        return SURFACE_NAMES.get(obj.surface, obj.surface)

    @admin.display(description="elsewhere")
    def related(self, obj):
        return related_links(obj.pk)

    @admin.display(description="progress (completed / discarded / cancelled / running / available)")
    def progress(self, obj):
        if obj.frozen_counts is not None:
            # Retention removed (or is removing) its items: the counts they had, as its API shows them.
            counts = tuple(obj.frozen_counts.get(s, 0) for s in _BAR_STATES)
            return progress_bar(counts, " / ".join(str(n) for n in counts) + " (items removed by retention)")
        by_state = getattr(obj, "item_counts", None)
        if by_state is None:  # the change page: this batch's alone
            by_state = common.item_counts([obj]).get(obj.pk, {})
        counts = tuple(by_state.get(s, 0) for s in _BAR_STATES)
        return progress_bar(counts, " / ".join(str(n) for n in counts))

    @admin.display(description="id", ordering="id")
    def shown_id(self, obj):
        return obj.public_id

    @admin.display(description="id", ordering="id")
    def list_id(self, obj):
        return format_html('<span class="relay-id" title="{}">{}</span>', obj.public_id, short_id(obj.public_id))

    @admin.display(description="input file")
    def input_file(self, obj):
        return file_link(obj.input_file_id)

    @admin.display(description="output file")
    def output_file(self, obj):
        return file_link(obj.output_file_id)

    @admin.display(description="error file")
    def error_file(self, obj):
        return file_link(obj.error_file_id)

    @admin.display(description="metadata")
    def metadata_view(self, obj):
        return pretty(obj.metadata)

    @admin.display(description="validation errors")
    def errors_view(self, obj):
        return pretty(obj.errors)

    @admin.display(description="all items")
    def items_link(self, obj):
        if obj.frozen_counts is not None:
            when = obj.items_pruned_at.isoformat(timespec="seconds") if obj.items_pruned_at else "(in progress)"
            frozen = obj.frozen_at.isoformat(timespec="seconds") if obj.frozen_at else "?"
            if obj.surface == Surface.ANTHROPIC:
                return (
                    f"archived {frozen}, items removed {when} (RELAY_ANTHROPIC_RESULTS_RETENTION_SECONDS): its "
                    "results are no longer available"
                )
            return (
                f"counts frozen {frozen}, items removed {when} (RELAY_OPENAI_ITEM_RETENTION_SECONDS): the output "
                "and error files hold the results"
            )
        url = reverse("admin:batches_item_changelist")
        return format_html('<a href="{}?batch__id__exact={}">browse all {} items</a>', url, obj.pk, obj.total_items)

    @admin.display(description="retry of")
    def retry_of_link(self, obj):
        if obj.retry_of_id is None:
            return "—"
        return format_html(
            '<a href="{}">{}</a>', reverse("admin:batches_batch_change", args=[obj.retry_of_id]), obj.retry_of_public_id
        )

    @admin.display(description="retried by")
    def retried_by_links(self, obj):
        children = list(Batch.objects.filter(retry_of_id=obj.pk).order_by("id").only("id", "surface"))
        if not children:
            return "—"
        return format_html_join(
            ", ",
            '<a href="{}">{}</a>',
            ((reverse("admin:batches_batch_change", args=[c.pk]), c.public_id) for c in children),
        )

    @admin.action(description="Retry the failed and expired records (a new batch for each)", permissions=["operate"])
    def retry_failed_records(self, request, queryset):
        """The API's retry_failed on behalf of each batch's owner: its own credential, which must still work."""
        for parent in queryset:
            principal = parent.submitter()
            try:
                auth.recheck(principal)
            except RelayError as exc:
                self.message_user(
                    request,
                    f"Batch {parent.public_id}: not retried: its credential no longer works ({exc.message}); "
                    "its owner can retry it through the API with a valid one.",
                    level=messages.ERROR,
                )
                continue
            try:
                retried = retry.retry_failed(parent, principal)
            except RelayError as exc:
                self.message_user(
                    request, f"Batch {parent.public_id}: not retried: {exc.message}", level=messages.ERROR
                )
                continue
            child = retried.batch
            log.info("admin %s retried the failed records of %s as %s", request.user, parent.pk, child.pk)
            link = format_html(
                '<a href="{}">{}</a>', reverse("admin:batches_batch_change", args=[child.pk]), child.public_id
            )
            self.message_user(
                request,
                format_html("Batch {}: retried as {} ({} records).", parent.public_id, link, len(retried.parent_idx)),
            )

    @admin.action(description="Cancel the selected batches", permissions=["operate"])
    def cancel_batches(self, request, queryset):
        for batch in queryset:
            stop.cancel(batch)
        self.message_user(request, f"Cancelled {queryset.count()} batch(es).")
