"""Usage events in the operator UI: browsable and searchable, never editable. Spend budgets: editable,
with their current period's account.

An event is a record of what happened (and what was charged); editing or
deleting one from the admin would falsify history, so the admin is read-only.
"""

import logging
import uuid

from django import forms
from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from core.admin_base import ChoicesFilter, LargeTableAdmin, NamedOwnersChangeList, owner_label, short_id, usd
from core.models import LLMModel, Project
from usage import budgets
from usage.models import Budget, UsageEvent

log = logging.getLogger(__name__)


class StatusClassFilter(admin.SimpleListFilter):
    title = "status"
    parameter_name = "status_class"

    def lookups(self, request, model_admin):
        return [("0", "0 (refused before any answer)"), ("2", "2xx"), ("4", "4xx"), ("5", "5xx")]

    def queryset(self, request, queryset):
        value = self.value()
        if value == "0":
            return queryset.filter(status=0)
        if value in ("2", "4", "5"):
            low = int(value) * 100
            return queryset.filter(status__gte=low, status__lt=low + 100)
        return queryset


class CatalogModelFilter(ChoicesFilter):
    title = "model"
    parameter_name = "model"
    field = "model"

    def options(self):
        return [(n, n) for n in LLMModel.objects.order_by("name").values_list("name", flat=True)]


class ProjectFilter(ChoicesFilter):
    title = "project"
    parameter_name = "project"
    field = "project"

    def options(self):
        return [(n, n) for n in Project.objects.order_by("name").values_list("name", flat=True)]


@admin.register(UsageEvent)
class UsageEventAdmin(LargeTableAdmin):
    # The key columns, to fit a 1280 px laptop beside the filters (the source is a filter; a batch record's
    # event links to its item and batch): the event's page has every field.
    list_display = (
        "when",
        "request",
        "status",
        "model",
        "owner",
        "total_tokens",
        "cost",
        "executed_by",
        "usage_estimated",
        "error",
        "batch_link",
    )
    # The table grows by one row per request: no filter reads its distinct values from the table, and
    # the page count is the planner's estimate past 10,000 rows (core.admin_base.LargeTableAdmin).
    list_filter = ("source", "executed_by", StatusClassFilter, CatalogModelFilter, ProjectFilter, "ts")
    search_fields = ("request_id", "model", "project", "error_kind")
    ordering = ("-ts", "-request_id")

    deletable = False

    def get_changelist(self, request, **kwargs):
        return NamedOwnersChangeList

    @admin.display(description="ts (UTC)", ordering="ts")
    def when(self, obj):
        return format_html('<span style="white-space:nowrap">{}</span>', obj.ts.strftime("%Y-%m-%d %H:%M"))

    @admin.display(description="error", ordering="error_kind")
    def error(self, obj):
        return format_html('<span class="relay-wrap">{}</span>', obj.error_kind) if obj.error_kind else "—"

    @admin.display(description="request", ordering="request_id")
    def request(self, obj):
        """A batch record's event links to its item (the item's id is the event's request_id)."""
        shown = format_html('<span class="relay-id" title="{}">{}</span>', obj.request_id, short_id(obj.request_id))
        if obj.source == "batch" and _uuid(obj.request_id):
            return format_html(
                '<a href="{}">{}</a>', reverse("admin:batches_item_change", args=[obj.request_id]), shown
            )
        return shown

    @admin.display(description="owner")
    def owner(self, obj):
        return getattr(obj, "owner_label", None) or owner_label(obj)

    @admin.display(description="cost (billed)", ordering="cost_nano_usd")
    def cost(self, obj):
        if obj.cost_nano_usd is None:
            return "unpriced"
        if obj.billed_cost_nano_usd is None or obj.billed_cost_nano_usd == obj.cost_nano_usd:
            return usd(obj.cost_nano_usd)
        return f"{usd(obj.cost_nano_usd)} ({usd(obj.billed_cost_nano_usd)})"

    @admin.display(description="batch")
    def batch_link(self, obj):
        if not _uuid(obj.batch_id):
            return obj.batch_id or "—"
        url = reverse("admin:batches_batch_change", args=[obj.batch_id])
        return format_html('<a class="relay-id" href="{}" title="{}">{}</a>', url, obj.batch_id, short_id(obj.batch_id))


def _uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except (TypeError, ValueError):
        return False
    return True


class BudgetForm(forms.ModelForm):
    """The limit is typed in USD ("100.00") and kept in nano-USD."""

    usd = forms.CharField(label="USD per period", help_text='An amount in USD, such as "100.00".')

    class Meta:
        model = Budget
        fields = ("name", "project", "team", "service_account", "policy", "usd", "period", "enabled")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:
            self.initial["usd"] = budgets.usd_text(self.instance.usd_nanos)

    def clean_usd(self):
        try:
            return budgets.parse_usd(self.cleaned_data["usd"])
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None

    def _post_clean(self):
        if "usd" in self.cleaned_data:
            self.instance.usd_nanos = self.cleaned_data["usd"]
        super()._post_clean()


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin):
    form = BudgetForm
    list_display = ("name", "scope_text", "period", "usd", "spent", "reserved", "left", "ends", "enabled")
    list_filter = ("period", "enabled")
    search_fields = ("name",)
    list_select_related = ("project", "team", "service_account__project", "policy")
    readonly_fields = ("created_at", "spent", "reserved", "left", "ends")

    def _standing(self, obj):
        # One account read per row (a short table); memoised on the row for its columns.
        if not hasattr(obj, "_standing"):
            obj._standing = budgets.standings([obj])[0] if obj.pk else None
        return obj._standing

    @admin.display(description="scope")
    def scope_text(self, obj):
        kind, _ = obj.scope
        return f"{kind.replace('_', ' ')} {budgets.scope_name(obj)}"

    @admin.display(description="USD")
    def usd(self, obj):
        return budgets.usd_text(obj.usd_nanos)

    @admin.display(description="spent (USD)")
    def spent(self, obj):
        s = self._standing(obj)
        return budgets.usd_text(s.spent_nanos) if s else "-"

    @admin.display(description="reserved (USD)")
    def reserved(self, obj):
        s = self._standing(obj)
        return budgets.usd_text(s.reserved_nanos) if s else "-"

    @admin.display(description="left (USD)")
    def left(self, obj):
        s = self._standing(obj)
        return budgets.usd_text(s.left_nanos) if s else "-"

    @admin.display(description="period ends (UTC)")
    def ends(self, obj):
        s = self._standing(obj)
        return s.period_ends_at.strftime("%Y-%m-%d %H:%M") if s else "-"
