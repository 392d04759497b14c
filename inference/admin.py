from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from inference import adapters, broker
from inference.admin_live import log_action
from inference.models import Adapter, InferenceRequest

ACTIVE = [InferenceRequest.Status.QUEUED, InferenceRequest.Status.RUNNING]


@admin.register(InferenceRequest)
class InferenceRequestAdmin(admin.ModelAdmin):
    """History is written by the service; the admin reads it and may cancel live rows."""

    list_display = [
        "id", "tenant", "kind", "model", "status", "finish_reason", "prompt_tokens",
        "cached_tokens", "cache_hit", "cache_tier", "completion_tokens", "ttft_ms", "duration_ms",
        "created",
    ]
    list_filter = ["tenant", "status", "model", "finish_reason", "cache_hit", "cache_tier",
                   ("created", admin.DateFieldListFilter)]
    list_select_related = ["tenant"]
    search_fields = ["id", "session"]
    date_hierarchy = "created"
    actions = ["cancel_requests"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    @admin.action(description="Cancel selected queued or running requests")
    def cancel_requests(self, request: HttpRequest, queryset: QuerySet[InferenceRequest]) -> None:
        rows = list(queryset.filter(status__in=ACTIVE))
        for row in rows:
            broker.publish_cancel_sync(str(row.id))
            log_action(request, f"Cancelled request {row.id}", row, repr_=str(row))
        self.message_user(request, f"Cancel sent for {len(rows)} request(s).", messages.SUCCESS)


@admin.register(Adapter)
class AdapterAdmin(admin.ModelAdmin):
    """Tenants' LoRA adapters (docs/adapters.md). Adding one checks its file (inside
    ADAPTERS_DIR, a LoRA for the base model); afterwards only its default scale changes.
    Deleting one sends ``unload_adapter`` to the live daemons of its model."""

    list_display = ["__str__", "tenant", "model", "key", "default_scale", "rank", "size_bytes",
                    "loaded_on", "created"]
    list_filter = ["tenant", "model"]
    list_select_related = ["tenant"]
    search_fields = ["name", "key", "model", "tenant__slug"]
    ADDED_FIELDS = ["tenant", "model", "name", "file", "key", "sha256", "size_bytes", "rank",
                    "alpha", "created"]

    def get_fields(self, request: HttpRequest, obj: Adapter | None = None) -> list[str]:
        if obj is None:
            return ["tenant", "model", "name", "file", "default_scale"]
        return [*self.ADDED_FIELDS, "default_scale", "loaded_on"]

    def get_readonly_fields(self, request: HttpRequest, obj: Adapter | None = None) -> list[str]:
        return [] if obj is None else [*self.ADDED_FIELDS, "loaded_on"]

    @admin.display(description="loaded on")
    def loaded_on(self, obj: Adapter) -> str:
        """The live daemons whose snapshot lists it loaded."""
        try:
            daemons = adapters.loaded_on().get(obj.key, [])
        except Exception:  # a page of the admin answers when Redis does not
            return "?"
        return ", ".join(daemons) or "-"
