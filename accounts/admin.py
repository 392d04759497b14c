from datetime import timedelta
from typing import Any

from django.contrib import admin, messages
from django.db.models import Count, F, Q, QuerySet, Sum
from django.db.models.functions import Coalesce
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from accounts.models import ApiKey, Tenant


def _usage(since: timezone.datetime) -> tuple[Count, Sum]:
    """Requests and tokens (prompt + completion) of rows created since ``since``."""
    recent = Q(requests__created__gte=since)
    tokens = Coalesce(F("requests__prompt_tokens"), 0) + Coalesce(
        F("requests__completion_tokens"), 0)
    return Count("requests", filter=recent), Coalesce(Sum(tokens, filter=recent), 0)


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    """Tenants with their last 24 h / 30 days of use (one aggregate query per page)."""

    list_display = ["slug", "name", "is_active", "requests_24h", "tokens_24h",
                    "requests_30d", "tokens_30d", "cache_read_30d", "cache_created_30d",
                    "adapters", "created"]
    list_filter = ["is_active"]
    search_fields = ["slug", "name"]
    prepopulated_fields = {"slug": ["name"]}
    fieldsets = [
        (None, {"fields": ["name", "slug", "is_active"]}),
        ("Limits (empty = unlimited)", {"fields": [
            "requests_per_minute", "tokens_per_minute", "max_concurrent", "monthly_token_budget",
            "max_queued"]}),
    ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Tenant]:
        now = timezone.now()
        day_requests, day_tokens = _usage(now - timedelta(hours=24))
        month = now - timedelta(days=30)
        month_requests, month_tokens = _usage(month)
        recent = Q(requests__created__gte=month)
        return super().get_queryset(request).annotate(
            requests_24h=day_requests, tokens_24h=day_tokens,
            requests_30d=month_requests, tokens_30d=month_tokens,
            cache_read_30d=Coalesce(Sum("requests__cached_tokens", filter=recent), 0),
            cache_created_30d=Coalesce(Sum("requests__cache_created_tokens", filter=recent), 0))

    def _count(field: str, description: str) -> Any:  # a helper for the class body
        """A column showing an annotated count, sortable by it."""
        return admin.display(description=description, ordering=field)(
            lambda self, obj: getattr(obj, field))

    requests_24h = _count("requests_24h", "requests 24 h")
    tokens_24h = _count("tokens_24h", "tokens 24 h")
    requests_30d = _count("requests_30d", "requests 30 d")
    tokens_30d = _count("tokens_30d", "tokens 30 d")
    cache_read_30d = _count("cache_read_30d", "cached 30 d")
    cache_created_30d = _count("cache_created_30d", "cache created 30 d")
    del _count

    @admin.display(description="adapters")
    def adapters(self, obj: Tenant) -> str:
        """A link to the tenant's LoRA adapters (inference's adapter admin)."""
        url = reverse("admin:inference_adapter_changelist")
        return format_html('<a href="{}?tenant__id__exact={}">adapters</a>', url, obj.pk)


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["__str__", "tenant", "created", "last_used_at", "revoked_at"]
    list_filter = ["tenant", ("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["prefix", "name", "tenant__slug"]
    list_select_related = ["tenant"]
    actions = ["revoke_keys"]

    def get_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        if obj is None:
            return ["tenant", "name"]
        return ["tenant", "name", "prefix", "created", "last_used_at", "revoked_at"]

    def get_readonly_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        if obj is None:
            return []
        return ["tenant", "prefix", "created", "last_used_at", "revoked_at"]

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        plaintext = obj.assign_secret()
        super().save_model(request, obj, form, change)
        messages.warning(request, f"New API key, shown only now — copy it: {plaintext}")

    @admin.action(description="Revoke selected keys")
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        keys = list(queryset.filter(revoked_at__isnull=True))
        for key in keys:  # one save each: this process's key cache forgets each key at once
            key.revoke()
        self.message_user(request, f"Revoked {len(keys)} key(s).", messages.SUCCESS)
