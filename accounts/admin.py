from datetime import timedelta
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Count, F, Q, QuerySet, Sum
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html

from accounts.audit import record
from accounts.models import KEY_LIMITS, ApiKey, AuditEvent, Membership, Tenant
from console.forms import InviteForm, invite

TENANT_LIMITS = ["requests_per_minute", "tokens_per_minute", "max_concurrent",
                 "monthly_token_budget", "max_queued"]
KEY_SETTINGS = ["name", "expires_at", "allowed_models", "read_only", *KEY_LIMITS]


def _changes(form: Any, fields: list[str]) -> dict[str, list[Any]]:
    """Each of ``fields`` the admin form changed → [old, new] (the audit log's detail)."""
    def plain(value: Any) -> Any:
        return value.isoformat() if hasattr(value, "isoformat") else value
    pairs = {name: [plain(form.initial.get(name)), plain(form.cleaned_data.get(name))]
             for name in fields if name in form.changed_data}
    return {name: pair for name, pair in pairs.items() if pair[0] != pair[1]}


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

    def save_model(self, request: HttpRequest, obj: Tenant, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        changes = _changes(form, TENANT_LIMITS)
        if change and changes:
            record(AuditEvent.Action.TENANT_LIMITS, tenant=obj, request=request,
                   target=obj.slug, detail=changes)


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["__str__", "tenant", "created", "created_by", "expires_at", "last_used_at",
                    "revoked_at", "read_only"]
    list_filter = ["tenant", ("revoked_at", admin.EmptyFieldListFilter), "read_only"]
    search_fields = ["prefix", "name", "tenant__slug"]
    list_select_related = ["tenant", "created_by"]
    actions = ["revoke_keys"]

    def get_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        if obj is None:
            return ["tenant", *KEY_SETTINGS]
        return ["tenant", *KEY_SETTINGS, "prefix", "created", "created_by", "last_used_at",
                "revoked_at", "rotated_from"]

    def get_readonly_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        if obj is None:
            return []
        return ["tenant", "prefix", "created", "created_by", "last_used_at", "revoked_at",
                "rotated_from"]

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            changes = _changes(form, KEY_SETTINGS)
            if changes:
                record(AuditEvent.Action.KEY_UPDATE, tenant=obj.tenant, request=request,
                       target=str(obj), detail=changes)
            return
        obj.created_by = request.user
        plaintext = obj.assign_secret()
        super().save_model(request, obj, form, change)
        record(AuditEvent.Action.KEY_CREATE, tenant=obj.tenant, request=request,
               target=str(obj), detail=_changes(form, KEY_SETTINGS))
        messages.warning(request, f"New API key, shown only now — copy it: {plaintext}")

    @admin.action(description="Revoke selected keys")
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        keys = list(queryset.filter(revoked_at__isnull=True).select_related("tenant"))
        for key in keys:  # one save each: this process's key cache forgets each key at once
            key.revoke()
            record(AuditEvent.Action.KEY_REVOKE, tenant=key.tenant, request=request,
                   target=str(key), detail={"revoked_at": [None, key.revoked_at.isoformat()]})
        self.message_user(request, f"Revoked {len(keys)} key(s).", messages.SUCCESS)


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    """Tenants' console users. Adding one is an invite (a user, its membership, a mail with
    the link that sets its password: console/forms.py ``invite``)."""

    list_display = ["user", "tenant", "role", "created", "invited_by"]
    list_filter = ["tenant", "role"]
    search_fields = ["user__username", "user__email", "tenant__slug"]
    list_select_related = ["user", "tenant", "invited_by"]
    fields = ["user", "tenant", "role", "created", "invited_by"]
    readonly_fields = ["user", "tenant", "created", "invited_by"]

    def get_urls(self) -> list:
        invite = self.admin_site.admin_view(self.invite_view)
        return [path("invite/", invite, name="accounts_membership_invite"), *super().get_urls()]

    def add_view(self, request: HttpRequest, form_url: str = "",
                 extra_context: dict | None = None) -> HttpResponse:
        return redirect("admin:accounts_membership_invite")

    def invite_view(self, request: HttpRequest) -> HttpResponse:
        """The operator's invite: email, tenant, role."""
        if not self.has_add_permission(request):
            raise PermissionDenied
        form = InviteForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            data = form.cleaned_data
            _, link = invite(data["email"], data["tenant"], data["role"],
                             base_url=request.build_absolute_uri("/").rstrip("/"),
                             request=request, invited_by=request.user)
            self.message_user(request, f"Invited {data['email']}: the mail with the link that "
                                       f"sets a password is sent ({link}).", messages.SUCCESS)
            return redirect("admin:accounts_membership_changelist")
        return TemplateResponse(request, "admin/accounts/membership/invite.html", {
            **self.admin_site.each_context(request), "form": form, "opts": self.model._meta,
            "title": "Invite a member"})

    def save_model(self, request: HttpRequest, obj: Membership, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        if change and "role" in form.changed_data:
            record(AuditEvent.Action.MEMBER_UPDATE, tenant=obj.tenant, request=request,
                   target=obj.user.get_username(),
                   detail={"role": [form.initial.get("role"), obj.role]})

    def delete_model(self, request: HttpRequest, obj: Membership) -> None:
        record(AuditEvent.Action.MEMBER_REMOVE, tenant=obj.tenant, request=request,
               target=obj.user.get_username(), detail={"role": [obj.role, None]})
        super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Membership]) -> None:
        for membership in queryset.select_related("tenant", "user"):
            record(AuditEvent.Action.MEMBER_REMOVE, tenant=membership.tenant, request=request,
                   target=membership.user.get_username(),
                   detail={"role": [membership.role, None]})
        super().delete_queryset(request, queryset)


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    """Every tenant's audit log, read-only (accounts/audit.py writes it)."""

    list_display = ["created", "tenant", "actor_name", "action", "target", "address"]
    list_filter = ["action", "tenant"]
    search_fields = ["actor_name", "target", "tenant__slug"]
    list_select_related = ["tenant"]
    date_hierarchy = "created"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
