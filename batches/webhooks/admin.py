"""The operator's view of webhooks: endpoints (paused ones say so, with pause and resume actions) and
deliveries (their event, webhook-id, every attempt, and a re-send action). Secrets are never shown: only
their hints. Endpoints are a tenant's own (the API creates them); the admin does not add or edit them."""

import json

from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html

from batches.webhooks import services
from batches.webhooks.models import Delivery, DeliveryAttempt, WebhookEndpoint
from core.admin_base import ViewOnlyAdmin, short_id


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(ViewOnlyAdmin):
    list_display = ("name", "list_id", "target", "types", "health", "created_at")
    list_filter = ("paused_at", "created_at")
    search_fields = ("id", "name", "url", "owner_hash")
    fields = (
        "shown_id",
        "name",
        "url",
        "event_types",
        "owner_hash",
        "project_id",
        "team_id",
        "secret_hint",
        "previous_secret_expires_at",
        "health",
        "failing_since",
        "last_failure_at",
        "paused_at",
        "created_at",
        "updated_at",
    )
    readonly_fields = fields
    actions = ("resume", "pause")

    @admin.display(description="id")
    def shown_id(self, obj):
        return obj.public_id

    @admin.display(description="id")
    def list_id(self, obj):
        return format_html('<span class="relay-id" title="{}">{}</span>', obj.public_id, short_id(obj.public_id))

    @admin.display(description="url", ordering="url")
    def target(self, obj):
        return format_html('<span class="relay-wrap">{}</span>', obj.url)

    @admin.display(description="event types")
    def types(self, obj):
        return ", ".join(obj.event_types)

    @admin.display(description="deliveries")
    def health(self, obj):
        if obj.paused_at is not None:
            return format_html(
                "<strong style='color:#ba2121'>Paused since {}</strong>: every delivery failed; its pending "
                "events are kept and sent once it is resumed (action “Resume deliveries”).",
                obj.paused_at.strftime("%Y-%m-%d %H:%M UTC"),
            )
        if obj.failing_since is not None:
            return format_html("Failing since {}", obj.failing_since.strftime("%Y-%m-%d %H:%M UTC"))
        return "Active"

    @admin.action(description="Resume deliveries (send what was kept)", permissions=["operate"])
    def resume(self, request, queryset):
        sent = sum(services.resume(endpoint) for endpoint in queryset)
        self.message_user(request, f"Resumed {queryset.count()} endpoint(s); {sent} waiting deliveries sent.")

    @admin.action(description="Pause deliveries", permissions=["operate"])
    def pause(self, request, queryset):
        for endpoint in queryset:
            services.pause(endpoint)
        self.message_user(request, f"Paused {queryset.count()} endpoint(s).", messages.WARNING)


class AttemptInline(admin.TabularInline):
    """Every POST of the delivery: when, the receiver's status, how long, the first KiB of its answer."""

    model = DeliveryAttempt
    fields = ("number", "started_at", "duration_ms", "status_code", "delivered", "error", "response_head")
    readonly_fields = fields
    extra = 0
    max_num = 0
    can_delete = False
    ordering = ("-number",)

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Delivery)
class DeliveryAdmin(ViewOnlyAdmin):
    inlines = [AttemptInline]
    list_display = (
        "list_id",
        "event_type",
        "endpoint",
        "batch",
        "outcome",
        "attempts",
        "last_status_code",
        "created_at",
    )
    list_filter = ("outcome", "event__type", "created_at")
    search_fields = ("id", "endpoint__name", "event__batch_id")
    list_select_related = ("event", "endpoint")
    show_full_result_count = False
    fields = (
        "webhook_id",
        "endpoint",
        "event_type",
        "batch",
        "outcome",
        "attempts",
        "next_attempt_at",
        "schedule_from",
        "last_attempt_at",
        "delivered_at",
        "last_status_code",
        "last_error",
        "body",
    )
    readonly_fields = fields
    actions = ("resend",)

    @admin.display(description="webhook-id", ordering="id")
    def list_id(self, obj):
        return format_html('<span class="relay-id" title="{}">{}</span>', obj.webhook_id, short_id(obj.webhook_id))

    @admin.display(description="event")
    def event_type(self, obj):
        return f"{obj.event.type}{' (test)' if obj.event.test else ''}"

    @admin.display(description="batch")
    def batch(self, obj):
        if not obj.event.batch_id:
            return "—"
        url = reverse("admin:batches_batch_change", args=[obj.event.batch_id])
        return format_html('<a class="relay-id" href="{}">{}</a>', url, short_id(obj.event.batch_id))

    def lookup_allowed(self, lookup, value, request=None):
        # A batch's page links to its deliveries (?event__batch_id=…).
        return lookup == "event__batch_id" or super().lookup_allowed(lookup, value, request)

    @admin.display(description="body sent")
    def body(self, obj):
        return format_html(
            "<pre style='white-space:pre-wrap'>{}</pre>", json.dumps(json.loads(obj.event.body), indent=2)
        )

    @admin.action(description="Re-send (same webhook-id)", permissions=["operate"])
    def resend(self, request, queryset):
        for delivery in queryset:
            services.resend(delivery)
        self.message_user(request, f"Re-sent {queryset.count()} deliveries.")
