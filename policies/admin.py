from django.contrib import admin

from policies.models import Policy, PolicyHostKey, RateLimit, RateLimitRule


class RateLimitRuleInline(admin.TabularInline):
    model = RateLimitRule
    extra = 1


@admin.register(RateLimit)
class RateLimitAdmin(admin.ModelAdmin):
    list_display = ("name", "enabled", "rule_summary")
    list_filter = ("enabled",)
    search_fields = ("name",)
    inlines = [RateLimitRuleInline]

    @admin.display(description="rules")
    def rule_summary(self, obj):
        return "; ".join(str(r) for r in obj.rules.all())


class PolicyHostKeyInline(admin.TabularInline):
    model = PolicyHostKey
    extra = 1
    ordering = ("position",)
    verbose_name = "host key in the pool (order matters for prioritized)"


@admin.register(Policy)
class PolicyAdmin(admin.ModelAdmin):
    list_display = ("name", "project", "key_selection", "rate_limit", "enabled", "batch_enabled", "batch_share")
    list_filter = ("enabled", "batch_enabled", "key_selection", "project")
    search_fields = ("name", "project__name")
    inlines = [PolicyHostKeyInline]
