"""Django admin is the operator UI. Secrets are write-only everywhere."""

from django import forms
from django.contrib import admin, messages
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin

from core import services
from core.models import (
    Host,
    HostBinding,
    HostKey,
    LLMModel,
    Pricing,
    Project,
    RelayKey,
    RevokedToken,
    ServiceAccount,
    Team,
    User,
    kind_binding_problem,
)

# Django's left-hand model list takes 300 px of every page, which a 1280 px laptop needs for the lists' columns:
# the landing page lists the models, and every page links back to it.
admin.site.enable_nav_sidebar = False


@admin.register(User)
class UserAdmin(BaseUserAdmin):
    fieldsets = BaseUserAdmin.fieldsets + (("Inference tokens", {"fields": ("token_version",)}),)
    actions = ["revoke_all_tokens"]

    @admin.action(description="Revoke every inference token of the selected users", permissions=["change"])
    def revoke_all_tokens(self, request, queryset):
        for user in queryset:
            user.bump_token_version()
        self.message_user(request, f"Revoked the tokens of {queryset.count()} user(s).")


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ("name", "created_at")
    search_fields = ("name",)


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ("name", "team", "default_policy", "created_at")
    list_filter = ("team",)
    search_fields = ("name", "team__name")


@admin.register(ServiceAccount)
class ServiceAccountAdmin(admin.ModelAdmin):
    list_display = ("name", "project", "policy", "created_at")
    list_filter = ("project",)
    search_fields = ("name", "project__name")


class HostForm(forms.ModelForm):
    class Meta:
        model = Host
        fields = ("name", "kind", "base_url", "options")
        help_texts = {
            "kind": "How the host is reached (docs/providers/). Empty: each binding's adapter picks OpenAI's or "
            "Anthropic's wire.",
            "options": 'The kind\'s settings, such as {"api_version": "2024-10-21"} for azure_openai.',
        }

    def clean(self):
        data = super().clean()
        if self.instance.pk and "kind" in data:
            probe = Host(kind=data["kind"])
            for binding in self.instance.bindings.select_related("model").order_by("id"):
                problem = kind_binding_problem(probe, binding.adapter, binding.batch_mode)
                if problem:
                    raise forms.ValidationError({"kind": f"binding {binding}: {problem}"})
        return data


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):
    form = HostForm
    list_display = ("name", "kind", "base_url")
    list_filter = ("kind",)
    search_fields = ("name", "base_url")


@admin.register(LLMModel)
class LLMModelAdmin(admin.ModelAdmin):
    list_display = ("name", "provider")
    list_filter = ("provider",)
    search_fields = ("name", "provider")


@admin.register(Pricing)
class PricingAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "input_nanos_per_mtok",
        "output_nanos_per_mtok",
        "cache_read_nanos_per_mtok",
        "cache_write_nanos_per_mtok",
    )
    search_fields = ("name",)


@admin.register(HostBinding)
class HostBindingAdmin(admin.ModelAdmin):
    list_display = ("model", "host", "adapter", "upstream_name", "pricing", "enabled")
    list_filter = ("adapter", "enabled", "host")
    search_fields = ("model__name", "host__name", "upstream_name")


class HostKeyForm(forms.ModelForm):
    # Write-only: the stored value is never rendered back into the page.
    value = forms.CharField(
        required=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="Stored encrypted with RELAY_MASTER_KEY. Leave empty to keep the current value.",
    )

    class Meta:
        model = HostKey
        fields = (
            "name",
            "host",
            "value",
            "value_env",
            "openai_organization",
            "openai_project",
            "rate_limit",
            "enabled",
        )

    def clean(self):
        data = super().clean()
        has_stored = bool(self.instance.pk and self.instance.value_encrypted)
        if data.get("value") and data.get("value_env"):
            raise forms.ValidationError("Give a value or an environment variable name, not both.")
        if not data.get("value") and not data.get("value_env") and not has_stored:
            raise forms.ValidationError("Give a value or an environment variable name.")
        return data

    def save(self, commit=True):
        key = super().save(commit=False)
        if self.cleaned_data.get("value"):
            key.set_value(self.cleaned_data["value"])
        elif key.value_env:
            key.value_encrypted = ""
        if commit:
            key.save()
        return key


@admin.register(HostKey)
class HostKeyAdmin(admin.ModelAdmin):
    form = HostKeyForm
    list_display = ("name", "host", "source", "rate_limit", "enabled")
    list_filter = ("host", "enabled")
    search_fields = ("name", "host__name", "value_env")

    @admin.display(description="value")
    def source(self, obj):
        return f"env ${obj.value_env}" if obj.value_env else "stored (encrypted)"


@admin.register(RelayKey)
class RelayKeyAdmin(admin.ModelAdmin):
    list_display = ("prefix", "name", "principal", "policy", "enabled", "expires_at", "revoked_at", "created_at")
    list_filter = ("enabled", "policy", "service_account__project")
    search_fields = ("prefix", "name", "service_account__name", "user__username")
    list_select_related = ("service_account__project", "user", "policy")
    readonly_fields = ("prefix", "previous_key_hash", "grace_until", "revoked_at", "created_at")
    fields = (
        "name",
        "service_account",
        "user",
        "project",
        "policy",
        "enabled",
        "expires_at",
        "prefix",
        "previous_key_hash",
        "grace_until",
        "revoked_at",
        "created_at",
    )
    actions = ["revoke_keys"]

    @admin.display(description="principal")
    def principal(self, obj):
        if obj.service_account_id:
            return f"{obj.service_account.name} ({obj.service_account.project.name})"
        return f"user {obj.user.username}"

    def save_model(self, request, obj, form, change):
        if not change:
            plaintext = services.assign_new_value(obj)
            super().save_model(request, obj, form, change)
            # Shown once, here; only the hash is stored.
            messages.warning(request, f"New relay key (copy it now, it will not be shown again): {plaintext}")
            return
        super().save_model(request, obj, form, change)

    @admin.action(description="Revoke the selected relay keys", permissions=["change"])
    def revoke_keys(self, request, queryset):
        for key in queryset:
            services.revoke_relay_key(key)
        self.message_user(request, f"Revoked {queryset.count()} key(s).")


@admin.register(RevokedToken)
class RevokedTokenAdmin(admin.ModelAdmin):
    list_display = ("jti", "revoked_at", "expires_at")
    search_fields = ("jti",)
