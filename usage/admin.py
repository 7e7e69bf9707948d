"""Usage events in the operator UI: browsable and searchable, never editable. Spend budgets: editable,
with their current period's account.

An event is a record of what happened (and what was charged); editing or
deleting one from the admin would falsify history, so the admin is read-only.
"""

import logging

from django import forms
from django.contrib import admin

from relay.admin_base import ChoicesFilter, LargeTableAdmin
from relay.models import LLMModel, Project
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
    # The table grows by one row per request: no filter reads its distinct values from the table, and
    # the page count is the planner's estimate past 10,000 rows (relay.admin_base.LargeTableAdmin).
    list_filter = ("source", "executed_by", StatusClassFilter, CatalogModelFilter, ProjectFilter, "ts")
    search_fields = ("request_id", "model", "project", "error_kind")
    ordering = ("-ts", "-request_id")

    deletable = False


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
